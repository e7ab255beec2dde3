"""Mode ``fsdp``: one process per device; parameters, gradients and optimizer state sharded across ranks, on
torch's FSDP2 ``fully_shard`` (the blocks, the sharding and the root wrapper are in ``fsdp_wrapper.py``).

A mode that ``shards``: the base :meth:`~ddpkit.strategies.base.Strategy.prepare` hands it a model built inside
``ddpkit.init_empty()`` still on the meta device; its wrap shards first, then materialises one shard per rank.

Example::

    >>> FSDPStrategy().options({"shard": 4096, "check_sync_every": 50, "reshard_after_forward": False})
    FSDPOptions(init_fn=None, sync_batchnorm=True, shard=4096, fsdp_kwargs={'reshard_after_forward': False})

Torch-free at module level, like every table entry (``ddpkit launch`` reads the table before it loads torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddpkit.strategies.base import Options
from ddpkit.strategies.ddp import DDPStrategy

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn


@dataclasses.dataclass(frozen=True)
class FSDPOptions(Options):
    """``sync_batchnorm`` as in ddp; ``shard``: the blocks (a parameter count, default 1M, or a list of
    classes: ``[Block]``); ``fsdp_kwargs``: ``fully_shard``'s own (``mp_policy=MixedPrecisionPolicy(...)``).
    No ``check_sync_every`` or ``comm``: the replicas they check and tune do not exist here."""

    kwargs_field = "fsdp_kwargs"
    sync_batchnorm: bool = True
    shard: Any = None  # a ddpkit.strategies.fsdp_wrapper.Shard
    fsdp_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class FSDPStrategy(DDPStrategy):
    """One process per device; parameters, gradients and optimizer state sharded (FSDP2 ``fully_shard``)."""

    name = "fsdp"
    title = "FullyShardedDataParallel (FSDP2)"
    shards = True
    collective_forward = True
    options_type = FSDPOptions

    def wrap(self, model: nn.Module, state: Any, **given: Any) -> nn.Module:
        """SyncBatchNorm (unless off); every rank takes rank 0's weights (a meta model: its ties are found);
        ``fully_shard`` per block then the root; a meta model materialised, shard by shard, with rank 0's draws."""
        options = self.options(given)
        shape = self.mesh(state, options)  # checked before anything changes
        from ddpkit.strategies import fsdp_wrapper, meta
        from ddpkit.strategies.syncbn import sync_batchnorms

        if options.sync_batchnorm:
            model = sync_batchnorms(model, state)
        empty = meta.on_meta(model)
        if not empty:  # fully_shard broadcasts nothing: without this, rank r's rows would come from seed s + r
            fsdp_wrapper.broadcast_from_rank0(model, state)
        before = list(model.parameters())
        ties = meta.find_ties(model) if empty else {}  # now: fully_shard replaces the recorded parameters
        fsdp_wrapper.shard_blocks(model, state, options.shard, options.fsdp_kwargs, shape)
        if empty:
            with fsdp_wrapper.rank0_generator(state):
                meta.materialize(model, state.device, options.init_fn, ties)
        now = {id(p) for p in model.parameters()}
        meta.watch_optimizers([p for p in before if id(p) not in now])
        return fsdp_wrapper.FSDP(model)

    def mesh(self, state: Any, options: Any) -> tuple[int, ...]:
        """The device mesh's shape: one dimension, every rank shares the shards (hsdp: replicas x shard)."""
        return (state.world_size,)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        from ddpkit.strategies import fsdp_wrapper

        return fsdp_wrapper.no_sync(model)

    def compile(self, model: nn.Module, options: dict[str, Any]) -> None:
        """Each sharded block on its own (torch's advice for FSDP2: all-gathers stay outside the graphs); the
        root only when it is the one group."""
        from torch.distributed.fsdp import FSDPModule

        from ddpkit.strategies.forwarding import unwrap

        root = unwrap(model)
        blocks: list[nn.Module] = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]
        for block in blocks or [root]:
            block.compile(**options)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        raise ValueError(f"ddpkit.join cannot run in {self.name} mode (every forward gathers parameters from all "
                         "ranks, so a rank that finished early would hang the others); use "
                         "data_loader(..., uneven='pad') or 'drop'")

    def state_bytes(self, params: int, largest_block: int, world_size: int, slots: int) -> int:
        # this rank's shards, plus one block gathered whole with its unsharded gradient during backward
        return -(-params // world_size) * (2 + slots) + 2 * largest_block

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        return model.state_dict()  # ddpkit's FSDP wrapper gathers the full tensors (collective)
