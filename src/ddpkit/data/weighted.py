"""A plain training loop whose loss is a mean over a number of items that varies from batch to batch (the tokens
not labelled ``-100``): ``ddpkit.data_loader(..., batch_count=fn)`` weighs each rank's gradient by its share of
the batch's items over all ranks, so the loop stays as the script wrote it.

At N processes each rank's loss is the mean over its own tokens, and DDP averages the ranks' gradients alike:
a rank with few tokens weighs as much as one with many, another loss than one process's mean over the global
batch. Before a batch is handed out, ``fn(batch)`` counts this rank's items n and one all-reduce of one number
gives the batch's count T over all ranks; each gradient of the prepared model's parameters is multiplied by
``n * N / T`` in the backward that follows (a tensor hook, before DDP's all-reduce), so DDP's mean of the ranks'
gradients is the gradient of the mean over all T items. A batch with nothing counted (every label -100, whose
mean is torch's 0/0 NaN) adds a zero gradient.

Example::

    loader = ddpkit.data_loader(train_set, global_batch_size=16, shuffle=True,
                                batch_count=lambda batch: (batch["labels"] != -100).sum())
    for batch in loader:
        loss = model(**batch).loss          # a Hugging Face model: the mean over this rank's labelled tokens
        loss.backward()                     # weighed by this rank's share of the batch's tokens
        optimizer.step()
        optimizer.zero_grad()

In ddp only (fsdp reduces shards, out of a tensor hook's reach: use ``count=`` with ``step.backward``); one
process weighs nothing. The scale holds from the batch's hand-out to the next one, or the pass's end: a
backward of another loader's batch in between is weighed too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.data.steps import checked_count
from ddpkit.strategies import ddp_wrapper
from ddpkit.strategies.syncbn import SyncBatchNorm

__all__ = ["BatchWeights"]

# the scale of the batch handed out last (None: no counted batch is open); one per process, as the backward
# that reads it is
_SCALE: list[float | None] = [None]
# the parameters that carry the hook, by id (a tensor compares by value: no set of them), each once however many
# wrappers a module was prepared in
_HOOKED: dict[int, weakref.ref[torch.Tensor]] = {}
# the modules whose outputs carry it instead (a model with synchronised BatchNorm), by id, each once
_OUTPUTS: dict[int, weakref.ref[torch.nn.Module]] = {}


class BatchWeights:
    """What a training loader with ``batch_count=`` does with each batch it hands out.

    >>> weights = BatchWeights(lambda batch: len(batch), world_size=1, device=torch.device("cpu"))
    >>> weights.weigh([1, 2, 3]), weights.count, weights.global_count
    (1.0, 3.0, 3.0)
    """

    def __init__(self, count: Callable[[Any], Any], world_size: int, device: torch.device):
        self.fn, self.world_size, self.device = count, world_size, device
        self.count = self.global_count = 0.0  # the last batch's items: this rank's, all ranks'

    def weigh(self, batch: Any) -> float:
        """Count ``batch``, agree the total with the other ranks (every rank hands out a batch here: a training
        loader pads its ranks to equal steps) and set the scale of the backward that follows."""
        self.count = total = checked_count(self.fn(batch))
        if self.world_size > 1:
            summed = torch.tensor([total], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed)
            total = summed.item()
            _hook_models()
        self.global_count = total
        scale = self.count * self.world_size / total if total else 0.0
        _SCALE[0] = scale if self.world_size > 1 else None
        return scale

    @staticmethod
    def close() -> None:
        """The pass ended: no batch of it is open any more."""
        _SCALE[0] = None


def _hook_models() -> None:
    """Each trainable parameter of the prepared DDP models gets the hook once; looked over at every batch, so that
    a model prepared later and a layer unfrozen later (gradual unfreezing) get it too. A model with synchronised
    BatchNorm has its outputs' gradients scaled instead: that layer's backward all-reduces sums of the gradient
    reaching it, which must be weighed already (the layers below it parted from one process's; set 28)."""
    for model in ddp_wrapper.live_models():
        if _synced(model.module):
            known = _OUTPUTS.get(id(model.module))
            if known is None or known() is not model.module:
                _OUTPUTS[id(model.module)] = weakref.ref(model.module)
                model.module.register_forward_hook(_weigh_outputs)
            continue
        for param in model.module.parameters():
            if not param.requires_grad:
                continue
            held = _HOOKED.get(id(param))
            if held is not None and held() is param:
                continue
            _HOOKED[id(param)] = weakref.ref(param)
            param.register_hook(_scaled)


def _scaled(grad: torch.Tensor) -> torch.Tensor | None:
    scale = _SCALE[0]
    if scale is None:  # a backward outside a counted batch: as the script wrote it
        return None
    return torch.zeros_like(grad) if scale == 0 else grad * scale


def _synced(module: torch.nn.Module) -> bool:
    return any(isinstance(m, (SyncBatchNorm, torch.nn.SyncBatchNorm)) for m in module.modules())


def _weigh_outputs(_module: torch.nn.Module, _args: Any, output: Any) -> None:
    """Each output tensor that needs a gradient gets the scale of the batch on its gradient (a forward hook)."""
    stack, seen = [output], 0
    while stack and seen < 64:  # (a tensor, or tuples, lists and dicts of them: a Hugging Face model's output)
        item, seen = stack.pop(), seen + 1
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                item.register_hook(_scaled)
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())

