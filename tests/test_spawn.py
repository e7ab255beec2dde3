"""ddpkit.spawn: a script that launches itself, a function from an interactive session (fork), failures,
interrupts and repeated launches, with real processes (gloo, CPU)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import ddpkit
from conftest import SCRATCH, WORKERS, launch, ok, run_cmd
from ddpkit.launcher.spawn import choose_start_method as start_method

SELF = WORKERS / "selflaunch.py"


def test_start_method_decisions():
    assert start_method(None, interactive=True, cuda_initialized=False) == "fork"  # notebook functions: no pickling
    assert start_method(None, interactive=False, cuda_initialized=True) == "spawn"  # scripts: a fresh interpreter
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*restart the kernel"):
        start_method(None, interactive=True, cuda_initialized=True)  # the fake: what a notebook that touched CUDA sees
    with pytest.raises(RuntimeError, match="pass start_method='spawn'"):
        start_method("fork", interactive=False, cuda_initialized=True)
    with pytest.raises(ValueError, match="python -c, or the script was read from stdin; move it into a .py module"):
        start_method("spawn", interactive=True, cuda_initialized=False)
    with pytest.raises(ValueError, match="not one of fork, spawn, forkserver"):
        start_method("thread", interactive=False, cuda_initialized=False)


def _main_work():
    return "in __main__"


_main_work.__module__ = "__main__"  # as `def` in a notebook cell, the REPL, `python -c` or stdin makes it


class _MainCallable:
    def __call__(self):
        return "in __main__"


_MainCallable.__module__ = "__main__"


def test_fork_whenever_a_fresh_interpreter_could_not_import_the_function(monkeypatch):
    """spawn pickles the function by name and re-runs __main__ from its file in every worker: fork where
    either is impossible, looking through partials, callable objects, bound methods and the arguments."""
    import functools
    import types

    from ddpkit.launcher.spawn import _interactive

    def main_module(file):
        module = types.ModuleType("__main__")
        if file is not None:
            module.__file__ = file
        monkeypatch.setitem(sys.modules, "__main__", module)

    main_module(None)  # a notebook, the REPL, python -c
    assert _interactive(_main_work, (), {})
    assert _interactive(functools.partial(functools.partial(_main_work)), (), {})  # partial.__module__: functools
    assert _interactive(_MainCallable(), (), {})
    assert _interactive(print, (_MainCallable(),), {}) and _interactive(print, (), {"cb": _MainCallable()})
    assert _interactive(functools.partial(print, _MainCallable()), (), {})
    assert not _interactive(os.getcwd, (1,), {}) and not _interactive(functools.partial(os.getcwd), (), {})
    main_module("<stdin>")  # python - < train.py: multiprocessing's spawn re-runs '<cwd>/<stdin>' in each worker
    assert _interactive(os.getcwd, (), {})
    main_module(__file__)  # a real script: spawn re-runs it as __mp_main__
    assert not _interactive(os.getcwd, (), {}) and not _interactive(_main_work, (), {})


def test_a_script_that_launches_itself_equals_ddpkit_launch(tmp_path):
    r = ok(run_cmd([sys.executable, str(SELF), str(tmp_path), "--spawn"], env={"DDPKIT_PHASE_WINDOW": "200"}))
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert result == {"rank": 0, "world_size": 2, "mode": "ddp"}  # rank 0's return value
    assert "trained" in r.stdout  # rank 0's print reaches the caller's stdout
    # issue 26 #6: where the logs are, said once, as ddpkit launch says it
    logs = [line for line in r.stderr.splitlines() if line.startswith("ddpkit.spawn: ") and "per-rank logs in" in line]
    assert len(logs) == 1 and os.path.isdir(os.path.join(SCRATCH, logs[0].rsplit(" in ", 1)[1])), r.stderr
    # issue 29: the per-rank phase table (turned on: off by default) ends a spawn as it ends ddpkit launch, and its
    # report is kept beside the logs
    assert "ddpkit: where each rank's time went" in r.stderr and re.search(r"ddpkit:\s+1\s+\S+\s+[\d.]+", r.stderr)
    assert os.path.isfile(os.path.join(SCRATCH, logs[0].rsplit(" in ", 1)[1], "phases.json"))
    ok(launch(SELF, tmp_path))
    spawned, launched = torch.load(tmp_path / "spawn.pt"), torch.load(tmp_path / "launch.pt")
    assert all(torch.equal(spawned[k], launched[k]) for k in launched)  # the same weights, bitwise


def test_an_exception_in_rank_1_is_raised_once_in_the_caller(tmp_path):
    r = run_cmd([sys.executable, str(SELF), str(tmp_path), "--spawn", "--fail"])
    assert r.returncode == 1 and "SPAWN-ERROR exit=1" in r.stdout, r.stdout + r.stderr
    report = r.stdout.split("SPAWN-ERROR exit=1\n", 1)[1]
    assert "rank 1 on" in report and "failed first: ValueError: planned failure on rank 1" in report
    assert report.count("Traceback (most recent call last)") == 1
    assert "ChildFailedError" not in r.stdout + r.stderr  # never torch's elastic wall


SESSION = """
import os, sys, threading, time, json
import torch, ddpkit

