r"""Collective desync caught in seconds, not at the process group's timeout: ranks waiting in different collectives.

A thread of each rank looks at the main thread once a second (its Python stack and the group's collective
sequence number: no collective, no per-step cost). Once the main thread has waited in one collective for
:func:`patience` (a multiple of the usual step time, at least a few seconds) with the sequence number standing
still, the rank posts what it waits in to the job's store (never a collective: those are what hang): the
collective's kind, its tensors' dtypes and shapes, the script's file:line and the sequence number. When every
rank has posted and two ranks wait in collectives of the same sequence number but of different kinds (see
:func:`verdict`), the ranks are desynchronised: one line, written as this rank's failure for the launcher's
report, and the rank exits, long before the timeout. DDP's gradient all-reduces run in C++ inside the backward,
where a rank may as well be computing: ranks there are listed, but only collectives of the script's are compared.

Ranks that all wait in the same collective are merely slow (a straggler, or a hang that the
timeout reports as before): nothing is said. A rank that is not in a collective (computing, loading, stuck in
the script's own wait) posts where its main thread is, the script's innermost line, while any rank has posted
a wait (a counter in the store, read once a second): it completes the verdict and is named in it ("rank 2 is
outside any collective at train.py:120"), but is never a collective of its own.

Example (what a rank waits in, and the verdict over every rank's)::

    >>> a = {"op": "all_reduce", "tensors": ["float32[1024]"], "at": "train.py:88", "seq": 7}
    >>> b = {"op": "broadcast", "tensors": ["float32[1024]"], "at": "train.py:93", "seq": 7}
    >>> print(verdict([b, a, b]).replace("; ", ";\n"))
    ranks wait in different collectives: rank 1 is in all_reduce(float32[1024]) at train.py:88 (collective #7);
    ranks 0, 2 are in broadcast(float32[1024]) at train.py:93 (collective #7)
    >>> verdict([a, a]) is None
    True
    >>> verdict([a, dict(a, op="backward")]) is None  # the other rank may still be computing its backward
    True
    >>> verdict([a, dict(a, op=None, at="train.py:120")]) is None  # a straggler: one collective waits for it
    True
    >>> verdict([a, dict(a, at="train.py:90")]) is None  # one barrier written on two lines is one collective
    True
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.core import contract, process

TICK_S = 1.0  # how often the main thread is looked at (each look wakes a thread that takes the GIL)
MIN_WAIT_S = 3.0  # the least wait in one collective that is looked into (the default of DDPKIT_DESYNC_AFTER)
STEPS = 20  # x the usual step time: a wait this much longer than a step is no straggler's noise
_PREFIX = "ddpkit/desync/"
_WAITERS = _PREFIX + "waiters"  # how many ranks have a wait posted: the others then post where they are
# torch.distributed's collectives, as their Python functions are named (the outermost one a stack holds is
# the script's call: all_gather_object calls all_gather)
COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "barrier", "monitored_barrier", "gather", "scatter", "reduce", "all_to_all", "all_to_all_single", "send",
    "recv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "batch_isend_irecv"})
_C10D = os.path.join("distributed", "distributed_c10d.py")
_LIBRARIES = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (torch, sys.modules["ddpkit"]))


def where(frame: FrameType | None) -> dict[str, Any]:
    """What a thread whose innermost frame is ``frame`` is doing: ``op`` (a collective's name, or None), its
    tensors (``float32[1024]``), and ``at``: the script's file:line that called it (outside a collective, the
    script's innermost line). ``backward``: inside a backward, where DDP's all-reduces run in C++ and a rank may
    as well be computing (a straggler) as waiting; a collective a backward calls from Python (SyncBatchNorm's) is
    named as itself."""
    op, tensors, outer, first_user = None, [], None, None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_C10D) and code.co_name in COLLECTIVES:
            op, outer = code.co_name, frame
            tensors = _tensors([frame.f_locals.get(a) for a in code.co_varnames[:code.co_argcount]])
        elif op is None and code.co_name == "_engine_run_backward":
            op, outer = "backward", frame
        elif first_user is None and not code.co_filename.startswith(_LIBRARIES):
            first_user = frame
        frame = frame.f_back
    caller = _caller(outer) if outer is not None else first_user
    at = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}" if caller is not None else "?"
    return {"op": op, "tensors": tensors, "at": at}


def _caller(frame: FrameType) -> FrameType | None:
    """The script's frame that called into torch or ddpkit, outward from ``frame``."""
    outer = frame.f_back
    while outer is not None and outer.f_code.co_filename.startswith(_LIBRARIES):
        outer = outer.f_back
    return outer


def _tensors(arguments: list[Any]) -> list[str]:
    """The dtypes and shapes of a collective's tensor arguments (of a list's first tensor)."""
    found = []
    for value in arguments:
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, torch.Tensor):
            found.append(f"{str(first.dtype).replace('torch.', '')}{list(first.shape)}")
    return found[:3]


def _said(state: dict[str, Any]) -> str:
    """How a rank's wait reads, and what ranks are grouped by."""
    if state["op"] is None:
        return f"outside any collective at {state['at']}"
    if state["op"] == "backward":
        return f"backward at {state['at']}"
    return f"{state['op']}({', '.join(state['tensors'])}) at {state['at']} (collective #{state['seq']})"


def verdict(states: list[dict[str, Any]]) -> str | None:
    """The line for ranks that wait in different collectives (``states[rank]``); None unless two ranks wait in
    collectives of the script's with the same sequence number (the backend matches those with each other) and
    different kinds. Ranks at other numbers may be ahead by right (a non-root rank's gather returns once sent),
    one collective written on two lines (``if rank == 0: ... barrier() else: barrier()``) is one collective, and
    a rank in a backward (it may be computing) or outside any collective is listed, never compared."""
    ops: dict[int, set[str]] = {}
    for state in states:
        if state["op"] not in ("backward", None):
            ops.setdefault(state["seq"], set()).add(state["op"])
    if not any(len(kinds) > 1 for kinds in ops.values()):
        return None
    groups: dict[str, list[int]] = {}
    for rank, state in enumerate(states):
        groups.setdefault(_said(state), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    parts = [f"{'rank' if len(r) == 1 else 'ranks'} {', '.join(map(str, r))} {'is' if len(r) == 1 else 'are'} "
             f"{'' if said.startswith('outside') else 'in '}{said}" for said, r in ordered]
    return "ranks wait in different collectives: " + "; ".join(parts)


def patience(step_s: float | None, floor_s: float = MIN_WAIT_S) -> float:
    """How long a wait in one collective lasts before it is looked into.

    >>> patience(None), patience(0.01), patience(1.5)
    (3.0, 3.0, 30.0)
    """
    return max(floor_s, STEPS * step_s) if step_s else floor_s


class Watch(threading.Thread):
    """The watching thread of one rank (a daemon: it never holds the process up)."""

    def __init__(self, rank: int, world_size: int, store: Any, group: Any, floor_s: float, report: Any):
        super().__init__(name="ddpkit-desync-watch", daemon=True)
        self.rank, self.world_size, self.store, self.group = rank, world_size, store, group
        self.floor_s, self.report = floor_s, report
        self.main = threading.main_thread().ident
        self.stopped = threading.Event()
        self.paused = False  # looks at nothing while set (the bench's "off" blocks: the same thread, asleep)
        self.posted: bool | str = False  # True: a wait posted (counted in _WAITERS); "outside": where it is

    def run(self) -> None:
        waiting, since, beats = None, time.monotonic(), (process.current().beats, time.monotonic())
        step_s: float | None = None
        while not self.stopped.wait(TICK_S):
            now, proc = time.monotonic(), process.current()
            if proc.beats > beats[0]:  # the usual step time: between forwards / batches handed out
                step_s = (now - beats[1]) / (proc.beats - beats[0])
                beats = (proc.beats, now)
            if self.paused:
                continue
            state = self._state()
            key = None if state is None or state["op"] is None else (state["op"], state["at"], state["seq"])
            if key != waiting:
                waiting, since = key, now
                self._withdraw()
                continue
            if state is not None and key is None:
                self._outside(state)
            elif state is not None and now - since >= patience(step_s, self.floor_s):
                self._compare(state)

    def _state(self) -> dict[str, Any] | None:
        try:
            seq = self.group._get_sequence_number_for_group()
        except (RuntimeError, AttributeError, ValueError):
            return None  # the group is gone (shutdown): nothing to watch
        frame = sys._current_frames().get(self.main) if self.main is not None else None
        return {**where(frame), "seq": int(seq)}

    def _outside(self, state: dict[str, Any]) -> None:
        """Not in a collective: where this rank is, posted while a peer has a wait posted (it may be this rank
        that the peer waits for), else nothing."""
        try:
            if self.store.add(_WAITERS, 0) > 0:
                self.store.set(f"{_PREFIX}{self.rank}", json.dumps(state))
                self.posted = "outside"
            elif self.posted:
                self._withdraw()
        except RuntimeError:  # the store's host is gone: the job is ending
            return

    def _compare(self, state: dict[str, Any]) -> None:
        keys = [f"{_PREFIX}{r}" for r in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], json.dumps(state))
            if self.posted is not True:  # counted once per wait
                self.store.add(_WAITERS, 1)
            self.posted = True
            if not self.store.check(keys):
                return
            states = [_parse(raw) for raw in self.store.multi_get(keys)]
        except RuntimeError:  # the store's host is gone: the job is ending
            return
        if any(s is None for s in states):
            return
        line = verdict([s for s in states if s is not None])
        if line:
            self.report(self.rank, line)

    def _withdraw(self) -> None:
        """This rank moved on: its last post no longer says where it is."""
        if self.posted:
            try:
                # overwritten, not deleted: a peer between its check() and its multi_get() would wait for the key
                # for the store's whole timeout (the group's, 15 min by default), blind meanwhile
                self.store.set(f"{_PREFIX}{self.rank}", "moved on")
                if self.posted is True:
                    self.store.add(_WAITERS, -1)
            except RuntimeError:
                pass
            self.posted = False


_MAX_POST = 4096  # bytes: what a rank posts is a few names and numbers


def _parse(raw: bytes) -> dict[str, Any] | None:
    """A peer's post, or None when it is not one a rank of this job wrote."""
    if len(raw) > _MAX_POST:
        return None
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    fields = {"at": str, "seq": int, "tensors": list}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in fields.items()) or \
            not isinstance(state.get("op", 0), (str, type(None))):  # None: outside any collective
        return None
    return state


def floor_from(environ: Any) -> float:
    """``DDPKIT_DESYNC_AFTER`` in seconds (default :data:`MIN_WAIT_S`; 0: off); one line for a bad value.

    >>> floor_from({}), floor_from({"DDPKIT_DESYNC_AFTER": "0"})
    (3.0, 0.0)
    """
    raw = contract.DESYNC_AFTER.text(environ)
    if raw is None:
        return MIN_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value < float("inf")):
        raise contract.ContractError(f"{contract.DESYNC_AFTER.name}={raw!r} is not a number of seconds >= 0; "
                                     f"unset it (default {MIN_WAIT_S:g}) or give one (0: no desync watch)")
    return value


def start(state: Any, floor_s: float, report: Any) -> Watch | None:
    """The watch of this rank, started (None with one process, or when ``floor_s`` is 0: turned off)."""
    if state.world_size < 2 or floor_s <= 0 or not dist.is_initialized():
        return None
    group = dist.distributed_c10d._get_default_group()
    watch = Watch(state.rank, state.world_size, dist.distributed_c10d._get_default_store(), group, floor_s, report)
    watch.start()
    return watch
