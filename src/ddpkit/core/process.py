"""What this process holds for the run, in one place: the :class:`State` once :func:`ddpkit.init` ran, the
tool hooks, the shutdown hooks, the no-progress clock, and the small facts other layers remember (the
report folder, the checkpoint run id, whether a join is running). One :func:`reset` forgets it all, and
is the first thing a worker forked by ``ddpkit.spawn`` runs: a notebook kernel that already ran
``ddpkit.init()`` would otherwise hand its one-process state to every worker.

Torch-free (the bottom layer): the State's device is a ``torch.device``, named in annotations only.

Example::

    >>> proc = current(); proc.joining
    False
    >>> reset() is current() and current() is not proc
    True
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclasses.dataclass(frozen=True)
class State:
    """What this process is: its place in the job (torch's names), its device, and the parallel mode.

    ``mode`` is the mode's name (``ddp``: one process per device, gradients all-reduced; ``dp``: this one
    process drives every visible GPU through ``torch.nn.DataParallel``; ``fsdp``; ``single``), ``strategy``
    the mode itself, the entry of the strategy table every mode-dependent question is asked of.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    mode: str
    reason: str
    # a ddpkit.strategies.table.Strategy; typed Any: the bottom layer names nothing above it, not even for mypy
    strategy: Any = dataclasses.field(repr=False, compare=False, default=None)

    @property
    def is_main(self) -> bool:
        """True on the one process (global rank 0) that should print, log and write files."""
        return self.rank == 0


Hook = Callable[[], None]


@dataclasses.dataclass
class Process:
    """The mutable state of one process's run; see the module docstring."""

    state: State | None = None
    tools: Any = None  # the launching command's hooks (ddpkit.runtime.instrument.Hooks); None: a normal run
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    shutdown_hooks: list[Hook] = dataclasses.field(default_factory=list)  # run while the group works
    release_hooks: list[Hook] = dataclasses.field(default_factory=list)  # run even after an uncaught exception
    last_beat: float = dataclasses.field(default_factory=time.monotonic)  # the hang watchdog's clock
    beats: int = 0  # heartbeats so far: the desync watch's measure of the usual step time
    report_dir: str | None = None  # this worker's report folder under ddpkit launch, once faults.install ran
    run_id: str | None = None  # the checkpoint run id when no launcher gave one
    exit_failure: str | None = None  # a shutdown hook's failure that fails the process (a background checkpoint)
    joining: bool = False  # inside ddpkit.join: loaders may hand out uneven batch counts
    phases: Any = None  # this rank's ddpkit.runtime.phases.PhaseClock under ddpkit launch
    desync: Any = None  # this rank's ddpkit.runtime.desync.Watch (a thread) while its group runs
    listener: Any = None  # this rank's ddpkit.runtime.leaving.Listener (a thread) while its group runs
    prepared: int = 0  # models through ddpkit.prepare_model: sharded training batches need one (data.unprepared)
    step_checked: bool = False  # data.unprepared looked at this run's first optimizer step
    sharding: bool = False  # a training loader of ddpkit.data_loader was built (data.unprepared)
    train_batch: int | None = None  # the per-process batch of the last training loader built: a recurrent
    # layer's time axis of that size is a batch read as time (strategies.unbatched)
    groups: int = 0  # the process groups this process started: each one's exit keys in the store apart
    store: Any = None  # the group's store, held: it outlives a destroy_process_group() of the script's
    # called by ddpkit's DDP wrapper as its forward starts (True: before its buffer broadcast) and as the module's
    # own forward starts (False): the phase clock's stamps there. Forward hooks on the wrapper or the module in it
    # would change how a torch.compile around the prepared model splits its frames (3 compiles became 6)
    on_ddp_forward: Callable[[Any, bool], None] | None = None


_current = Process()


def current() -> Process:
    """This process's run state."""
    return _current


def reset() -> Process:
    """Forget what this process inherited, as a new interpreter would have nothing: the kernel's State and
    hooks, and a last failed cell's ``sys.last_value`` (read as this worker's failure: no final barrier, no
    shutdown hooks). A fresh lock too: another thread of the parent may have held it at the fork."""
    global _current
    _current = Process()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    return _current


def on_shutdown(hook: Hook, *, always: bool = False) -> None:
    """Run ``hook()`` at :func:`ddpkit.shutdown`, while the process group still works (e.g. a final save).

    ``always=True``: run it after an uncaught exception too (for local clean-up that needs no peer). A hook
    already registered is kept once (each DDP wrap registers the same reducer release).
    """
    hooks = _current.release_hooks if always else _current.shutdown_hooks
    if hook not in hooks:
        hooks.append(hook)


def heartbeat() -> None:
    """Training made progress (a batch handed out, a forward): the no-progress watchdog counts from now."""
    _current.last_beat = time.monotonic()
    _current.beats += 1
