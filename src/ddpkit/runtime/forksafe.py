"""Forks that cannot copy a held interpreter lock: a DataLoader's workers come up while torch.distributed runs.

Why. torch.distributed's own C++ threads enter Python now and then: a gloo worker thread that drops the last
reference to a tensor Python already let go of (a collective's buffer, released a moment after the collective
returned) frees its Python object, through ``PyGILState_Ensure``. That call creates a thread state under the
interpreter's thread-list lock *without* holding the GIL. A fork at that moment (a DataLoader starting its
workers right after ``gather_object``) copies the lock held, and on CPython releases before the fix for
gh-112275 (3.11.7 here) the child takes it again before anything else: the worker never starts, its rank waits
for its first batch, and every peer waits in the next collective. On 2 cores with 3 ranks x 2 loader workers,
3 launches of tests/workers/streams.py in 38 hung that way.

The fix: just before each fork, take and release that lock (``sys._current_frames()`` does, from the forking
thread, which holds the GIL). A thread inside it finishes first. The window left is what runs between this hook
and ``fork()``: the before-fork hooks registered earlier (run after this one: logging's takes its lock) and
CPython's import lock. Both are short unless another thread holds those locks; before, the window was a
preempted thread's whole time slice.

Example::

    forksafe.install()    # ddpkit.init() calls it once a process group runs; idempotent
"""

from __future__ import annotations

import gc
import os
import sys

_installed = False


def _settle() -> None:
    # sys._current_frames() waits for the thread-list lock, so no other thread holds it as the fork copies it.
    # It allocates while holding that lock, and on 3.11 before 3.11.9 (gh-106883) an allocation may run the
    # cyclic GC there: a finalizer that joins a thread would then wait for a thread that waits for the lock.
    enabled = gc.isenabled()
    gc.disable()
    try:
        sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def install() -> None:
    """Run :func:`_settle` before every ``os.fork()`` of this process (once, however often it is called)."""
    global _installed
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_settle)
        _installed = True
