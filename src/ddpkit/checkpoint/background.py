"""Checkpoints written while training goes on: what :class:`ddpkit.Checkpointer` with ``async_save=True`` does
after it has collected the state.

The state is *staged* first, on the training thread: every tensor copied to CPU memory of its own (sharded state
by ``torch.distributed.checkpoint.async_save``'s stager), so the next optimizer step cannot change what is being
written. Then one background thread per process writes it and commits it exactly as a synchronous save does
(a temporary directory, fsynced, renamed into place, checksummed), and the training thread returns. One write at
a time: the next save, ``wait()``, ``restore()`` and ``ddpkit.shutdown()`` (at exit) wait for it and every rank
learns its outcome; a failed write is then raised on every rank, and also printed by the rank it failed on when
it fails. A process killed during the write leaves the previous checkpoint as it was: nothing is renamed into
place before the write is whole.

Example::

    ckpt = ddpkit.Checkpointer("runs/exp", async_save=True)
    ckpt.save(step, model=model, optimizer=optimizer)   # returns once the state is copied; the write goes on
    ...
    ckpt.wait()                                         # optional: the last write's outcome, on every rank
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

# the temporary directories of this process's writes still running: a second Checkpointer of the same directory
# clears the leftovers of killed saves at its start, and must not take these for such leftovers
IN_FLIGHT: set[str] = set()


def stage(obj: Any, reuse: Any = None) -> Any:
    """``obj`` with every tensor replaced by a CPU copy of its own (dicts, lists and tuples walked). ``reuse``: an
    earlier staging of the same structure, whose write has ended: a tensor of the same shape and dtype there is
    copied into rather than allocated again (a fresh 300 MB buffer costs its page faults on every save).

    >>> w = torch.ones(2); staged = stage({"model": {"w": w}, "step": 3, "groups": [(w, 1)]})
    >>> _ = w.add_(1); staged["model"]["w"].tolist(), staged["groups"][0][0].tolist(), staged["step"]
    ([1.0, 1.0], [1.0, 1.0], 3)
    >>> again = stage({"model": {"w": w}}, reuse=staged); again["model"]["w"] is staged["model"]["w"], again
    (True, {'model': {'w': tensor([2., 2.])}})
    """
    if isinstance(obj, torch.Tensor):
        if isinstance(reuse, torch.Tensor) and reuse.device.type == "cpu" and reuse.shape == obj.shape and \
                reuse.dtype == obj.dtype and reuse.layout == obj.layout == torch.strided and reuse.is_contiguous():
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # a copy of its own kind: an OrderedDict stays one, a defaultdict keeps its factory
        old = reuse if isinstance(reuse, dict) else {}
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = stage(v, old.get(k))
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        same = isinstance(reuse, (list, tuple)) and len(reuse) == len(obj)
        return type(obj)(stage(v, reuse[i] if same else None) for i, v in enumerate(obj))
    return obj


class BackgroundWrite:
    """One checkpoint's write, running on its own thread: ``result()`` waits for it and returns what ``write``
    returned, or raises what it raised. ``announce(error)`` is called on the thread when it fails, at once."""

    def __init__(self, step: int, tmp: str, write: Callable[[], Any],
                 announce: Callable[[BaseException], None] | None = None):
        self.step, self.tmp = step, tmp
        self._write, self._announce = write, announce
        self._value: Any = None
        self._error: BaseException | None = None
        # not a daemon: an interpreter that exits (even after an uncaught exception) first lets the write finish
        self._thread = threading.Thread(target=self._run, name=f"ddpkit-checkpoint-{step}")
        IN_FLIGHT.add(os.path.abspath(tmp))
        self._thread.start()

    def _run(self) -> None:
        _yield_to_training()
        try:
            self._value = self._write()
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._error = exc
            if self._announce is not None:
                self._announce(exc)
        finally:
            IN_FLIGHT.discard(os.path.abspath(self.tmp))

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> BaseException | None:
        """Wait for the write on this rank alone (no peer is asked); its error, if it failed."""
        self._thread.join()
        return self._error

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _yield_to_training() -> None:
    """The calling thread at the lowest CPU priority: on Linux a nice value is a thread's own, so on a busy
    machine the training thread (and its data loading) goes first and the write takes the cycles left over.
    Elsewhere, or where it is refused, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