def work(scale, pid_dir=None, sleep=0.0):
    state = ddpkit.init()
    if pid_dir:
        open(os.path.join(pid_dir, f"{os.getpid()}.pid"), "w").close()
    total = ddpkit.reduce(torch.tensor(float(state.rank + 1) * scale)).item()
    end = time.time() + sleep
    while time.time() < end:
        ddpkit.barrier()
        time.sleep(0.05)
    return total

def fds():
    return len(os.listdir("/proc/self/fd"))
"""

TEN = SESSION + """
results, threads, files = [], [], []
for i in range(10):
    results.append(ddpkit.spawn(work, 1.0, nproc_per_node=2))
    threads.append(threading.active_count()); files.append(fds())
print("TEN " + json.dumps({"results": results, "threads": threads, "fds": files}))
"""


def test_ten_launches_in_one_session_leak_no_port_thread_or_file(tmp_path):
    """A function defined in an interactive session (stdin: `__main__` has no file) forks its workers."""
    r = ok(run_cmd([sys.executable, "-c", TEN], timeout=300))
    got = json.loads(r.stdout.split("TEN ", 1)[1])
    assert got["results"] == [3.0] * 10  # 1 + 2 from the two ranks, every time
    assert len(set(got["threads"][1:])) == 1, got["threads"]  # no thread left behind per launch
    assert got["fds"][-1] <= got["fds"][1], got["fds"]  # nor a file descriptor


INTERRUPT = SESSION + """
pid_dir = sys.argv[1]
try:
    ddpkit.spawn(work, 1.0, pid_dir, 120.0, nproc_per_node=2)
except KeyboardInterrupt as exc:
    print("INTERRUPTED", time.time(), exc, flush=True)
print("AGAIN", ddpkit.spawn(work, 2.0, nproc_per_node=2), flush=True)
"""


def test_an_interrupt_stops_every_worker_and_the_session_launches_again(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPT, str(tmp_path)], cwd=SCRATCH, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        workers = [int(p.stem) for p in tmp_path.glob("*.pid")]
        assert len(workers) == 2, "the workers did not start"
        sent = time.time()
        proc.send_signal(signal.SIGINT)  # what a kernel interrupt sends
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out + err
    stopped_at = float(out.split("INTERRUPTED ", 1)[1].split()[0])
    assert stopped_at - sent < 5  # every worker stopped within 5 s
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no orphan
    assert "AGAIN 6.0" in out  # the session survives and launches again


HANG = """
import time, torch, torch.distributed as dist, ddpkit

def only_rank0_reduces(state):
    if state.rank == 0:
        dist.all_reduce(torch.ones(1))

def evaluate():
    time.sleep(120)

def work():
    state = ddpkit.init(timeout_s=5)
    only_rank0_reduces(state)
    evaluate()

started = time.time()
try:
    ddpkit.spawn(work, nproc_per_node=2)
except ddpkit.launcher.spawn.SpawnError as exc:
    print(f"SPAWN-ERROR exit={exc.exit_code} after={time.time() - started:.1f}\\n{exc}", flush=True)
print("AGAIN", ddpkit.spawn(ddpkit.init, nproc_per_node=2).world_size, flush=True)
"""


def test_a_hang_in_spawned_workers_is_the_launchers_hang_report_and_the_session_goes_on():
    """A collective that rank 1 never joins, in a forked (interactive-session) function: the same report as
    `ddpkit launch` gives (exit code 3, where each rank stands), raised once in the caller, within the timeout."""
    r = ok(run_cmd([sys.executable, "-c", HANG], timeout=180))
    assert "SPAWN-ERROR exit=3" in r.stdout, r.stdout + r.stderr
    report = r.stdout.split("SPAWN-ERROR", 1)[1]
    assert "HANG: a collective did not complete within the timeout" in report
    assert re.search(r"rank 0 waits in a collective \(\w+\) at <string>:\d+ in only_rank0_reduces", report), report
    assert re.search(r"rank 1 is at <string>:\d+ in evaluate \(not in a collective\)", report), report
    assert float(re.search(r"after=([\d.]+)", report).group(1)) < 5 + 15  # the timeout, then the report
    assert "AGAIN 2" in r.stdout


POISONED = """
import os, torch, ddpkit

