"""The one-process launch (``--mode dp`` / single) on real processes: signals reach the child, no orphan, the
launcher as a container's PID 1, and OMP_NUM_THREADS from the cores the launch may use."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import SCRATCH, WORKERS, alive
from ddpkit.runtime.faults import children

PLAIN = WORKERS / "plain.py"
LAUNCH = [sys.executable, "-m", "ddpkit", "launch", "--mode", "dp", str(PLAIN)]


def _start(cmd, env=None):
    return subprocess.Popen(cmd, cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _wait_for(path, proc, limit_s=60):
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    return int(path.read_text())


def _finish(proc, limit_s=30):
    try:
        return proc.communicate(timeout=limit_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_sigterm_to_a_one_process_launcher_stops_its_child(tmp_path):
    proc = _start([*LAUNCH, str(tmp_path), "sleep"])
    child = _wait_for(tmp_path / "pid", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc)
    assert proc.returncode == 143 and "stopped by signal SIGTERM" in err, err
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)  # it used to go on as an orphan


def _pid_namespaces() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--map-root-user", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _pid_namespaces(), reason="unprivileged user and PID namespaces are not allowed here")
def test_the_launcher_as_pid_1_of_its_namespace_acts_on_sigterm(tmp_path):
    """The kernel drops a signal to a namespace's PID 1 that has no handler for it: a container's launcher
    ignored `docker stop` until the SIGKILL."""
    proc = _start(["unshare", "--pid", "--fork", "--map-root-user", *LAUNCH, str(tmp_path), "sleep"])
    child = _wait_for(tmp_path / "pid", proc)
    (launcher,) = children(proc.pid)  # unshare's child: PID 1 inside
    with open(f"/proc/{launcher}/status") as f:
        assert next(x.split()[-1] for x in f if x.startswith("NSpid:")) == "1"
    os.kill(launcher, signal.SIGTERM)
    _, err = _finish(proc)
    assert "stopped by signal SIGTERM" in err, err
    assert not alive(launcher) and not alive(child)


@pytest.mark.skipif(not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 cores")
def test_omp_threads_follow_the_cores_the_launch_may_use(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    first = str(min(os.sched_getaffinity(0)))
    r = subprocess.run(["taskset", "-c", first, *LAUNCH, str(tmp_path)], cwd=SCRATCH, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "omp").read_text() == "1" and "OMP_NUM_THREADS=1 (1 cores / 1 local processes" in r.stderr
