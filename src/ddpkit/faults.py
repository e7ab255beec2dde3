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
import hashlib
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
# a worker's traceback in its stderr log sits in a block the console tail leaves out: its first line carries the
# launch's tag (a user's line cannot end up equal to it by chance) and how many lines follow (so a message holding
# a line like the block's end cannot end it early, and a block cut short hides no more than its own lines)
_BLOCK = re.compile(r"^ddpkit: --- traceback \[(?P<tag>\w+)\], the next (?P<n>\d+) lines "
                    r"\(kept in this rank's log\) ---$")
_MARKER = re.compile(r"^ddpkit: --- (traceback \[\w+\], the next \d+ lines|end of traceback \[\w+\]) ")
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
        # the traceback goes into this rank's log (the report directory is gone after the launch), in a block
        # the console leaves out: the launcher's report prints the first failure's once
        print(f"ddpkit: rank {rank} raised {kind.__name__}: {_first_line(value)} (its traceback is in this rank's "
              f"stderr.log)\n{traceback_block(text, block_tag(os.path.dirname(report_dir)))}",
              file=sys.stderr, flush=True)
        if hang:
            _signal_siblings()
        if previous is not sys.__excepthook__:
            previous(kind, value, tb)

    sys.excepthook = excepthook
    threading.Thread(target=_watchdog, args=(stack_file, timeout_s / 2), daemon=True,
                     name="ddpkit-hang-watchdog").start()


def _first_line(value: BaseException) -> str:
    return (str(value).replace("\r", "\n").splitlines() or [""])[0][:300]


def block_tag(launch_report_dir: str) -> str:
    """The tag of a launch's traceback blocks, from its report directory (a fresh temporary one per launch).

    >>> block_tag("/tmp/ddpkit-report-abc") == block_tag("/tmp/ddpkit-report-abc") != block_tag("/tmp/other")
    True
    """
    return hashlib.sha256(os.path.abspath(launch_report_dir).encode()).hexdigest()[:12]


def traceback_block(text: str, tag: str) -> str:
    r"""``text`` as a block the console leaves out: a first line with ``tag`` and the count of lines after it.

    A carriage return inside would end a console line early: it is written as ``\r``.

    >>> print(traceback_block("Traceback (most recent call last):\nKeyError: 'x'", "t1"))
    ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---
    Traceback (most recent call last):
    KeyError: 'x'
    ddpkit: --- end of traceback [t1] ---
    """
    body = text.rstrip().replace("\r", "\\r").split("\n") + [f"ddpkit: --- end of traceback [{tag}] ---"]
    return "\n".join([f"ddpkit: --- traceback [{tag}], the next {len(body)} lines (kept in this rank's log) ---",
                      *body])


def block_length(line: str, tag: str | None) -> int:
    """How many lines after ``line`` belong to a traceback block (0: ``line`` starts none). ``tag`` None: any.

    >>> block_length("ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---", "t1")
    3
    >>> block_length("ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---", "t2")
    0
    """
    m = _BLOCK.match(line)
    return int(m["n"]) if m and tag in (None, m["tag"]) else 0


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
    errors = records(report_dir)
    aborted = sorted(r for r, tail in tails.items() if r in crashed and nccl_timeout(tail))
    if aborted:
        line = next(x for x in tails[aborted[0]].splitlines() if nccl_timeout(x))
        return EXIT_HANG, _hang_report(report_dir, {}, f"first timeout on rank {aborted[0]} (NCCL watchdog, "
                                       f"{crashed[aborted[0]]}): {line.strip()[:200]}", nccl=True)
    silent = {r: how for r, how in crashed.items() if r not in {e["rank"] for e in errors}}
    if silent and all(_PEER_LOST.search(e["message"]) for e in errors):
        return EXIT_WORKER_FAILED, _silent_report(report_dir, silent, tails, sorted(e["rank"] for e in errors))
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


def peer_lost(message: str) -> bool:
    """True when an exception's message says only that a peer went away (a consequence, not a cause)."""
    return bool(_PEER_LOST.search(message))


