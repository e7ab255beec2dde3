"""Helpers for tests that start real processes (gloo on CPU, free ports picked by the store itself)."""
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import warm

from ddpkit.launcher.config import hash_seed

# scripts that tests launch, not test modules: importing them (for doctests) would run them
collect_ignore = ["workers", "check_corpus", "convert_corpus"]  # scripts: importing one runs it

ROOT = Path(__file__).resolve().parent.parent
# The CPU tiers pin every process (in-process init() and every subprocess) to the CPU, so the suite passes on a
# GPU host too; GPU tests run their own processes with GPU_ENV.
os.environ["DDPKIT_DEVICE"] = "cpu"
# Each worker imports ddpkit anew: without a bytecode cache (a machine that sets PYTHONDONTWRITEBYTECODE, as CI's
# does) every one of the suite's ~1500 processes compiles ddpkit's sources again (0.2-0.3 s of a core each).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# ddpkit launch gives its workers one PYTHONHASHSEED (from --rdzv-id) when none is set; an interpreter reads it as it
# starts, so a worker forked warm (tests/warm.py) from a server without it would run cold: every command starts
# with the value the launcher would give (tests that check the unset case pass their own environment).
os.environ.setdefault("PYTHONHASHSEED", hash_seed("ddpkit"))
GPU_ENV = {"DDPKIT_DEVICE": "cuda"}
# Processes start in a scratch directory, so nothing they write by default (runs/logs, runs/digits, runs/bench)
# lands in the repository; pytest_sessionfinish checks that.
SCRATCH = Path(tempfile.mkdtemp(prefix="ddpkit-tests-"))
atexit.register(shutil.rmtree, SCRATCH, True)
_RUNS_BEFORE = sorted(p.name for p in (ROOT / "runs").glob("*")) if (ROOT / "runs").is_dir() else []


def pytest_sessionfinish(session, exitstatus):
    after = sorted(p.name for p in (ROOT / "runs").glob("*")) if (ROOT / "runs").is_dir() else []
    new = sorted(set(after) - set(_RUNS_BEFORE))
    if new:
        print(f"\ntests left files in {ROOT / 'runs'}: {new}; tests write under their temp dirs only", file=sys.stderr)
        session.exitstatus = 1
WORKERS = ROOT / "tests" / "workers"


def run_cmd(cmd, timeout=180, env=None, cwd=SCRATCH):
    """Run cmd in its own session; on timeout kill the whole group so no worker outlives the test."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    try:  # forked from an interpreter that imported torch once, where that runs what exec would (tests/warm.py)
        done = warm.run(list(map(str, cmd)), full_env, cwd, timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"timed out after {timeout}s: {cmd}\nstdout:\n{expired.output}\nstderr:\n{expired.stderr}")
    if done is not None:
        return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {cmd}\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(script, *args, nproc=2, launcher_args=(), **kwargs):
    """`ddpkit launch --nproc-per-node N script args` as a subprocess."""
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", str(nproc), *launcher_args,
           str(script), *map(str, args)]
    return run_cmd(cmd, **kwargs)


def alive(pid):
    """The process exists and is not a zombie (its state is the field after the parenthesised command name,
    which may itself hold spaces or parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


@pytest.fixture(scope="session")
def has_cuda():
    import torch

    return torch.cuda.is_available()



def settled(files):
    """Every file's convert plan of a project given as ``{relative path: source}``, the asks between them settled
    (:func:`ddpkit.commands.convert.crossing.settle`)."""
    from ddpkit.commands.convert.crossing import settle
    from ddpkit.commands.convert.plan import plan
    return settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
