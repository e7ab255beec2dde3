"""One job per checkpoint directory (real processes): a second live job is refused at its first save, a lock
left by a job that was SIGKILLed is taken over, and a resumed run of the directory is not refused."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import SCRATCH, run_cmd
from ddpkit.checkpoint import lock

TRAIN = textwrap.dedent("""
    import sys, time, torch, ddpkit
    ddpkit.init(cpu=True)
    directory, step, resume, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume", sys.argv[4]
    ckpt = ddpkit.Checkpointer(directory, resume=resume or None)
    model = torch.nn.Linear(2, 2)
    print("restored", ckpt.restore(model=model), flush=True)
    ckpt.save(step, model=model)
    print("saved", step, flush=True)
    if hold != "-":  # a job still training: the test kills it
        open(hold, "w").close()
        time.sleep(120)
""")


def _job(directory, step, resume=False):
    return run_cmd([sys.executable, "-c", TRAIN, directory, step, "resume" if resume else "fresh", "-"], timeout=120)


def test_a_second_live_job_is_refused_and_a_killed_jobs_lock_is_taken_over(tmp_path):
    directory, ready = str(tmp_path / "ckpt"), tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-c", TRAIN, directory, "3", "fresh", str(ready)], cwd=SCRATCH,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        held = json.loads((tmp_path / "ckpt" / lock.LOCK).read_text())
        assert held["pid"] == first.pid
        # a second job on the same directory, while the first trains: refused at its first save, one line
        second = _job(directory, 5, resume=True)
        assert second.returncode != 0, second.stdout
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith("ddpkit.checkpoint.lock.DirectoryInUse: checkpoint directory ") or \
            "DirectoryInUse: checkpoint directory " in line, second.stderr[-2000:]
        assert f"in use by another job (job {held['job']}, pid {first.pid} on " in line, line
        assert "restored 3" in second.stdout and "saved" not in second.stdout  # it read, and wrote nothing
        assert sorted(os.listdir(directory)) == [lock.LOCK, "ckpt-0000000003"]
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the first job dies holding its lock
        first.communicate()
    assert json.loads((tmp_path / "ckpt" / lock.LOCK).read_text())["pid"] == first.pid  # left behind
    # the run that resumes the killed job is not refused: the stale lock is taken over, then given back at exit
    resumed = _job(directory, 6, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "restored 3" in resumed.stdout and "saved 6" in resumed.stdout
    assert sorted(os.listdir(directory)) == ["ckpt-0000000003", "ckpt-0000000006"]  # the lock went with it


def _lock_of(directory, **fields):
    directory.mkdir(parents=True, exist_ok=True)
    held = {"host": "elsewhere", "pid": 1, "start": None, "job": "other-job", "since": time.time(), "token": "t",
            **fields}
    (directory / lock.LOCK).write_text(json.dumps(held))


@pytest.mark.parametrize("age, refused", [(0, True), (lock.STALE_S + 5, False)])
def test_another_hosts_lock_is_stale_once_its_heartbeat_stops(tmp_path, age, refused):
    _lock_of(tmp_path)
    then = time.time() - age
    os.utime(tmp_path / lock.LOCK, (then, then))
    taken = lock.DirectoryLock(str(tmp_path))
    problem = taken.acquire()
    try:
        assert (problem is not None) == refused, problem
        assert refused or json.loads((tmp_path / lock.LOCK).read_text())["token"] == taken.token
    finally:
        taken.release()
    assert (tmp_path / lock.LOCK).exists() == refused  # a refused job leaves the holder's lock alone


def test_a_pid_taken_again_by_another_process_is_no_holder(tmp_path):
    """The holder died and its pid now names another process (pytest's parent here): its start time tells them
    apart."""
    import socket

    live = os.getppid()
    _lock_of(tmp_path, host=socket.gethostname(), pid=live, start="1")
    assert lock.other_job(str(tmp_path)) is None
    _lock_of(tmp_path, host=socket.gethostname(), pid=live, start=lock._process_start(live))
    assert lock.other_job(str(tmp_path))["job"] == "other-job"
