"""Background checkpoints (``async_save=True``) keep a synchronous save's promises where a script ends or fails
unusually, real 2-process gloo jobs: the usual ``dist.destroy_process_group()`` at the end, a save that finds the
previous write failed, a peer that dies during a sharded write."""
import json
import os
import socket
import subprocess
import sys

import pytest

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


def test_destroy_process_group_during_a_sharded_write_is_kept_or_said_with_its_fix(tmp_path):
    """fsdp: step 2 was lost, said as a gloo error on rank 0. DCP's write needs its group until its last collective
    and torch offers no hook at destroy_process_group(): a destroy after that collective keeps the checkpoint (rank
    0's commit and its outcome need no group), one before it is one line naming the destroy and the fix."""
    r = launch(WORKER, tmp_path, "destroy", launcher_args=("--mode", "fsdp"), timeout=150)
    kept = validate(str(tmp_path / "ckpt" / "ckpt-0000000002")) is None
    if kept:
        ok(r)
        assert "not saved" not in r.stderr, r.stderr[-2000:]
    else:
        assert r.returncode == 1 and "ckpt.wait() before destroy_process_group()" in r.stderr, r.stderr[-2000:]
        assert "Connection closed" not in r.stderr
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001"]  # nothing of it left


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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_peer_that_dies_during_a_sharded_write_is_the_rank_named(tmp_path):
    """Rank 0's writer saw its DCP collective break and said the write "failed on rank 0". Without the launcher:
    it would stop rank 0 as soon as rank 1 died."""
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "DDPKIT_MODE": "fsdp", "OMP_NUM_THREADS": "1"}
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
    assert "ddpkit: checkpoint step 2: its background write failed on rank 1 (its process ended during the write; " \
           "rank 0 saw: " in said, said[-3000:]
    assert "failed on rank 0" not in said
    got = json.loads((tmp_path / "died.json").read_text())
    assert "ckpt-0000000002" not in got["listing"]  # nothing of it committed
