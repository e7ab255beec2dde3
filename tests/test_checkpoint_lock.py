"""One job per checkpoint directory (real processes): a second live job is refused at its start, a lock
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
        # a second job on the same directory, while the first trains: refused at its start (its restore), one line
        second = _job(directory, 5, resume=True)
        assert second.returncode != 0, second.stdout
        line = second.stderr.strip().splitlines()[-1]
        assert line.startswith("ddpkit.checkpoint.lock.DirectoryInUse: checkpoint directory ") or \
            "DirectoryInUse: checkpoint directory " in line, second.stderr[-2000:]
        assert f"in use by another job (job {held['job']}, pid {first.pid} on " in line, line
        assert "restored" not in second.stdout  # refused before it loaded or wrote anything
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


def test_the_same_job_id_is_no_restart_a_live_holder_is_refused(tmp_path, monkeypatch):
    """Every elastic launch has the job id "ddpkit" (every static one "none"): a live holder with this job's id is
    another launch, refused; only a dead holder's lock is taken over."""
    import socket

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "ddpkit")
    live = os.getppid()
    _lock_of(tmp_path, host=socket.gethostname(), pid=live, start=lock._process_start(live), job="ddpkit")
    taken = lock.DirectoryLock(str(tmp_path))
    problem = taken.acquire()
    taken.release()
    assert problem and "in use by another job (job ddpkit, pid" in problem and "the same job id" in problem, problem
    assert json.loads((tmp_path / lock.LOCK).read_text())["pid"] == live  # left alone


CRAFTED = {"pid 0": {"pid": 0}, "pid -1": {"pid": -1}, "pid 10**30": {"pid": 10**30}, "pid true": {"pid": True},
           "start int": {"start": 12345}, "since 1e300": {"since": 1e300}, "since NaN": {"since": float("nan")},
           "token list": {"token": ["t"]}}


@pytest.mark.parametrize("case", [*CRAFTED, "directory", "symlink", "fifo", "list"])
def test_a_lock_file_that_is_not_ddpkits_is_refused_in_one_line(tmp_path, case):
    """Refused, not taken over: whatever wrote it may still write there, and a refusal loses nothing."""
    import socket

    if case in CRAFTED:  # a live pid of this host otherwise: only the crafted field is wrong
        _lock_of(tmp_path, **{"host": socket.gethostname(), "pid": os.getppid(), **CRAFTED[case]})
    elif case == "directory":
        (tmp_path / lock.LOCK).mkdir()
    elif case == "symlink":
        (tmp_path / "elsewhere").write_text("{}")
        (tmp_path / lock.LOCK).symlink_to(tmp_path / "elsewhere")
    elif case == "fifo":
        os.mkfifo(tmp_path / lock.LOCK)
    else:
        (tmp_path / lock.LOCK).write_text("[1, 2]")
    before = os.lstat(tmp_path / lock.LOCK)
    taken = lock.DirectoryLock(str(tmp_path))
    problem = lock.verdict(taken)  # never raises: rank 0 must reach the collective that tells the others
    assert taken.token is None and problem and "\n" not in problem, problem
    assert f"has a lock file {tmp_path / lock.LOCK} that is not ddpkit's (" in problem, problem
    assert "remove that file" in problem
    assert os.lstat(tmp_path / lock.LOCK).st_ino == before.st_ino  # left as it was
    assert sorted(os.listdir(tmp_path)) == sorted([lock.LOCK] + (["elsewhere"] if case == "symlink" else []))


def _race(directory, delay, queue, barrier):
    look, first = lock.live_holder, [True]

    def slow(*args):  # both look at the stale lock first, then act 0.3 s apart (a descheduled process, slow NFS)
        alive = look(*args)
        if first.pop() if first else False:
            barrier.wait(30)
            time.sleep(delay)
        return alive

    lock.live_holder = slow
    held = lock.DirectoryLock(directory)
    problem = held.acquire()
    queue.put([os.getpid(), problem])
    time.sleep(1)


def test_two_jobs_taking_over_one_stale_lock_at_once_one_holds_it(tmp_path):
    import multiprocessing
    import socket

    _lock_of(tmp_path, host=socket.gethostname(), pid=lock.PID_MAX)  # a dead job's
    fork = multiprocessing.get_context("fork")
    queue, barrier = fork.Queue(), fork.Barrier(2)
    jobs = [fork.Process(target=_race, args=(str(tmp_path), d, queue, barrier)) for d in (0.0, 0.3)]
    for job in jobs:
        job.start()
    results = [queue.get(timeout=60) for _ in jobs]
    for job in jobs:
        job.join(60)
    holders = [pid for pid, problem in results if problem is None]
    assert len(holders) == 1, results
    refused = next(problem for _, problem in results if problem)
    assert f"in use by another job (job {lock.run_id()}, pid {holders[0]} on " in refused, refused
    assert sorted(os.listdir(tmp_path)) == [lock.LOCK]  # nothing moved aside is left


def test_a_holder_whose_lock_was_taken_over_saves_no_more(tmp_path):
    held = lock.DirectoryLock(str(tmp_path))
    assert held.acquire() is None and held.check() is None
    _lock_of(tmp_path, host="elsewhere", job="thief")  # another job took it over (it found this one stale)
    problem = held.acquire()
    assert problem and problem.startswith(f"checkpoint not saved: this job's lock {tmp_path / lock.LOCK} now holds "
                                          "job thief, pid 1 on elsewhere; another job took"), problem
    assert held.check() == problem and held._stop.is_set()  # the heartbeat stopped: it no longer touches their lock
    held.release()
    assert json.loads((tmp_path / lock.LOCK).read_text())["job"] == "thief"  # theirs, left alone
