"""Every rank sees one checkpoint directory (real gloo jobs, ddp, fsdp and hsdp): a per-node directory, ranks passing
different steps, and a directory another live job holds are one line on every rank, with nothing committed,
deleted or loaded apart."""
import json
import os
import socket
import time

import pytest

from conftest import WORKERS, launch, ok
from ddpkit.checkpoint import lock

SPLIT = WORKERS / "ckpt_agree_split.py"


def _hold(directory):
    """A lock in ``directory`` naming this (live) pytest process, of another job."""
    directory.mkdir(parents=True)
    (directory / lock.LOCK).write_text(json.dumps({
        "host": socket.gethostname(), "pid": os.getpid(), "start": lock._process_start(os.getpid()),
        "job": "other-job", "since": time.time(), "token": "t" * 32}))


def _run(tmp_path, mode):
    _hold(tmp_path / "held")
    ok(launch(SPLIT, tmp_path, launcher_args=("--mode", mode), timeout=150))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in ("split restore", "steps", "held"):  # every rank raised the same line
        assert ranks[0][name] == ranks[1][name], (name, ranks)
    return ranks


def _steps_and_lock(ranks, tmp_path):
    kind, line = ranks[0]["steps"]
    assert kind == "ValueError" and "the ranks passed different steps to save()" in line, line
    assert "rank 0 step 4, rank 1 step 5" in line and "nothing was written or deleted" in line, line
    for r in ranks:  # keep=1 deleted nothing: ckpt-2 is still there, alone and valid
        assert r["after steps"] == [["ckpt-0000000002"], "ckpt-0000000002"], r
    kind, line = ranks[0]["held"]
    assert kind == "DirectoryInUse" and f"in use by another job (job other-job, pid {os.getpid()}" in line, line
    assert not [n for n in os.listdir(tmp_path / "held") if n.startswith("ckpt-")]  # nothing written there
    assert "\n" not in line and "\n" not in ranks[0]["steps"][1]


def test_ddp_node_local_directories_stop_the_resume_on_every_rank(tmp_path):
    ranks = _run(tmp_path, "ddp")
    # in ddp rank 0 alone writes: its node holds the checkpoints, rank 1's none
    assert ranks[0]["after split save"] == ["ckpt-0000000003", "ckpt-0000000006"]
    assert ranks[1]["after split save"] == []
    kind, line = ranks[0]["split restore"]
    assert kind == "SplitDirectory", ranks[0]
    assert line.startswith("ranks disagree on the checkpoint directory "), line
    assert "rank 0 sees step 6 (ckpt-0000000006, the newest of 2), rank 1 sees no checkpoint" in line, line
    assert "one shared directory on every node" in line and "\n" not in line
    # a per-node copy of the same checkpoints is not refused: both ranks resume step 6
    assert ranks[0]["copied restore"] == ranks[1]["copied restore"] == "ok 6", ranks
    _steps_and_lock(ranks, tmp_path)
    # restore(path=...) of two checkpoints that share a name (A/ckpt-5, B/ckpt-5): the manifests differ, refused
    assert ranks[0]["path split"] == ranks[1]["path split"], ranks
    kind, line = ranks[0]["path split"]
    assert kind == "SplitDirectory" and line.startswith("ranks disagree on the checkpoint to restore from "), line
    assert "rank 0 passed ckpt-0000000005 (manifest " in line and ", rank 1 passed ckpt-0000000005 (manifest " in line
    # a saved generator state refused by rank 1's generator alone: the same line on every rank (a review)
    assert ranks[0]["rng split"] == ranks[1]["rng split"], ranks
    kind, line = ranks[0]["rng split"]
    assert kind == "ValueError" and "refused by its generator" in line and line.endswith("(on rank 1)"), line


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_sharded_node_local_directories_stop_the_save_before_it_commits(tmp_path, mode):
    ranks = _run(tmp_path, mode)
    assert ranks[0]["split save"] == ranks[1]["split save"], ranks
    kind, line = ranks[0]["split save"]
    assert kind == "SplitDirectory", ranks[0]
    assert line.startswith("checkpoint step 3 was not saved: ranks disagree on the checkpoint directory "), line
    assert "does not see the shards that rank 1 wrote (shards/__1_0.distcp)" in line, line
    assert "there is no earlier checkpoint" in line and "\n" not in line
    assert ranks[0]["after split save"] == ranks[1]["after split save"] == []  # nothing committed on either node
    assert not os.listdir(tmp_path / "node1")  # rank 1's part of the refused save is gone too
    kind, line = ranks[0]["async split save"]
    assert ranks[1]["async split save"] == [kind, line] and kind == "RuntimeError", ranks
    assert line.startswith("checkpoint step 3 was not saved: writing in the background failed on rank 0 (Split"
                           "Directory: rank 0, which commits, does not see the shards of rank 1 (shards/__1_0.distcp)"
                           f": {tmp_path / 'async0'} is no shared directory on every node)"), line
    # nothing committed on either node (rank 1's own copy of the temporary directory stays there: only rank 0 cleans)
    assert [n for r in ranks for n in r["after async split save"] if ".tmp-" not in n] == []
    # per-node copies of two saves under one name: the shards of two checkpoints mixed, silently (a review)
    assert ranks[0]["mixed copies"] == ranks[1]["mixed copies"], ranks
    kind, line = ranks[0]["mixed copies"]
    assert kind == "SplitDirectory" and "rank 0 would load ckpt-0000000007 (manifest " in line, line
    # a node's damaged copy of a shard file that only its own rank reads: each rank hashes what it reads (a review)
    said = [[kind, line.replace(f"copy{r}", "copyR")] for r, (kind, line) in enumerate(x["damaged copy"]
                                                                                        for x in ranks)]
    assert said[0] == said[1], ranks  # the same line, each naming its own copy
    kind, line = said[0]
    assert kind == "UnsafeCheckpoint" and "shards/__1_0.distcp does not match its sha256" in line, line
    assert "rank 1" in line and "\n" not in line, line
    said = {r: x["damaged state"] for r, x in enumerate(ranks)}  # state.pt, read by every rank (a review)
    assert said[0][0] == said[1][0] == "UnsafeCheckpoint", said
    assert "state.pt does not match its sha256" in said[0][1] and "(on rank 0)" in said[0][1], said
    assert ranks[0]["split restore"] == "ok 0", ranks  # no node holds anything: a fresh start on both
    _steps_and_lock(ranks, tmp_path)

