"""A model none of whose parameters trains, prepared in ddp: a BYOL or mean-teacher target network that follows
the trained one by a moving average, a frozen teacher. torch's DDP refuses it ("DistributedDataParallel is not
needed when a module doesn't have any parameter that requires a gradient"): there is no gradient to average. What
it still needs at N processes is what DDP would have given it: the same weights on every rank (rank 0's,
broadcast here, as DDP broadcasts at its wrap) and, run in train mode, BatchNorm over the global batch (a target
that normalised each rank's share by itself would give every rank other targets than one process gets).

Example::

    target = ddpkit.prepare_model(make_net().requires_grad_(False))   # not wrapped: synced BatchNorm, rank 0's weights
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# the modules prepared here, still alive: the first step's check of BatchNorm outside prepared models counts them in
PREPARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def frozen(model: nn.Module) -> bool:
    """The model has parameters and none requires a gradient."""
    params = list(model.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def prepare_frozen(model: nn.Module, state: Any, sync_batchnorm: bool) -> nn.Module:
    """``model``, on the device already: BatchNorm synchronised (unless ``sync_batchnorm=False``), parameters and
    buffers broadcast from rank 0, not wrapped. Said once."""
    from ddpkit.strategies.syncbn import sync_batchnorms

    if sync_batchnorm:
        model = sync_batchnorms(model, state)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device == state.device:
                    dist.broadcast(tensor.data, src=0)  # (a planning run's fake tensors are not broadcast)
    PREPARED.add(model)
    if state.is_main:
        print(f"ddpkit: {type(model).__name__} trains no parameter (none requires grad): not wrapped in DDP; its "
              "weights are rank 0's on every rank" + (", its BatchNorm over the global batch" if sync_batchnorm
                                                       else ""), file=sys.stderr, flush=True)
    return model