def poisoned():
    raise AssertionError("the CUDA driver was initialised in the caller before the fork")

# a CUDA build of torch, as far as anything can tell: torch.cuda.is_available() now calls this (cudaGetDeviceCount,
# which initialises the driver); forked workers get back the CPU build's torch
torch._C._cuda_getDeviceCount = poisoned
os.register_at_fork(after_in_child=lambda: delattr(torch._C, "_cuda_getDeviceCount"))

def work():
    return ddpkit.init().world_size

print("WORLD", ddpkit.spawn(work, nproc_per_node=2))
"""


def test_spawn_counts_gpus_without_initialising_cuda_in_the_caller():
    r = run_cmd([sys.executable, "-c", POISONED], env={"DDPKIT_DEVICE": ""}, timeout=120)
    assert r.returncode == 0 and "WORLD 2" in r.stdout, r.stderr[-3000:]


AFTER_CELLS = """
import os, sys, torch, ddpkit
import ddpkit.core.process
from ddpkit.strategies import ddp_wrapper
out = sys.argv[1]
ddpkit.init()  # an earlier cell: the kernel itself is a one-process run now
held = torch.nn.Linear(1, 1)
ddp_wrapper._LIVE_DDP.add(held)  # as if an earlier cell still held a DDP model
try:
    raise ValueError("an earlier cell failed")
except ValueError as exc:  # what the REPL and IPython record for a failed cell
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__

def work():
    state = ddpkit.init()
    ddpkit.core.process.on_shutdown(lambda: open(os.path.join(out, f"hook-{state.rank}"), "w").close())
    ddpkit.prepare_model(torch.nn.Linear(2, 2))
    released = ddp_wrapper._release_reducers in ddpkit.core.process.current().release_hooks  # freed at exit
    return [state.world_size, state.mode, released]

print("GOT", ddpkit.spawn(work, nproc_per_node=2))
"""


def test_forked_workers_start_fresh_after_the_kernel_ran_init_and_a_cell_failed(tmp_path):
    r = ok(run_cmd([sys.executable, "-c", AFTER_CELLS, str(tmp_path)], timeout=120))
    assert "GOT [2, 'ddp', True]" in r.stdout, r.stdout + r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("hook-*")) == ["hook-0", "hook-1"]  # shutdown ran its hooks


def test_a_script_fed_on_stdin_spawns_its_workers_by_fork():
    """Its own functions, one imported from a module (spawn would re-run '<stdin>' in every worker), and a
    partial of its own (which spawn cannot find by name)."""
    script = ("import functools, ddpkit\n\ndef work(k=1):\n    return ddpkit.init().world_size * k\n\n"
              "if __name__ == '__main__':\n    print('WORLD', ddpkit.spawn(work, nproc_per_node=2))\n"
              "    print('MODULE', ddpkit.spawn(ddpkit.init, nproc_per_node=2).world_size)\n"
              "    print('PARTIAL', ddpkit.spawn(functools.partial(work, 10), nproc_per_node=2))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-"], cwd=SCRATCH, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:  # `python - < train.py`: __main__.__file__ is '<stdin>', which a spawned interpreter cannot import
        out, err = proc.communicate(script, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "WORLD 2\nMODULE 2\nPARTIAL 20" in out, err[-3000:]


def test_spawn_refuses_one_gpu_for_two_processes_up_front(monkeypatch):
    from ddpkit.core import environment
    from ddpkit.launcher import config as launch
    monkeypatch.delenv("DDPKIT_DEVICE", raising=False)
    monkeypatch.setattr(environment, "visible_gpus", lambda **_: 1)  # the count a one-GPU host gives
    with pytest.raises(launch.LaunchError, match="2 processes per node need 2 GPUs .* 1 usable"):
        ddpkit.spawn(print, nproc_per_node=2)  # refused before any worker starts: NCCL cannot share cuda:0
