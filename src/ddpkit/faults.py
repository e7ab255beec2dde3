"""Root cause once, and hang reports: the worker half writes files, the launcher half reads them.

Workers started by ``ddpkit launch`` get ``DDPKIT_REPORT_DIR``. In that directory each worker writes

- ``error-rank<R>.json`` from its excepthook (rank, host, exception, traceback, time), printing one line
  instead of the traceback, so N ranks do not interleave N tracebacks;
- ``stack-rank<R>.txt``: Python stacks of every thread, dumped by a watchdog when the rank has made no
  progress (no batch, no forward) for half the collective timeout, and on SIGUSR1, which a rank whose
  collective timed out sends to its local siblings before it exits.

The launcher then prints one summary (:func:`report`): the first exception with its traceback, or,
when the first failure is a collective timeout, where every rank stands.

Example of a hang report::

    ddpkit: HANG: a collective did not complete within the timeout
      rank 0 waits in a collective (all_reduce) at train.py:41 in train_step
      rank 1 is at train.py:55 in evaluate (not in a collective)
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable

from ddpkit.files import write_atomically

EXIT_WORKER_FAILED = 1
EXIT_HANG = 3
_TIMEOUT = re.compile(r"timed out|timeout|failed to pass monitoredBarrier", re.IGNORECASE)
# where a RuntimeError's message says torch.distributed raised it (older builds raise plain RuntimeErrors): torch's
# own phrasing (a source path, a class, the watchdog's sentence), not a word such as "NCCL" a user's message may hold
_DIST_ORIGIN = re.compile(r"\[c10d\]|[/\\]gloo[/\\]|ProcessGroup(Gloo|NCCL)|WorkNCCL|Watchdog caught collective|"
                          r"monitoredBarrier")
# a store that could not be reached: the rendezvous or the network failed, no collective was waiting
_CONNECT = re.compile(r"while trying to connect to|failed to connect|connection refused", re.IGNORECASE)
# a worker's traceback in its stderr log sits between these lines; the console tail leaves them out
TRACEBACK_BEGIN = "ddpkit: --- traceback (kept in this rank's log; the launcher's report shows the first) ---"
TRACEBACK_END = "ddpkit: --- end of traceback ---"
# what a rank raises when a peer died first: a consequence, not a root cause
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL communicator was aborted", re.IGNORECASE)
_last_beat = time.monotonic()


def heartbeat() -> None:
    """Mark progress (a batch, a forward): the hang watchdog only dumps stacks of ranks that stopped."""
    global _last_beat
    _last_beat = time.monotonic()


_report_dir: str | None = None  # this worker's, once install() ran


def collective_timeout(kind: type, message: str) -> bool:
    """True when an exception is torch.distributed's own timeout (a hang), not any exception saying "timeout".

    A user's ``TimeoutError`` (a slow download), ``subprocess.TimeoutExpired`` or an HTTP read timeout is an
    ordinary failure: reported with its traceback, and no SIGUSR1 to the siblings.

    >>> import torch.distributed as dist
    >>> collective_timeout(dist.DistBackendError, "[c10d] wait timeout after 20000ms, keys: /default_pg/0//cpu")
    True
    >>> collective_timeout(RuntimeError, "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms")
    True
    >>> collective_timeout(TimeoutError, "read timed out fetching s3://bucket/shard-3.tar")
    False
    >>> collective_timeout(dist.DistNetworkError, "The client socket has timed out after 60000ms while trying to "
    ...                    "connect to (10.0.0.1, 29500).")
    False
    """
    if not _TIMEOUT.search(message) or _CONNECT.search(message):
        return False
    if any(k.__name__ == "DistError" and k.__module__.startswith("torch") for k in kind.__mro__):
        return True
    return issubclass(kind, RuntimeError) and bool(_DIST_ORIGIN.search(message))


def mark_finished(rank: int) -> None:
    """Every rank passed the final barrier: whatever kills this process from now on (gloo's destructor in
    interpreter teardown now and then aborts, the pytorch#56297 family) comes after the work was done."""
    if _report_dir is not None:
        open(os.path.join(_report_dir, f"finished-rank{rank}"), "w").close()


def finished(report_dir: str, ranks: Iterable[int]) -> bool:
    """Every one of ``ranks`` wrote its mark_finished file into ``report_dir``."""
    return all(os.path.exists(os.path.join(report_dir, f"finished-rank{rank}")) for rank in ranks)


def install(rank: int, local_rank: int, report_dir: str, timeout_s: float) -> None:
    """Worker side: excepthook, SIGUSR1 stack dumps and the no-progress watchdog."""
    global _report_dir
    os.makedirs(report_dir, exist_ok=True)
    _report_dir = report_dir
    stack_file = open(os.path.join(report_dir, f"stack-rank{rank}.txt"), "a")  # kept open for the C handler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        hang = collective_timeout(kind, str(value))
        record = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid(),
                  "time": time.time(), "type": kind.__name__, "message": str(value), "traceback": text,
                  "hang": hang}
        path = os.path.join(report_dir, f"error-rank{rank}.json")
        try:  # whole or not at all: a full disk must not leave the launcher half a report
            write_atomically(path, lambda f: f.write(json.dumps(record).encode()))
        except OSError as exc:
            print(f"ddpkit: rank {rank} could not write its error report ({exc.strerror or exc})",
                  file=sys.stderr, flush=True)
        first_line = (str(value).splitlines() or [""])[0][:300]
        # the traceback goes into this rank's log (the report directory is gone after the launch), between
        # markers the console leaves out: the launcher's report prints the first failure's once
        print(f"ddpkit: rank {rank} raised {kind.__name__}: {first_line} (the launcher prints the report)\n"
              f"{TRACEBACK_BEGIN}\n{text.rstrip()}\n{TRACEBACK_END}", file=sys.stderr, flush=True)
        if hang:
            _signal_siblings()
        if previous is not sys.__excepthook__:
            previous(kind, value, tb)

    sys.excepthook = excepthook
    threading.Thread(target=_watchdog, args=(stack_file, timeout_s / 2), daemon=True,
                     name="ddpkit-hang-watchdog").start()


