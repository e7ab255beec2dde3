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
    from collections import OrderedDict, defaultdict

    w = torch.ones(3)
    counts = defaultdict(int, {"a": 1})
    staged = stage({"model": OrderedDict(w=w), "groups": [{"params": [0]}], "pair": (w, "x"), "counts": counts})
    w.add_(1)
    assert staged["model"]["w"].tolist() == [1.0] * 3 and staged["pair"][0].tolist() == [1.0] * 3
    assert staged["groups"] == [{"params": [0]}] and staged["pair"][1] == "x"
    assert type(staged["model"]) is OrderedDict and staged["counts"] == counts  # a defaultdict raised TypeError


def test_latest_and_a_second_checkpointer_wait_for_the_write_in_flight(tmp_path):
    """keep=1: latest() named the checkpoint the write's commit was about to remove; a second Checkpointer of the
    directory removed the write's temporary directory as a leftover of a killed save."""
    import ddpkit

    sys.path.insert(0, str(WORKERS))
    ddpkit.init()
    model = ddpkit.prepare_model(torch.nn.Linear(3, 2))
    ckpt = ddpkit.Checkpointer(str(tmp_path / "run"), keep=1, async_save=True)
    ckpt.save(1, model=model)
    ckpt.wait()
    slow = __import__("async_ckpt_slow").SlowState(1.0)
    ckpt.save(2, model=model, slow=slow)
    ddpkit.Checkpointer(str(tmp_path / "run"), resume=True)  # while step 2 is being written
    latest = ckpt.latest()
    assert latest is not None and latest.endswith("ckpt-0000000002"), latest
    assert ckpt.restore(latest, model=model) == 2


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_each_background_save_holds_its_steps_weights_and_the_last_is_finished_at_exit(tmp_path, mode):
    ok(launch(WORKER, tmp_path, "train", launcher_args=("--mode", mode)))
    snaps = torch.load(tmp_path / "snaps.pt")
    for step in (1, 2, 3):
        path = tmp_path / "ckpt" / f"ckpt-{step:010d}"
        assert validate(str(path)) is None, step  # whole and checksummed, step 3 too (written while exiting)
        # step 2 was still being written when a second Checkpointer cleared the directory's leftovers: not one
        assert json.loads((path / "manifest.json").read_text())["extra"] == {"step": step}  # staged at save()
        got = full_model_state(str(path))
        assert all(torch.equal(got[k], snaps[step][k]) for k in snaps[step]), (mode, step)
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("mode, rank", [("ddp", 0), ("fsdp", 1)])
def test_a_failed_background_write_is_raised_on_every_rank_and_fails_the_exit(tmp_path, mode, rank):
    r = launch(WORKER, tmp_path, "fail", launcher_args=("--mode", mode, "--log-dir", tmp_path / "logs"))
    assert r.returncode == 1, r.stderr[-3000:]  # the last save's write failed: the run failed (it exited 0)
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
    # step 4 failed after the script's last line: every rank's writer learnt it (fsdp: from DCP; ddp: rank 0 tells
    # the others), so every rank says so at exit and exits 1, asking no peer then (one may be gone already)
    for i in (0, 1):
        assert f"checkpoint step 4 was not saved: its background write failed on rank {rank} (OSError: [Errno 27]" \
            in logs[i], logs[i]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001", "ckpt-0000000003"]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_rank_that_leaves_during_a_background_write_fails_the_run_cleanly(tmp_path, mode):
    """Its exit asked the peers for the write's outcome while they trained on: ddp hung until the collective
    timeout, fsdp aborted in a collective mismatch (SIGABRT)."""
    r = launch(WORKER, tmp_path, "exit", launcher_args=("--mode", mode), timeout=150)
    assert r.returncode == 1
    assert "rank 1 exited with code 3, the first rank to stop" in r.stderr, r.stderr[-3000:]
    assert "HANG" not in r.stderr and "SIGABRT" not in r.stderr
    assert validate(str(tmp_path / "ckpt" / "ckpt-0000000002")) is None  # the write in flight still committed


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


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_every_rank_names_the_checkpoint_a_write_in_flight_commits(tmp_path, mode):
    """keep=1: rank 1's write ended before rank 0's commit (ddp: it writes nothing), so it named ckpt-1, which
    the commit removed, and its restore(latest()) failed alone."""
    ok(launch(WORKER, tmp_path, "latest", launcher_args=("--mode", mode)))
    for rank in (0, 1):
        named = json.loads((tmp_path / f"latest{rank}.json").read_text())
        assert named == {"checkpoints": ["ckpt-0000000002"], "latest": "ckpt-0000000002", "restored": 2}, rank


def test_an_explicit_shutdown_raises_a_failed_last_write_and_a_later_run_starts_clean(tmp_path):
    """It exited... nothing: shutdown() returned, a later successful run in the process still exited 1, and a
    Checkpointer used again after shutdown() + init() lost its exit hook (its failure exited 0)."""
    import ddpkit
    from ddpkit.core.errors import ShutdownError

    sys.path.insert(0, str(WORKERS))
    from async_ckpt_slow import FullState

    model = torch.nn.Linear(2, 2)
    ddpkit.init()
    ckpt = ddpkit.Checkpointer(str(tmp_path / "run"), async_save=True)
    ckpt.save(1, model=model)
    ckpt.save(2, model=model, full=FullState())
    with pytest.raises(ShutdownError, match=r"^checkpoint step 2 was not saved: its background write failed on rank "
                                            r"0 \(OSError: \[Errno 28\] No space left on device\)"):
        ddpkit.shutdown()
    ddpkit.shutdown()  # said once: nothing left to raise
    ddpkit.init()
    ckpt.save(3, model=model, full=FullState())  # the same Checkpointer, after shutdown() and init()
    with pytest.raises(ShutdownError, match="step 3 was not saved"):
        ddpkit.shutdown()
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt-0000000001"]  # nothing of 2 or 3 left
    ddpkit.init()
    ckpt.save(4, model=model)
    ddpkit.shutdown()  # a later run that saved: no stale failure


def test_a_spawned_worker_whose_last_write_failed_fails_the_spawn(tmp_path):
    """A forked ddpkit.spawn worker (the notebook path) ends in os._exit(0): its failed last write was a success."""
    code = (f"import sys; sys.path.insert(0, {str(WORKERS)!r}); import ddpkit, async_ckpt_slow\n"
            f"try:\n    ddpkit.spawn(async_ckpt_slow.spawned, {str(tmp_path / 'run')!r}, nproc_per_node=2, "
            f"start_method='fork', log_dir={str(tmp_path / 'logs')!r})\n"
            "except ddpkit.SpawnError as exc:\n    print('SpawnError', exc.exit_code)\n")
    r = run_cmd([sys.executable, "-c", code], timeout=120)
    assert "SpawnError 1" in r.stdout, r.stdout + r.stderr[-3000:]
