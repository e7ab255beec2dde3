"""Loading a checkpoint into the objects given to :meth:`ddpkit.Checkpointer.restore`: its payload read (confined,
bounded, of ddpkit's frame), the sharded part resharded by DCP, each other object checked against what it will load
(a model's keys and shapes, an optimizer's state) before its ``load_state_dict``, and every rank's RNG states.

Example::

    payload = load_into("runs/exp/ckpt-0000000100", {"model": model, "optimizer": opt}, state)
    step = payload["step"]
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ddpkit.checkpoint import agree, bounds, disk
from ddpkit.checkpoint import dcp as shards
from ddpkit.checkpoint import rng as rngstate
from ddpkit.checkpoint.confine import UnsafeCheckpoint
from ddpkit.checkpoint.reasons import check_fits, check_optimizer
from ddpkit.data.loader import ShardedDataLoader
from ddpkit.strategies.forwarding import unwrap


def load_into(path: str, objects: dict[str, Any], state: Any) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``objects`` (every rank; ``state``: this process's
    :class:`~ddpkit.runtime.group.State`); returns its payload (``step``, ``world_size``, ...)."""
    # every rank reads state.pt (and a sharded .metadata) from its own node's copy, which the ranks' split
    # validation may have hashed on another node only: each rank checks what it reads, and every rank says it
    read = ["state.pt"] + ([f"{shards.SHARDS}/.metadata"]
                           if os.path.exists(os.path.join(path, shards.SHARDS, ".metadata")) else [])
    reason = agree.first_reason(disk.unchanged(path, read) if state.world_size > 1 else None)
    if reason:
        raise UnsafeCheckpoint(f"checkpoint {path}: {reason}; copy the checkpoint again (or share one directory "
                               "between the nodes)")
    payload = bounds.load_state(path)  # confined, bounded and of ddpkit's frame before anything uses it
    sharded = set(payload.get("sharded", ()))
    saved = sorted(sharded | set(payload["objects"]))
    for name in objects:
        if name not in sharded and name not in payload["objects"]:
            raise KeyError(f"checkpoint {path} has no {name!r} (it has {saved})")
    if sharded:  # any mode, any world size: DCP reshards
        shards.load({k: v for k, v in objects.items() if k in sharded}, os.path.join(path, shards.SHARDS),
                    payload["objects"], lambda names: disk.unchanged(path, [f"{shards.SHARDS}/{n}" for n in names]))
    elif state.strategy.shards and any(isinstance(o, torch.optim.Optimizer)
                                                      for o in objects.values()):
        raise ValueError(f"checkpoint {path} was saved unsharded (mode ddp / dp / single): its optimizer state "
                         "cannot be split into fsdp's shards; resume in the mode it was saved in, or restore "
                         "the model alone and start a new optimizer")
    for name, obj in objects.items():
        if name in sharded:
            continue
        if isinstance(obj, torch.nn.Module):
            check_fits(unwrap(obj), payload["objects"][name], path)
        elif isinstance(obj, torch.optim.Optimizer):  # its load_state_dict copies the state as a tree
            check_optimizer(obj, payload["objects"][name], f"{path} {name!r}")
        obj.load_state_dict(payload["objects"][name])
    if payload["world_size"] == state.world_size:  # another world size: streams cannot match anyway
        loaders = {k: v for k, v in objects.items() if isinstance(v, ShardedDataLoader)}
        # clone: set_rng_state reads the storage from its start, so a row view of rank r > 0 would crash
        before, reason = rngstate.local(loaders, state.strategy), None
        try:
            rngstate.restore({k: v[state.rank].clone() for k, v in payload["rng"].items()}, loaders,
                             state.strategy)
        except ValueError as exc:
            reason = str(exc)
        reason = agree.first_reason(reason)  # a row refused on one rank: every rank says it, as it was before
        if reason:
            rngstate.restore(before, loaders, state.strategy)
            raise ValueError(reason)
    return payload