def _watchdog(stack_file, stale_s: float) -> None:
    dumped_for = None
    while True:
        time.sleep(min(1.0, stale_s / 4))
        beat = _last_beat
        if time.monotonic() - beat > stale_s and dumped_for != beat:
            faulthandler.dump_traceback(file=stack_file, all_threads=True)
            stack_file.flush()
            dumped_for = beat


def parent_gone(expected_parent: int, actual_parent: int) -> bool:
    """True when this process's parent is no longer the launcher it was started by (it was re-parented).

    Comparing with the launcher's own PID, not with 1: in a container PID 1 is often the shell or init
    that legitimately started the launcher (or Python itself), and the launcher may even be PID 1.

    >>> parent_gone(4242, 4242), parent_gone(4242, 1), parent_gone(1, 1)
    (False, True, False)
    """
    return actual_parent != expected_parent


def die_with_parent(launcher_pid: int | None = None) -> bool:
    """Worker side (Linux): have the kernel SIGKILL this process when its launcher dies.

    Without it, a worker whose agent was killed keeps training as an orphan with its peers on the other
    nodes, so killing one node's launcher would stop nothing. SIGKILL rather than SIGTERM: a worker stuck
    in a collective never gets to run a Python signal handler. ``launcher_pid``: the launcher's PID
    (``ddpkit launch`` passes its own); without it, the parent as seen right now. If the parent is no longer
    that process once the request is in place, the launcher died in between: exit at once. Returns False
    where prctl is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    expected = launcher_pid if launcher_pid is not None else os.getppid()
    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_gone(expected, os.getppid()):  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def children(parent: int) -> list[int]:
    """PIDs whose parent is ``parent`` (Linux /proc; empty elsewhere)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _signal_siblings() -> None:
    """Ask the other workers of this node's agent to dump their stacks, then give them time."""
    for pid in children(os.getppid()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                continue
    time.sleep(0.5)


# ---- launcher side ---------------------------------------------------------------------------------

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _threads(dump: str) -> list[list[tuple[str, int, str]]]:
    """faulthandler text -> list of threads, each a list of (file, line, function), most recent first."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    return threads


def _is_library(path: str) -> bool:
    return any(part in path for part in (f"{os.sep}torch{os.sep}", f"{os.sep}ddpkit{os.sep}",
                                         f"{os.sep}python3.", "<frozen"))


def where(dump: str) -> str | None:
    """One phrase for the main thread of the last dump: 'waits in a collective (...) at f.py:12 in g'.

    >>> lib = "/venv/lib/python3.11/site-packages/torch/distributed"
    >>> where(chr(10).join(["Current thread 0x1 (most recent call first):",
    ...                     '  File "train.py", line 9 in evaluate',
    ...                     f'  File "{lib}/elastic/multiprocessing/errors/__init__.py", line 357 in wrapper']))
    'is at train.py:9 in evaluate (not in a collective)'
    """
    mains = [t for t in _threads(dump) if t and not any(f.endswith("threading.py") for f, _, _ in t)]
    if not mains:
        return None
    frames = mains[-1]
    user = next((f for f in frames if not _is_library(f[0])), None)
    # only what the user's frame called (frames are innermost first): the frames around it, such as
    # torch.distributed.elastic's wrapper of a spawned function, are not where it waits
    called = frames[:frames.index(user)] if user else frames
    user = user or frames[0]
    spot = f"{os.path.basename(user[0])}:{user[1]} in {user[2]}"
    collective = next((fn for f, _, fn in called if f"{os.sep}distributed{os.sep}" in f), None)
    return f"waits in a collective ({collective}) at {spot}" if collective else f"is at {spot} (not in a collective)"


_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|ProcessGroupNCCL.*(timed out|timeout)",
                           re.IGNORECASE)


def nccl_timeout(stderr_tail: str) -> bool:
    """True when a rank's stderr shows NCCL's watchdog aborting it for a collective that timed out.

    NCCL runs collectives asynchronously: the Python thread never sees the timeout, the watchdog aborts the
    process (SIGABRT) and leaves only this line.

    >>> nccl_timeout("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")
    True
    >>> nccl_timeout("RuntimeError: CUDA out of memory")
    False
    """
    return bool(_NCCL_TIMEOUT.search(stderr_tail))


def report(report_dir: str, crashed: dict[int, str] | None = None,
           stderr_tails: dict[int, str] | None = None) -> tuple[int, str] | None:
    """The launcher's one report for a failed run, or None when no worker left one.

    ``crashed``: ranks that died without a Python exception (signal, exit code) -> how. When every recorded
    exception only says a peer went away, such a rank is the root cause. ``stderr_tails``: the end of each
    crashed rank's stderr; a rank that NCCL's watchdog aborted for a timeout makes this a hang report, and a
    rank that failed before ``ddpkit.init()`` installed the report has its traceback there.
    """
    crashed, tails = crashed or {}, stderr_tails or {}
    errors = _records(report_dir)
    aborted = sorted(r for r, tail in tails.items() if r in crashed and nccl_timeout(tail))
    if aborted:
        line = next(x for x in tails[aborted[0]].splitlines() if nccl_timeout(x))
        return EXIT_HANG, _hang_report(report_dir, {}, f"first timeout on rank {aborted[0]} (NCCL watchdog, "
                                       f"{crashed[aborted[0]]}): {line.strip()[:200]}", nccl=True)
    silent = {r: how for r, how in crashed.items() if r not in {e["rank"] for e in errors}}
    if silent and all(_PEER_LOST.search(e["message"]) for e in errors):
        return EXIT_WORKER_FAILED, _silent_report(silent, tails, sorted(e["rank"] for e in errors))
    if not errors:
        return None
    first = min(errors, key=lambda e: e["time"])
    if all(_PEER_LOST.search(e["message"]) for e in errors):
        # nothing on this node failed on its own: a process elsewhere (another node) went away first
        return EXIT_WORKER_FAILED, (
            f"ddpkit: ranks {sorted(e['rank'] for e in errors)} on {first['host']} lost their peer "
            f"({first['message'].splitlines()[0].split('. ')[0][:160]}); no rank here failed first, "
            "so the root cause is on "
            "another node: see that node's launcher output (it may have been killed or lost)")
    if not first.get("hang"):
        head = f"ddpkit: rank {first['rank']} on {first['host']} failed first: {first['type']}: {first['message']}"
        others = sorted(e["rank"] for e in errors if e is not first)
        tail = f"\n(ranks {others} failed after it; each rank's traceback is in its stderr.log)" if others else ""
        return EXIT_WORKER_FAILED, f"{head}\n{first['traceback'].rstrip()}{tail}"
    return EXIT_HANG, _hang_report(report_dir, {e["rank"]: e for e in errors},
                                   f"first timeout on rank {first['rank']}: {first['message'].splitlines()[0][:200]}")


def _records(report_dir: str) -> list[dict]:
    errors = []
    for path in glob.glob(os.path.join(report_dir, "error-rank*.json")):
        try:
            with open(path) as f:
                errors.append(json.load(f))
        except (OSError, ValueError):  # cut short (a full disk): the rank's log has the traceback
            continue
    return errors


def _silent_report(silent: dict[int, str], tails: dict[int, str], lost: list[int]) -> str:
    """The root cause is a rank that left no report: its traceback from its stderr (it failed before
    ``ddpkit.init()``), the script's own exit code, or the signal that killed it."""
    rank = min(silent, key=lambda r: ("SIGTERM" in silent[r], r))  # the agent SIGTERMs the survivors
    how, after = silent[rank], f"; ranks {lost} then lost their peer" if lost else ""
    tb = python_traceback(tails.get(rank, ""))
    if tb:
        return (f"ddpkit: rank {rank} failed first: {tb.splitlines()[-1]}\n{tb}\n"
                f"(rank {rank} {how}; its traceback, from its stderr log{after})")
    if how.startswith("exited with code"):
        return (f"ddpkit: rank {rank} {how}, the first rank to stop, without a Python exception (the script's "
                f"sys.exit or os._exit){after}")
    return f"ddpkit: rank {rank} failed first: {how}, without a Python exception{after}"


def python_traceback(text: str) -> str | None:
    r"""The uncaught exception's traceback at the end of a rank's stderr, or None.

    >>> python_traceback("loading\nTraceback (most recent call last):\n  File \"t.py\", line 1\nKeyError: 'x'\n")
    'Traceback (most recent call last):\n  File "t.py", line 1\nKeyError: \'x\''
    >>> python_traceback("epoch 1 done\n") is None
    True
    """
    start = text.find("Traceback (most recent call last):")
    if start < 0:
        return None
    lines = [x for x in text[start:].splitlines() if x not in (TRACEBACK_BEGIN, TRACEBACK_END)]
    return "\n".join(lines).rstrip() or None


def _hang_report(report_dir: str, errors: dict[int, dict], last_line: str, nccl: bool = False) -> str:
    """Where every rank stands, from the stack dumps (and a timed-out rank's own traceback)."""
    lines = ["ddpkit: HANG: a collective did not complete within the timeout"]
    for path in sorted(glob.glob(os.path.join(report_dir, "stack-rank*.txt")),
                       key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0])):
        rank = int(re.findall(r"\d+", os.path.basename(path))[0])
        with open(path) as f:
            spot = where(f.read())
        if rank in errors and errors[rank].get("hang"):
            spot = where("Thread 0x0:\n" + _as_dump(errors[rank]["traceback"])) or spot
        if nccl and spot:  # NCCL runs collectives on the GPU: Python blocks where it next needs a result
            spot = spot.replace("(not in a collective)", "(waiting for the GPU: a collective queued before it "
                                "may be what hangs)")
        lines.append(f"  rank {rank} {spot or 'left no stack (it had exited or was not reached)'}")
    lines.append(f"  {last_line}")
    return "\n".join(lines)


def _as_dump(tb: str) -> str:
    """A Python traceback (most recent last) in faulthandler's order (most recent first)."""
    frames = re.findall(r'  File "([^"]+)", line (\d+), in (\S+)', tb)
    return "\n".join(f'  File "{f}", line {n} in {fn}' for f, n, fn in reversed(frames))
