"""Background checkpoints (``async_save=True``) keep a synchronous save's promises where a script ends or fails
unusually, real 2-process gloo jobs: the usual ``dist.destroy_process_group()`` at the end, a save that finds the
previous write failed, a peer that dies during a sharded write."""
import json
import os
import subprocess
import sys

import pytest
from test_multinode import free_port

from conftest import SCRATCH, WORKERS, launch, ok
from ddpkit.checkpoint.disk import validate

WORKER = WORKERS / "async_ckpt_edges.py"


def test_destroy_process_group_at_the_end_keeps_the_last_write_and_reports_it_saved(tmp_path):
    """ddp: step 2 was on disk but said "not saved" (rank 0 told the others over a destroyed group) and the run
    exited 1."""
    r = launch(WORKER, tmp_path, "destroy", launcher_args=("--mode", "ddp"), timeout=150)
    ok(r)
    assert json.loads((tmp_path / "destroyed.json").read_text()) == {"initialized": False}  # the group was gone
    assert validate(str(tmp_path / "ckpt" / "ckpt-0000000002")) is None
    assert "not saved" not in r.stderr and "failed" not in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001", "ckpt-0000000002"]


def test_destroy_process_group_during_a_sharded_write_keeps_it_and_reports_it_saved(tmp_path):
    """fsdp: step 2 was lost (DCP's write needed its group until its last collective, and the destroy came while
    each rank's shard was still being written: a slow disk). The plan is made in save() now, and the writes reach
    rank 0 over the store: the checkpoint is kept, whole, and said saved."""
    r = launch(WORKER, tmp_path, "destroy", launcher_args=("--mode", "fsdp"), timeout=150)
    ok(r)
    assert json.loads((tmp_path / "destroyed.json").read_text()) == {"initialized": False}
    assert validate(str(tmp_path / "ckpt" / "ckpt-0000000002")) is None
    assert "not saved" not in r.stderr and "failed" not in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001", "ckpt-0000000002"]


@pytest.mark.parametrize("mode, rank", [("ddp", 0), ("fsdp", 1)])
def test_a_save_that_raises_the_previous_failure_says_its_own_step_was_not_saved(tmp_path, mode, rank):
    """save(3) raised step 2's failure and skipped step 3 without a word: a sync save that raises saved nothing."""
    ok(launch(WORKER, tmp_path, "skip", launcher_args=("--mode", mode), timeout=150))
    for i in (0, 1):
        got = json.loads((tmp_path / f"skip{i}.json").read_text())
        assert got["error"].startswith(f"checkpoint step 2 was not saved: writing in the background failed on rank "
                                       f"{rank} (OSError: [Errno 27] File too large)"), got["error"]
        assert "; step 3 was not saved either" in got["error"] and "\n" not in got["error"], got["error"]
        assert got["returned"] is None and got["waited"] is None  # nothing of step 3 is pending either
        assert got["listing"] == ["ckpt-0000000001"]


def test_rank_zero_failing_after_the_shards_are_written_is_said_on_every_rank_at_once(tmp_path):
    """Rank 0's .metadata write failing (a full disk) was no outcome told: the other ranks waited for it the whole
    collective timeout, and rank 0 raised a gloo timeout (a review)."""
    ok(launch(WORKER, tmp_path, "metafail", launcher_args=("--mode", "fsdp"), timeout=150))
    got = [json.loads((tmp_path / f"metafail{r}.json").read_text()) for r in (0, 1)]
    for said in got:
        assert said["error"] and said["error"].startswith(
            "checkpoint step 2 was not saved: writing in the background failed on rank 0 (OSError: [Errno 28] "
            "No space left on device)"), said
        assert said["seconds"] < 30, said  # the worker's collective timeout is 60 s: no rank waited for it
        assert [n for n in said["listing"] if n.startswith("ckpt-")] == ["ckpt-0000000001"], said  # none of it


def test_a_peer_that_dies_during_a_sharded_write_is_the_rank_named(tmp_path):
    """Rank 0's writer saw its DCP collective break and said the write "failed on rank 0"; now no collective is left
    in the write: rank 1's pulse in the store stands still, and rank 0 names it. Without the launcher:
    it would stop rank 0 as soon as rank 1 died."""
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "DDPKIT_MODE": "fsdp", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "die"], cwd=SCRATCH, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9 and procs[0].returncode == 0, outs[0][1][-3000:]
    said = outs[0][1]
    assert "ddpkit: checkpoint step 2: its background write failed on rank 1 (its process ended during the write " \
           "(no sign of it for 10 s))" in said, said[-3000:]
    assert "failed on rank 0" not in said
    got = json.loads((tmp_path / "died.json").read_text())
    assert "ckpt-0000000002" not in got["listing"]  # nothing of it committed


