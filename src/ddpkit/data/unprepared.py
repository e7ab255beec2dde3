"""Sharded training batches with no prepared model: each rank would train a copy of its own, silently.

A training loader of :func:`ddpkit.data_loader` gives each of N ranks its part of every batch. Unless the model
the optimizer trains went through :func:`ddpkit.prepare_model` (or the script wrapped it in DDP / FSDP itself),
nothing averages the gradients: N models drift apart, each on 1/N of the data, and rank 0 prints and saves its
own. A converted script ends so when its model is prepared on one path only (``if use_cuda: model =
prepare_model(model)``) or when an optimizer trains models the converter did not follow. So at the first optimizer
step of a process whose training loader has handed out batches, with more than one process, the model must be
there: otherwise every rank raises the same one line (the same facts on every rank: no collective is needed).

The reverse is said too, not raised: a model prepared for N processes whose batches came from no ddpkit training
loader by the first step (a loader built in a package the script imports from elsewhere, left plain): each rank
then trains on every batch, the same work N times over. Rank 0 says so once, unless the script shards its own
loader with a ``DistributedSampler``. And BatchNorm layers of no prepared model that ran in train mode by the
first step (a BYOL target network built on its own) are said by rank 0: each rank normalised its own share.

Example::

    watch()          # by ddpkit.data_loader(train=True) and prepare_model; the first optimizer.step() checks, once
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from ddpkit.core import process

_HANDLE: list[Any] = []  # the optimizer hook (one per process); it stays, a no-op once it has checked: removing a
# global hook from inside it mutates the dict torch is iterating (another tool's hook after it then fails the step)
SAID = ("ddpkit: the training loader shards every batch across {n} processes, but no model went through "
        "ddpkit.prepare_model() before the first optimizer.step(): each rank would train its own copy on its own "
        "part of the data; pass the model the optimizer trains through model = ddpkit.prepare_model(model) on "
        "every path (not only under `if use_cuda:`), each model of an optimizer over several")


UNSHARDED = ("ddpkit: the model is prepared for {n} processes, but no training loader of ddpkit.data_loader was "
             "built before the first optimizer.step(): if the batches come from a plain DataLoader, every rank "
             "trains on all of them (the same work {n} times over, no speed-up); build it with "
             "ddpkit.data_loader(dataset, batch_size=...) (ddpkit convert does, in the files it converts). A script "
             "that makes each rank's batches itself (docs/guide.md, data without a DataLoader) has nothing to change")


def watch(sharding: bool = True) -> None:
    """Check at this process's next optimizer step (once) that a model was prepared (``sharding``: called by a
    training loader; else by prepare_model)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if sharding:
        process.current().sharding = True

    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    proc = process.current()  # its run's state: a forked worker or a new run in a notebook checks again
    if proc.step_checked:
        return
    proc.step_checked = True
    state = proc.state
    if state is None or state.world_size < 2:
        return
    if state.is_main:
        _batchnorm_alone(state.world_size)
    if proc.prepared and not proc.sharding:
        if state.is_main and not _sampled_by_hand():
            print(UNSHARDED.format(n=state.world_size), file=sys.stderr, flush=True)
        return
    if proc.prepared or _wrapped_by_hand(optimizer):
        return
    raise RuntimeError(SAID.format(n=state.world_size))


ALONE = ("ddpkit: {n} BatchNorm layer(s) outside any prepared model ran in train mode before the first "
         "optimizer.step() ({kinds}): each rank normalises its own part of the batch, so what they compute differs "
         "from one process's (a moving-average target network?); prepare that model: target = "
         "ddpkit.prepare_model(target.requires_grad_(False)) gives it BatchNorm over the global batch (no DDP: "
         "nothing of it trains), or call it in eval mode")


def _batchnorm_alone(world_size: int) -> None:
    """Say (rank 0, once) that BatchNorm layers of no prepared model normalised batches in train mode: each rank's
    statistics are its own share's. A BYOL target network built on its own was silently that."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.strategies.frozen import PREPARED
    from ddpkit.strategies.syncbn import SyncBatchNorm

    objects = gc.get_objects()
    # type(), not isinstance(): an object's own __class__ may warn (torch.distributed.reduce_op does)
    prepared = [obj for obj in objects if issubclass(type(obj), (DistributedDataParallel, FSDPModule))]
    inside = {id(m) for obj in [*prepared, *PREPARED] for m in obj.modules()}
    synced = (nn.SyncBatchNorm, SyncBatchNorm)
    alone = [obj for obj in objects if issubclass(type(obj), nn.modules.batchnorm._BatchNorm)
             and not issubclass(type(obj), synced) and id(obj) not in inside and obj.training
             and obj.track_running_stats and obj.num_batches_tracked is not None
             and not obj.num_batches_tracked.is_meta and int(obj.num_batches_tracked) > 0]  # (meta: never ran)
    if alone:
        kinds = ", ".join(sorted({type(m).__name__ for m in alone}))
        print(ALONE.format(n=len(alone), kinds=kinds), file=sys.stderr, flush=True)


def _sampled_by_hand() -> bool:
    """A DistributedSampler of torch's alive in the process: the script shards a loader of its own by hand (looked
    for once, on rank 0, where the note would be said)."""
    from torch.utils.data import DistributedSampler

    return any(issubclass(type(obj), DistributedSampler) for obj in gc.get_objects())


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
