"""Reductions for metrics: sums, sample-weighted means, max/min, and an order-restoring gather.

With one process each is the identity, so evaluation code is the same in every mode. Call them after the
evaluation loop, on every rank (they are collectives, and with ``train=False`` loaders ranks may run
different numbers of batches).

Example::

    correct = total = 0
    for x, y in test_loader:                          # ddpkit.data_loader(test_set, 256, train=False)
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    accuracy = ddpkit.reduce(correct) / ddpkit.reduce(total)   # sum/count, never a mean of means
    mean_loss = ddpkit.reduce(loss_sum, "mean", count=total)   # sample-weighted: global sum / global count
    train_loss = ddpkit.reduce(loss.item(), "mean")              # plain mean over ranks
"""

from __future__ import annotations

from numbers import Number

import torch
import torch.distributed as dist

from ddpkit import runtime
from ddpkit.options import Op, check

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _as_tensor(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    # float64 so integer counts up to 2**53 and float sums reduce without extra rounding
    return torch.tensor(value, dtype=torch.float64, device=device)


def _all_reduce(value, op: str):
    state = runtime.ensure_init()
    if state.world_size == 1:
        return value
    tensor = _as_tensor(value, state.device).clone()
    dist.all_reduce(tensor, op=_OPS[op])
    if isinstance(value, torch.Tensor):
        return tensor.to(value.device)
    return int(tensor.item()) if isinstance(value, int) else tensor.item()


def reduce(value, op: Op = "sum", *, count: Number | torch.Tensor | None = None):
    """Combine a number or tensor across ranks. ``op``: ``sum``, ``mean``, ``max`` or ``min``.

    ``mean`` without ``count`` is the plain mean over ranks (torch's ``ReduceOp.AVG``): right for values every
    rank computed over the same number of samples, such as a training loss. ``mean`` with ``count`` takes
    ``value`` as this rank's **sum** over ``count`` samples and returns global sum / global count: the mean over
    every sample, whatever each rank held (evaluation with ``train=False`` loaders). Numbers come back as
    numbers (``int`` stays ``int`` for ``sum``/``max``/``min``), tensors as tensors on their device.

    >>> reduce(3), reduce(2.5, "mean"), reduce(2.5, "mean", count=5)   # one process: the identity
    (3, 2.5, 0.5)
    """
    if check("op", op, Op) == "mean":
        if count is None:
            return _all_reduce(value, "sum") / runtime.ensure_init().world_size
        return _all_reduce(value, "sum") / _all_reduce(count, "sum")
    return _all_reduce(value, op)


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows (dim 0) in dataset order.

    Rank r holds positions r, r + W, r + 2W, ... of a ``train=False`` loader (counts may differ by one);
    the result interleaves them back, so row i is dataset sample i. Works on any dtype and trailing shape.
    """
    state = runtime.ensure_init()
    if state.world_size == 1:
        return tensor
    local = tensor.detach().to(state.device)
    counts = [torch.zeros(1, dtype=torch.int64, device=state.device) for _ in range(state.world_size)]
    dist.all_gather(counts, torch.tensor([local.shape[0]], device=state.device))
    sizes = [int(c.item()) for c in counts]
    longest = max(sizes)
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    stacked = torch.stack(parts, dim=1).reshape(longest * state.world_size, *local.shape[1:])
    # Row k*W + r of `stacked` is rank r's k-th row; keep only the rows that exist.
    keep = torch.tensor([k < sizes[r] for k in range(longest) for r in range(state.world_size)],
                        device=stacked.device)
    return stacked[keep].to(tensor.device)