@pytest.mark.parametrize("post, said", [
    (b"not json", "was refused (Expecting value"),
    (b'[["w", [0], 0, 10, "../../etc/passwd", 0, 10]]', "a row of another shape"),
    (b'[["w", [0], 0, 10, "__1_0.distcp/../x", 0, 10]]', "a row of another shape"),
    (b'[["w", [0], 0, 10, "__1_0.distcp", 0, 1e400]]', "a row of another shape"),
    (b'[["w", [0], 0, 100000000000000000000, "__1_0.distcp", 0, 10]]', "a row of another shape"),
    (b'[["w", [true], 0, 10, "__1_0.distcp", 0, 10]]', "a row of another shape"),
    (b'[["w", [0], 0, 10, "__1_0.distcp", 0]]', "was refused (not enough values"),
    (b'{"w": 1}', "was refused"),
    (b'[]', "it names 0 items, its plan 1 others"),  # a post that leaves out what the plan gave it (a review)
    (b'[["w", [0], 0, 10, "__0_0.distcp", 0, 10]]', "a row of another shape"),  # another rank's file
    (b'[["v", [0], 0, 10, "__1_0.distcp", 0, 10]]', "it names 1 items, its plan 1 others"),
])
def test_a_peers_crafted_record_of_its_writes_is_one_line_naming_it(post, said):
    """What a rank posts of its shard writes becomes rank 0's ``.metadata``: a crafted post (a path out of the
    checkpoint, numbers no file has, another shape) is refused, naming the rank, before anything is written."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    from ddpkit.checkpoint.planned import _results
    from ddpkit.checkpoint.reasons import PeerWriteError

    plan = SavePlan([WriteItem(MetadataIndex("w", torch.Size([0]), 0), WriteItemType.SHARD)],
                    storage_data=_StoragePrefix("__1_"))
    assert len(_results(b'[["w", [0], 0, 10, "__1_0.distcp", 0, 10]]', 1, plan)) == 1  # what the plan gave it
    with pytest.raises(PeerWriteError) as info:
        _results(post, 1, plan)
    assert info.value.failed_rank == 1 and said in str(info.value) and "\n" not in str(info.value), info.value


def test_rank_zero_reads_each_post_bounded_and_names_a_rank_that_failed():
    """Rank 0's wait for every rank's post, over a real store: a post over the bound, and a rank's own failure."""
    import torch.distributed as dist

    from ddpkit.checkpoint.outcome import Channel
    from ddpkit.checkpoint.reasons import PeerWriteError

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    big = Channel(store, 0, 2, "t/big", 5.0)
    big.post_writes("[]")
    Channel(store, 1, 2, "t/big", 5.0).post_writes("[" + "0," * 600 + "0]")
    with pytest.raises(PeerWriteError, match=r"rank 1: its record of what it wrote has 1203 bytes, over 1000"):
        big.writes(1000)
    failed = Channel(store, 0, 2, "t/failed", 5.0)
    Channel(store, 1, 2, "t/failed", 5.0).record([1, "OSError: [Errno 28] No space left on device", True])
    with pytest.raises(PeerWriteError, match=r"rank 1: OSError: \[Errno 28\]"):
        failed.writes(1000)
    for crafted in (b"not json", b'["x", 1, true]', b"[1, " + b"[" * 100 + b"]" * 100 + b", true]"):
        garbled = Channel(store, 0, 2, f"t/garbled{len(crafted)}", 5.0)
        store.set(f"t/garbled{len(crafted)}/failed/1", crafted)  # a peer's record that is no [rank, reason, io]
        with pytest.raises(PeerWriteError, match=r"^rank 1: its write failed \(its record of why was refused\)$"):
            garbled.writes(1000)


def test_a_post_over_the_stores_8_mb_goes_in_parts_and_is_removed_once_read():
    """The store refuses a value over 8 MB (a model of ~80k tensor shards per rank: its async save failed as a
    "Broken pipe" on rank 0), and every save's posts stayed in the store for the job's life (a review)."""
    import torch.distributed as dist

    from ddpkit.checkpoint.outcome import Channel
    from ddpkit.checkpoint.planned import LIMIT_POST

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    big = json.dumps([[f"layers.{i}.weight", [0], 0, 10, "__1_0.distcp", 0, 10] for i in range(200_000)])
    assert len(big) > 9 << 20
    Channel(store, 1, 2, "t/parts", 5.0).post_writes(big)
    rank0 = Channel(store, 0, 2, "t/parts", 5.0)
    rank0.post_writes("[]")
    assert [len(p) for p in rank0.writes(LIMIT_POST)] == [2, len(big)]
    assert store.num_keys() <= 1, store.num_keys()  # nothing of the posts is left (the store's own key aside)


def test_rank_zero_waiting_for_many_peers_calls_the_store_a_bounded_number_of_times():
    """Rank 0 looked at every missing peer (its post, its failure, its pulse: up to 4 calls) every 50 ms: 64 ranks
    still writing made ~4000 store calls a second, the store every rank's collectives also go through. Now two
    calls every 50 ms, and each missing peer every 0.5 s; a failure recorded is still seen within 50 ms."""
    import threading
    import time

    import torch.distributed as dist

    from ddpkit.checkpoint.outcome import Channel
    from ddpkit.checkpoint.reasons import PeerWriteError

    class Counted:  # the real store, its calls counted
        def __init__(self, store):
            self.store, self.calls = store, 0

        def __getattr__(self, name):
            self.calls += 1
            return getattr(self.store, name)

    store = Counted(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
    world = 64
    rank0 = Channel(store, 0, world, "t/many", 5.0)
    rank0.post_writes("[]")

    def late_failure():
        time.sleep(1.5)
        Channel(store.store, 7, world, "t/many", 5.0).record([7, "OSError: disk gone", True])

    threading.Thread(target=late_failure).start()
    start, before = time.monotonic(), store.calls
    with pytest.raises(PeerWriteError, match=r"rank 7: OSError: disk gone"):
        rank0.writes(1000)
    waited = time.monotonic() - start
    assert 1.5 <= waited < 5.0, waited  # seen from its record, not from a pulse gone still (10 s)
    assert (store.calls - before) / waited < 600, (store.calls - before, waited)  # was ~4000 a second
