"""Checkpoints written in the background (``Checkpointer(..., async_save=True)``), real processes on gloo: each
holds the weights of its step although training went on during the write; a write that fails on one rank is raised
on every rank at the next save and said at exit; a process killed during a write resumes from the previous one."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import SCRATCH, WORKERS, launch, ok, run_cmd
from ddpkit.checkpoint.background import stage
from ddpkit.checkpoint.dcp import full_model_state
from ddpkit.checkpoint.disk import validate

WORKER = WORKERS / "async_ckpt.py"


def test_staging_copies_every_tensor_so_the_next_step_cannot_change_it():
    w = torch.ones(3)
    staged = stage({"model": {"w": w}, "groups": [{"params": [0]}], "pair": (w, "x")})
    w.add_(1)
    assert staged["model"]["w"].tolist() == [1.0] * 3 and staged["pair"][0].tolist() == [1.0] * 3
    assert staged["groups"] == [{"params": [0]}] and staged["pair"][1] == "x"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_each_background_save_holds_its_steps_weights_and_the_last_is_finished_at_exit(tmp_path, mode):
    ok(launch(WORKER, tmp_path, "train", launcher_args=("--mode", mode)))
    snaps = torch.load(tmp_path / "snaps.pt")
    for step in (1, 2, 3):
        path = tmp_path / "ckpt" / f"ckpt-{step:010d}"
        assert validate(str(path)) is None, step  # whole and checksummed, step 3 too (written while exiting)
        got = full_model_state(str(path))
        assert all(torch.equal(got[k], snaps[step][k]) for k in snaps[step]), (mode, step)
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("mode, rank", [("ddp", 0), ("fsdp", 1)])
def test_a_failed_background_write_is_raised_on_every_rank_and_said_at_exit(tmp_path, mode, rank):
    r = ok(launch(WORKER, tmp_path, "fail", launcher_args=("--mode", mode, "--log-dir", tmp_path / "logs")))
    results = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    newest = tmp_path / "ckpt" / "ckpt-0000000001"
    for got in results:
        assert got["error"] == results[0]["error"]  # the same line on every rank
        assert got["error"].startswith(f"checkpoint step 2 was not saved: writing in the background failed on rank "
                                       f"{rank} (OSError: [Errno 27] File too large)"), got["error"]
        assert f"the newest checkpoint is still {newest}" in got["error"] and "\n" not in got["error"]
        assert got["after_failure"] == ["ckpt-0000000001"]  # nothing of step 2 left
        assert got["after_save"] == ["ckpt-0000000001", "ckpt-0000000003"]  # and the next save works
    assert results[0]["waited"] == "ckpt-0000000003" and results[1]["waited"] == ""  # the path on rank 0
    logs = {i: next((tmp_path / "logs").rglob(f"attempt_0/{i}/stderr.log")).read_text() for i in (0, 1)}
    # said at once on the rank it failed on, without waiting for the next save
    assert f"checkpoint step 2: its background write failed on rank {rank} (OSError: [Errno 27]" in logs[rank]
    for i in (0, 1):  # step 4 failed after the script's last line: every rank says so at exit
        assert "checkpoint step 4 was not saved: writing in the background failed" in logs[i], logs[i]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001", "ckpt-0000000003"]
    assert "Traceback" not in r.stderr


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint_bitwise(tmp_path):
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), "kill"], cwd=SCRATCH, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while proc.stdout.readline().strip() != "WRITING":
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        while not list((tmp_path / "ckpt").glob("ckpt-0000000002.tmp*")):  # the writer thread made it: in the write
            assert time.monotonic() < deadline, sorted(os.listdir(tmp_path / "ckpt"))
            time.sleep(0.05)
        partial = [p.name for p in (tmp_path / "ckpt").iterdir()]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert "ckpt-0000000002" not in partial and any(n.startswith("ckpt-0000000002.tmp") for n in partial), partial
    ok(run_cmd([sys.executable, str(WORKER), str(tmp_path), "resume"]))
    before, after = torch.load(tmp_path / "step1.pt"), torch.load(tmp_path / "resumed.pt")
    assert after["step"] == 1 and after["listing"] == ["ckpt-0000000001"]  # the partial write is cleaned away
    assert all(torch.equal(before["weights"][k], after["weights"][k]) for k in before["weights"])
    for saved, loaded in zip(before["optimizer"]["state"].values(), after["optimizer"]["state"].values()):
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
