"""The launcher's half of the fault reports: it reads what the workers wrote (:mod:`ddpkit.runtime.faults`, in
the format of :mod:`ddpkit.core.reports`) and says what happened, once: the root cause with its traceback, then
the consequences, or where each rank stands.

Example::

    code, text = report("/tmp/ddpkit-report-x/attempt0", {1: "killed by SIGKILL"})
    # (1, "ddpkit: rank 1 failed first: killed by SIGKILL, without a Python exception; ranks [0] then lost ...")
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable

from ddpkit.core.errors import HANG, SCRIPT_FAILED
from ddpkit.core.errors import first_line as one_line  # said() has a flag of that name
from ddpkit.core.reports import block_marker, finished_path, peer_lost

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


def report(report_dir: str, crashed: dict[int, str] | None = None, stderr_tails: dict[int, str] | None = None,
           stopped_at: dict[int, float] | None = None) -> tuple[int, str] | None:
    """The launcher's one report for a failed run, or None when no worker left one.

    ``crashed``: ranks that died without a Python exception (signal, exit code) -> how. When every recorded
    exception only says a peer went away, such a rank is the root cause. ``stderr_tails``: the end of each
    crashed rank's stderr; a rank that NCCL's watchdog aborted for a timeout makes this a hang report, and a
    rank that failed before ``ddpkit.init()`` installed the report has its traceback there. ``stopped_at``: when
    each rank last wrote to its log (torch's timestamps are whole seconds): of the ranks that left no report, the
    one that stopped first is the root cause.
    """
    crashed, tails = crashed or {}, stderr_tails or {}
    errors = records(report_dir)
    aborted = sorted(r for r, tail in tails.items() if r in crashed and nccl_timeout(tail))
    if aborted:
        line = next(x for x in tails[aborted[0]].splitlines() if nccl_timeout(x))
        return HANG, _hang_report(report_dir, {}, f"first timeout on rank {aborted[0]} (NCCL watchdog, "
                                       f"{crashed[aborted[0]]}): {line.strip()[:200]}", nccl=True)
    silent = {r: how for r, how in crashed.items() if r not in {e["rank"] for e in errors}}
    if silent and all(peer_lost(e["message"]) for e in errors):
        return SCRIPT_FAILED, _silent_report(report_dir, silent, tails, sorted(e["rank"] for e in errors),
                                                  stopped_at or {})
    if not errors:
        return None
    # a rank that lost its peer is a consequence: the root cause is the first exception of its own
    first = min([e for e in errors if not peer_lost(e["message"])] or errors, key=lambda e: e["time"])
    if all(peer_lost(e["message"]) for e in errors):
        # nothing on this node failed on its own: a process elsewhere (another node) went away first
        return SCRIPT_FAILED, (
            f"ddpkit: ranks {sorted(e['rank'] for e in errors)} on {first['host']} lost their peer "
            f"({first['message'].splitlines()[0].split('. ')[0][:160]}); no rank here failed first, "
            "so the root cause is on "
            "another node: see that node's launcher output (it may have been killed or lost)")
    if not first.get("hang"):
        head = f"ddpkit: rank {first['rank']} on {first['host']} failed first: {said(first)}"
        head += f"\nddpkit: likely cause: {first['hint']}" if isinstance(first.get("hint"), str) else ""
        others = sorted(e["rank"] for e in errors if e is not first)
        tail = f"\n(ranks {others} failed after it; each rank's traceback is in its stderr.log)" if others else ""
        return SCRIPT_FAILED, f"{head}\n{first['traceback'].rstrip()}{tail}"
    return HANG, _hang_report(report_dir, {e["rank"]: e for e in errors},
                                   f"first timeout on rank {first['rank']}: {one_line(first['message'])}")


def said(error: dict, first_line: bool = False) -> str:
    """An exception as Python prints its last line: ``ValueError: bad batch``, a bare ``KeyboardInterrupt``.

    >>> said({"type": "KeyboardInterrupt", "message": ""}), said({"type": "E", "message": "a\\nb"}, first_line=True)
    ('KeyboardInterrupt', 'E: a')
    """
    message = error["message"]
    if first_line:
        message = one_line(message)
    return f"{error['type']}: {message}" if message else error["type"]


def finished(report_dir: str, ranks: Iterable[int]) -> bool:
    """Every one of ``ranks`` wrote its finished mark (:func:`ddpkit.runtime.faults.mark_finished`) into
    ``report_dir``: a signal that killed them afterwards came after the work was done.

    >>> finished("/nonexistent/attempt0", [0]), finished("/nonexistent/attempt0", [])
    (False, True)
    """
    return all(os.path.exists(finished_path(report_dir, rank)) for rank in ranks)


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


def _silent_report(report_dir: str, silent: dict[int, str], tails: dict[int, str], lost: list[int],
                   stopped_at: dict[int, float]) -> str:
    """The root cause is a rank that left no report: its traceback from its stderr (it failed before
    ``ddpkit.init()``), the script's own exit code, or the signal that killed it."""
    # the agent SIGTERMs the survivors; a rank that exited 0 is a cause only when none stopped with a failure;
    # of the others, the one that stopped first (torchrun names it too)
    rank = min(silent, key=lambda r: ("SIGTERM" in silent[r], silent[r] == "exited with code 0",
                                      stopped_at.get(r, float("inf")), r))
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
    if how == "exited with code 2":
        return f"ddpkit: rank {rank} exited with code 2 ({_usage(tail)}), the first rank to stop{after}"
    if how.startswith("exited with code"):
        said = [x for x in tail.splitlines() if x.strip() and not x.startswith(f"ddpkit: rank {rank} ")]
        # sys.exit("message") exits 1 and Python prints the message as the last line
        quote = f'; its last stderr line: "{said[-1].strip()[:300]}" (a sys.exit message?)' \
            if how == "exited with code 1" and said else ""
        return (f"ddpkit: rank {rank} {how}, the first rank to stop, without a Python exception (the script's "
                f"sys.exit or os._exit){quote}{after}")
    return f"ddpkit: rank {rank} failed first: {how}, without a Python exception{after}"


def _usage(tail: str) -> str:
    """What an exit code 2 says: argparse's (and the shell's) usage error, quoted from the log when it is there.

    >>> _usage("usage: t.py [-h] --epochs EPOCHS\\nt.py: error: the following arguments are required: --epochs")
    'a usage error: t.py: error: the following arguments are required: --epochs'
    """
    said = [x.strip() for x in tail.splitlines() if re.match(r"^\S+: error: ", x)]
    if said:
        return f"a usage error: {said[-1][:300]}"
    return "exit code 2 is argparse's for a usage error: check the script's arguments; its log has the rest"


def _lines(tail: str) -> str:
    """A stderr tail without torch's ``[rankN]:`` prefixes and ddpkit's traceback-block lines."""
    lines = (_RANK_PREFIX.sub("", x) for x in tail.splitlines())
    return "\n".join(x for x in lines if not block_marker(x))


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
    lines = ["ddpkit: HANG: a collective did not complete within the timeout", *stands(report_dir, errors, nccl)]
    lines.append(f"  {last_line}")
    return "\n".join(lines)


def stands(report_dir: str, errors: dict[int, dict] | None = None, nccl: bool = False) -> list[str]:
    """One line per rank that dumped its stacks into ``report_dir``: where it stood at its last dump (a rank
    whose collective timed out: where its own traceback says).

    Example line: ``  rank 0 waits in a collective (barrier) at train.py:41 in train_step``
    """
    errors, lines = errors or {}, []
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
    return lines


def _as_dump(tb: str) -> str:
    """A Python traceback (most recent last) in faulthandler's order (most recent first)."""
    frames = re.findall(r'  File "([^"]+)", line (\d+), in (\S+)', tb)
    return "\n".join(f'  File "{f}", line {n} in {fn}' for f, n, fn in reversed(frames))
