"""Mode ``hsdp``: hybrid sharding on FSDP2. ``fully_shard`` on a 2-D device mesh: the model is sharded inside a
group of ``shard_size`` processes (by default one node's: all-gathers and reduce-scatters stay on the fast links
inside it) and replicated across the groups (one gradient all-reduce per step crosses the nodes).

Everything else is the fsdp mode's: the blocks, meta-device init with rank 0's draws, the full state dict,
sharded checkpoints (DCP reshards: a checkpoint of 2 x 2 resumes as 1 x 4, in fsdp, ddp or one process).

Example::

    >>> HSDPStrategy().options({"shard_size": 2, "shard": 4096, "check_sync_every": 50})  # doctest: +ELLIPSIS
    HSDPOptions(init_fn=None, sync_batchnorm=True, shard=4096, fsdp_kwargs={}, shard_size=2, check_sync_every=50, ...)
    >>> mesh_shape(world_size=8, local_world_size=4, shard_size=None)   # 2 nodes of 4: (replicas, shard)
    (2, 4)

Torch-free at module level, like every table entry.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ddpkit.strategies.fsdp import FSDPOptions, FSDPStrategy


@dataclasses.dataclass(frozen=True)
class HSDPOptions(FSDPOptions):
    """fsdp's options, and ``shard_size``: how many processes share one copy of the model (default: the
    processes of one node, ``local_world_size``); the world size must be a multiple of it. ``check_sync_every``
    and ``heal`` as in ddp: each rank's shards are compared with the same shards of the other replicas."""

    shard_size: int | None = None
    check_sync_every: int | str = "auto"
    heal: bool | str = False


def mesh_shape(world_size: int, local_world_size: int, shard_size: Any) -> tuple[int, int]:
    """(replicas, shard size) for a world size; a shape that does not fit it is one line naming the fix.

    >>> mesh_shape(6, 6, 4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: hsdp: shard_size=4 does not divide the world size 6; pass one of 1, 2, 3, 6 (...), or launch ...
    """
    size = local_world_size if shard_size is None else shard_size
    fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
    example = fits[min(1, len(fits) - 1)]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"hsdp: shard_size={shard_size!r} is not a whole number >= 1; pass one of "
                         f"{', '.join(map(str, fits))} (prepare_model(model, shard_size={example}))")
    if world_size % size:
        said = f"shard_size={size}" if shard_size is not None else f"one node's {size} processes (the default)"
        raise ValueError(f"hsdp: {said} does not divide the world size {world_size}; pass one of "
                         f"{', '.join(map(str, fits))} (prepare_model(model, shard_size={example})), or launch a "
                         f"multiple of {size} processes")
    return world_size // size, size


class HSDPStrategy(FSDPStrategy):
    """Sharded inside a group of processes (a node), replicated across the groups (FSDP2 on a 2-D mesh)."""

    name = "hsdp"
    title = "hybrid sharding (FSDP2, 2-D mesh)"
    options_type = HSDPOptions

    def wrap(self, model: Any, state: Any, **given: Any) -> Any:
        """fsdp's wrap, then the replicas' checks across the groups: each rank's shards against the same shards
        of the other replicas (:class:`~ddpkit.strategies.replicas.Replicas` over the mesh's replica dimension)."""
        from ddpkit.strategies import fsdp_wrapper

        wrapped = super().wrap(model, state, **given)
        options = self.options(given)
        fsdp_wrapper.check_replicas(wrapped, options.check_sync_every, options.heal)
        return wrapped

    def mesh(self, state: Any, options: Any) -> tuple[int, ...]:
        """The agreed shape, said once. Collective: the default (one node's processes) is the same on every rank
        only when every node runs as many processes; otherwise every rank raises the same line (a rank raising
        alone would leave the others in the mesh's first collective)."""
        size = options.shard_size
        if size is None and state.world_size > 1:
            import torch
            import torch.distributed as dist

            counts = torch.tensor([state.local_world_size, -state.local_world_size], device=state.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            most, fewest = int(counts[0]), -int(counts[1])
            if most != fewest:
                raise ValueError(f"hsdp: the nodes run different numbers of processes ({fewest} to {most}), so "
                                 "one node's processes is no shard size; pass prepare_model(model, shard_size=N) "
                                 "with an N that divides the world size")
        replicas, size = mesh_shape(state.world_size, state.local_world_size, size)
        if state.is_main:
            print(f"ddpkit: hsdp mesh {replicas} x {size}: each copy of the model sharded over {size} process(es), "
                  f"{replicas} cop{'y' if replicas == 1 else 'ies'} (gradients all-reduced across them)",
                  file=sys.stderr, flush=True)
        return replicas, size

    def shard_group_size(self, state: Any, shard_size: int | None = None) -> int:
        return mesh_shape(state.world_size, state.local_world_size, shard_size)[1]
