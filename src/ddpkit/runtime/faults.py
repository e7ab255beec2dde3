"""Root cause once, and hang reports: the worker half, which writes files (:mod:`ddpkit.launcher.diagnosis`, the
launcher half, reads them; the format between them is :mod:`ddpkit.core.reports`).

Workers started by ``ddpkit launch`` get ``DDPKIT_REPORT_DIR``. In that directory each worker writes

- ``error-rank<R>.json`` from its excepthook (rank, host, exception, traceback, time), printing one line
  instead of the traceback, so N ranks do not interleave N tracebacks;
- ``stack-rank<R>.txt``: Python stacks of every thread, dumped by a watchdog when the rank has made no
  progress (no batch, no forward) for half the collective timeout, and on SIGUSR1, which a rank whose
  collective timed out sends to its local siblings before it exits, and on SIGINT (a Ctrl-C the agent passed on).

The launcher then prints one summary (:func:`ddpkit.launcher.diagnosis.report`): the first exception with its
traceback, or, when the first failure is a collective timeout, where every rank stands.

Example of a hang report::

    ddpkit: HANG: a collective did not complete within the timeout
      rank 0 waits in a collective (all_reduce) at train.py:41 in train_step
      rank 1 is at train.py:55 in evaluate (not in a collective)
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

from ddpkit.core import process
from ddpkit.core.atomic import write_atomically
from ddpkit.core.errors import first_line
from ddpkit.core.reports import block_tag, finished_path, peer_lost, traceback_block

_TIMEOUT = re.compile(r"timed out|timeout|failed to pass monitoredBarrier", re.IGNORECASE)
# where a RuntimeError's message says torch.distributed raised it (older builds raise plain RuntimeErrors): torch's
# own phrasing (a source path, a class, the watchdog's sentence), not a word such as "NCCL" a user's message may hold
_DIST_ORIGIN = re.compile(r"\[c10d\]|[/\\]gloo[/\\]|ProcessGroup(Gloo|NCCL)|WorkNCCL|Watchdog caught collective|"
                          r"monitoredBarrier")
# a store that could not be reached: the rendezvous or the network failed, no collective was waiting
_CONNECT = re.compile(r"while trying to connect to|failed to connect|connection refused", re.IGNORECASE)


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
    report_dir = process.current().report_dir
    if report_dir is not None:
        open(finished_path(report_dir, rank), "w").close()


def install(rank: int, local_rank: int, report_dir: str, timeout_s: float) -> None:
    """Worker side: excepthook, SIGUSR1 stack dumps and the no-progress watchdog."""
    os.makedirs(report_dir, exist_ok=True)
    process.current().report_dir = report_dir
    stack_file = open(os.path.join(report_dir, f"stack-rank{rank}.txt"), "a")  # kept open for the C handler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # the agent passes a Ctrl-C on to its workers: where each stood goes to the same file (in C, so a rank
    # blocked in a collective dumps too), then Python's own handler raises KeyboardInterrupt as usual
    faulthandler.register(signal.SIGINT, file=stack_file, all_threads=True, chain=True)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        hang = collective_timeout(kind, str(value))
        state = process.current().state
        hint = batch_hint(str(value), process.current().train_batch, state.world_size if state else 1)
        _write_record(report_dir, rank, local_rank, kind.__name__, str(value), text, hang, hint)
        # the traceback goes into this rank's log (the report directory is gone after the launch), in a block
        # the console leaves out: the launcher's report prints the first failure's once
        print(f"{_said(rank, kind, value)} (its traceback is in this rank's stderr.log)\n"
              + (f"ddpkit: likely cause: {hint}\n" if hint else "") +
              f"{traceback_block(text, block_tag(os.path.dirname(report_dir)))}", file=sys.stderr, flush=True)
        if hang:
            _signal_siblings()
        if previous is not sys.__excepthook__:
            previous(kind, value, tb)

    sys.excepthook = excepthook
    threading.Thread(target=_watchdog, args=(stack_file, timeout_s / 2), daemon=True,
                     name="ddpkit-hang-watchdog").start()


def batch_hint(message: str, batch: int | None, world_size: int) -> str | None:
    """A shape error naming both the global batch and this rank's share of it (a target sized by the script's
    batch size, which the data loader now splits across the ranks): said once, with the two ways out.

    >>> batch_hint("Using a target size (torch.Size([16, 1])) that is different to the input size "
    ...            "(torch.Size([8, 1]))", 8, 2)[:40]
    'a tensor sized by the global batch (16) '
    >>> batch_hint("mat1 and mat2 shapes cannot be multiplied (8x4 and 8x1)", 4, 2) is None
    True
    >>> batch_hint("Given groups=1, weight of size [8, 3, 3, 3], expected input[4, 1, 5, 5] to have 3 channels", 4,
    ...            2) is None
    True
    >>> batch_hint("The size of tensor a (16) must match the size of tensor b (8) at non-singleton dimension 0", 8,
    ...            2)[:40]
    'a tensor sized by the global batch (16) '
    >>> batch_hint("shape '[16, 784]' is invalid for input of size 6272", 8, 2)[:40]  # x.view(16, 784) in a model
    'a tensor sized by the global batch (16) '
    >>> batch_hint("shape '[16, 784]' is invalid for input of size 6000", 8, 2) is None
    True
    """
    if not batch or world_size < 2:
        return None
    # (the leading sizes the message names: a Size's first dim, a batch_size, a tensor's size at a dim; not any
    # number, the channels of a conv or the digits of ``mat1``)
    leading = {int(n) for found in _LEADING.findall(message) for n in found if n}
    viewed = _VIEW.search(message)  # ``x.view(16, 784)`` of a batch of 8: the view names the 16, the size 8 x 784
    if viewed is not None:
        dims = [int(d) for d in viewed.group(1).split(",") if d.strip().lstrip("-").isdigit()]
        rest = math.prod(dims[1:]) if dims and all(d > 0 for d in dims[1:]) else 0
        if dims and dims[0] == batch * world_size and rest and int(viewed.group(2)) == batch * rest:
            leading |= {batch, batch * world_size}
    if batch not in leading or batch * world_size not in leading:
        return None
    return (f"a tensor sized by the global batch ({batch * world_size}) met this rank's batch ({batch} = "
            f"{batch * world_size} / {world_size} processes): size it from the batch itself (x.size(0)), or keep "
            "the batch per process (ddpkit.data_loader(..., batch_size=B); ddpkit convert --per-process-batch)")


_LEADING = re.compile(r"Size\(\[(\d+)|batch_size \((\d+)\)|size of tensor \w \((\d+)\)|\bshape \[(\d+)")
_VIEW = re.compile(r"shape '\[([-\d, ]+)\]' is invalid for input of size (\d+)")


def _write_record(report_dir: str, rank: int, local_rank: int, kind: str, message: str, text: str,
                  hang: bool, hint: str | None = None) -> None:
    """This rank's failure, for the launcher's report: whole or not at all (a full disk must not leave the launcher
    half a report)."""
    record = {"rank": rank, "local_rank": local_rank, "host": socket.gethostname(), "pid": os.getpid(),
              "time": time.time(), "type": kind, "message": message, "traceback": text, "hang": hang}
    if hint:
        record["hint"] = hint
    try:
        write_atomically(os.path.join(report_dir, f"error-rank{rank}.json"),
                         lambda f: f.write(json.dumps(record).encode()))
    except OSError as exc:
        print(f"ddpkit: rank {rank} could not write its error report ({exc.strerror or exc})",
              file=sys.stderr, flush=True)


def record(rank: int, local_rank: int, kind: str, line: str) -> bool:
    """This rank's failure ``kind: line``, with no traceback, for the launcher's report (a desync, replicas that
    differ at the job's end); False when no launcher reads reports (the caller says it itself)."""
    report_dir = process.current().report_dir
    if report_dir is not None:
        _write_record(report_dir, rank, local_rank, kind, line, "", False)
    return report_dir is not None


def fail_now(rank: int, local_rank: int, kind: str, line: str) -> None:
    """End this process for a failure found outside the main thread, which is stuck in a collective and cannot
    raise (a desync): the launcher's report names it as this rank's failure, then the process exits 1."""
    if not record(rank, local_rank, kind, line):  # else the launcher's report says it, once
        print(f"ddpkit: rank {rank}: {kind}: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # the main thread waits in C++: no exception reaches it, and at-exit hooks would wait for peers


def _said(rank: int, kind: type, value: BaseException) -> str:
    """The console's one line for an exception: a lost peer is said to be a consequence, so it does not read as
    the root cause that the launcher's report names after it.

    >>> _said(0, RuntimeError, RuntimeError("[pair.cc:538] Connection closed by peer"))
    'ddpkit: rank 0 lost its peer (RuntimeError: [pair.cc:538] Connection closed by peer), a consequence'
    """
    if peer_lost(str(value)):  # gloo's message goes on for three sentences: its first says it
        said = _first_line(value).split(". ")[0]
        return f"ddpkit: rank {rank} lost its peer ({kind.__name__}: {said}), a consequence"
    if issubclass(kind, KeyboardInterrupt):
        return f"ddpkit: rank {rank} was interrupted (KeyboardInterrupt)"
    return f"ddpkit: rank {rank} raised {kind.__name__}: {_first_line(value)}"


def _first_line(value: BaseException) -> str:
    return first_line(value, 300)


def _watchdog(stack_file, stale_s: float) -> None:
    dumped_for = None
    while True:
        time.sleep(min(1.0, stale_s / 4))
        beat = process.current().last_beat
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

