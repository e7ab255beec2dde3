"""Sharded training batches with no prepared model: each rank would train a copy of its own, silently.

A training loader of :func:`ddpkit.data_loader` gives each of N ranks its part of every batch. Unless the model
the optimizer trains went through :func:`ddpkit.prepare_model` (or the script wrapped it in DDP / FSDP itself),
nothing averages the gradients: N models drift apart, each on 1/N of the data, and rank 0 prints and saves its
own. A converted script ends so when its model is prepared on one path only (``if use_cuda: model =
prepare_model(model)``) or when an optimizer trains models the converter did not follow. So at the first optimizer
step of a process whose training loader has handed out batches, with more than one process, the model must be
there: otherwise every rank raises the same one line (the same facts on every rank: no collective is needed).

Example::

    watch()          # by ddpkit.data_loader(train=True) at N > 1; the first optimizer.step() checks, once
"""

from __future__ import annotations

import gc
from typing import Any

from ddpkit.core import process

_HANDLE: list[Any] = []  # the optimizer hook (one per process); it stays, a no-op once it has checked: removing a
# global hook from inside it mutates the dict torch is iterating (another tool's hook after it then fails the step)
SAID = ("ddpkit: the training loader shards every batch across {n} processes, but no model went through "
        "ddpkit.prepare_model() before the first optimizer.step(): each rank would train its own copy on its own "
        "part of the data; pass the model the optimizer trains through model = ddpkit.prepare_model(model) on "
        "every path (not only under `if use_cuda:`), each model of an optimizer over several")


def watch() -> None:
    """Check at this process's next optimizer step (once) that a model was prepared."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    proc = process.current()  # its run's state: a forked worker or a new run in a notebook checks again
    if proc.step_checked:
        return
    proc.step_checked = True
    state = proc.state
    if state is None or state.world_size < 2 or proc.prepared or _wrapped_by_hand(optimizer):
        return
    raise RuntimeError(SAID.format(n=state.world_size))


def _wrapped_by_hand(optimizer: Any) -> bool:
    """The script's own DDP / FSDP around the optimizer's parameters (ddpkit's loaders beside torch's wrappers).
    Looked for only here, where the check would fail: the heap walk costs once."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    trained = {id(p) for group in optimizer.param_groups for p in group.get("params", ())}
    wrappers = (DistributedDataParallel, FSDPModule)
    # type(), not isinstance(): an object's own __class__ may warn (torch.distributed.reduce_op does)
    found = [obj for obj in gc.get_objects() if issubclass(type(obj), wrappers)]
    return any(id(p) in trained for module in found for p in module.parameters())