def records(report_dir: str) -> list[dict]:
    """The error reports the workers of one attempt wrote (the whole ones)."""
    errors = []
    for path in glob.glob(os.path.join(report_dir, "error-rank*.json")):
        try:
            with open(path) as f:
                errors.append(json.load(f))
        except (OSError, ValueError):  # cut short (a full disk): the rank's log has the traceback
            continue
    return errors


def _silent_report(report_dir: str, silent: dict[int, str], tails: dict[int, str], lost: list[int]) -> str:
    """The root cause is a rank that left no report: its traceback from its stderr (it failed before
    ``ddpkit.init()``), the script's own exit code, or the signal that killed it."""
    # the agent SIGTERMs the survivors; a rank that exited 0 is a cause only when none stopped with a failure
    rank = min(silent, key=lambda r: ("SIGTERM" in silent[r], silent[r] == "exited with code 0", r))
    how, after = silent[rank], f"; ranks {lost} then lost their peer" if lost else ""
    tail = _lines(tails.get(rank, ""))
    before_init = not os.path.exists(os.path.join(report_dir, f"stack-rank{rank}.txt"))
    # only an uncaught exception exits 1 (or dies of SIGINT, a KeyboardInterrupt) with its traceback last; a rank
    # past init() had its exception recorded by the excepthook, so a traceback in its log was one it handled
    tb = python_traceback(tail) if before_init and how in ("exited with code 1", "killed by SIGINT") else None
    if tb:
        return (f"ddpkit: rank {rank} failed first: {tb.splitlines()[-1]}\n{tb}\n"
                f"(rank {rank} {how} before ddpkit.init(); its traceback, from its stderr log{after})")
    if how == "exited with code 0" and lost:
        peers = f"rank {lost[0]} was" if len(lost) == 1 else f"ranks {', '.join(map(str, lost))} were"
        return (f"ddpkit: rank {rank} exited with code 0 while {peers} still training (waiting in a collective): "
                "a rank that ends early leaves its peers' collectives unmatched; every rank must run the same "
                "steps (ddpkit.join for uneven data)")
    if how.startswith("exited with code"):
        said = [x for x in tail.splitlines() if x.strip() and not x.startswith(f"ddpkit: rank {rank} ")]
        # sys.exit("message") exits 1 and Python prints the message as the last line
        quote = f'; its last stderr line: "{said[-1].strip()[:300]}" (a sys.exit message?)' \
            if how == "exited with code 1" and said else ""
        return (f"ddpkit: rank {rank} {how}, the first rank to stop, without a Python exception (the script's "
                f"sys.exit or os._exit){quote}{after}")
    return f"ddpkit: rank {rank} failed first: {how}, without a Python exception{after}"


def _lines(tail: str) -> str:
    """A stderr tail without torch's ``[rankN]:`` prefixes and ddpkit's traceback-block lines."""
    lines = (_RANK_PREFIX.sub("", x) for x in tail.splitlines())
    return "\n".join(x for x in lines if not _MARKER.match(x))


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_TB_START = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception, another exception occurred:",
            "The above exception was the direct cause of the following exception:")


def python_traceback(text: str) -> str | None:
    r"""The last traceback in a rank's stderr (with the exceptions chained before it), up to its exception line.

    >>> python_traceback("loading\nTraceback (most recent call last):\n  File \"t.py\", line 1\nKeyError: 'x'\nbye\n")
    'Traceback (most recent call last):\n  File "t.py", line 1\nKeyError: \'x\''
    >>> python_traceback("epoch 1 done\n") is None
    True
    """
    lines = text.splitlines()
    starts = [i for i, x in enumerate(lines) if x == _TB_START]
    if not starts:
        return None
    first = starts[-1]
    for i in reversed(starts[:-1]):  # walk back over "During handling of the above exception" links
        if any(x in _CHAINED for x in lines[i:first]) and _end(lines, i) < first:
            first = i
        else:
            break
    return "\n".join(lines[first:_end(lines, starts[-1]) + 1]).rstrip() or None


def _end(lines: list[str], start: int) -> int:
    """Index of the exception line of the traceback starting at ``start``: the first line not indented."""
    return next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")),
                len(lines) - 1)


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
