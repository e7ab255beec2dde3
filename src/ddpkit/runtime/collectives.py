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

from ddpkit.core.options import Op, check
from ddpkit.runtime import group as runtime
from ddpkit.runtime import phases

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# every dtype torch has, in a fixed order: a dtype travels as its index here
_DTYPES = list(dict.fromkeys(sorted((v for v in vars(torch).values() if isinstance(v, torch.dtype)), key=str)))
_DIMS = 8  # shape entries the first header carries (a rank with more dims: every dim gathered after)


def _as_tensor(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    # float64 so integer counts up to 2**53 and float sums reduce without extra rounding
    return torch.tensor(value, dtype=torch.float64, device=device)


def _headers(tensor: torch.Tensor, world_size: int) -> list[list[int]]:
    """Every rank's [dtype, ndim, numel, *shape] (one all-gather; a second one, of every dim, when a rank has
    more than 8): gloo reduces mismatched buffers into garbage on one rank and aborts the other, so the ranks
    compare them first. Each row's shape is padded with -1 to the most dims any rank has."""
    def gathered(values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64, device=tensor.device)
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine)
        return [row.tolist() for row in rows]

    def padded(shape: list[int], dims: int) -> list[int]:
        return shape[:dims] + [-1] * (dims - min(len(shape), dims))

    shape = list(tensor.shape)
    headers = gathered([_DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel(), *padded(shape, _DIMS)])
    most = max(h[1] for h in headers)  # every rank sees every ndim: all take the second gather, or none
    if most > _DIMS:
        shapes = gathered(padded(shape, most))
        headers = [h[:3] + s for h, s in zip(headers, shapes)]
    return headers


def _describe(header: list[int]) -> str:
    dims = header[3:3 + header[1]]
    return f"{str(_DTYPES[header[0]]).removeprefix('torch.')} {dims}"


def _same_everywhere(where: str, headers: list[list[int]], rows_may_differ: bool, fix: str) -> None:
    """Raise on every rank (each sees every header) when the ranks' tensors cannot be combined."""
    def key(h: list[int]) -> list[int]:
        return [h[0], h[1], *h[4:]] if rows_may_differ else h

    if any(key(h) != key(headers[0]) for h in headers):
        seen = ", ".join(f"rank {r}: {_describe(h)}" for r, h in enumerate(headers))
        raise ValueError(f"{where}: the ranks passed different tensors ({seen}); {fix}")


def _all_reduce(value, op: str):
    state = runtime.ensure_init()
    if state.world_size == 1:
        return bool(value) if isinstance(value, bool) and op != "sum" else value
    tensor = _as_tensor(value, state.device).clone()
    _same_everywhere("ddpkit.reduce", _headers(tensor, state.world_size), False,
                     "pass the same dtype and shape on every rank (a number everywhere, or e.g. .float() on each)")
    dist.all_reduce(tensor, op=_OPS[op])
    if isinstance(value, torch.Tensor):
        return tensor.to(value.device)
    if isinstance(value, bool) and op != "sum":  # max/min of flags is a flag; their sum counts them
        return bool(tensor.item())
    return int(tensor.item()) if isinstance(value, int) else tensor.item()


@phases.waits
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


@phases.waits
def gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's rows (dim 0) in dataset order.

    Rank r holds positions r, r + W, r + 2W, ... of a ``train=False`` loader (counts may differ by one);
    the result interleaves them back, so row i is dataset sample i. Works on any dtype and trailing shape
    (the same on every rank); a 0-d tensor is one row (every rank's value, in rank order).

    >>> gather(torch.tensor(0.5))      # one process: one row
    tensor([0.5000])
    """
    state = runtime.ensure_init()
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if state.world_size == 1:
        return rows
    local = rows.detach().to(state.device)
    headers = _headers(local, state.world_size)
    _same_everywhere("ddpkit.gather", headers, True,
                     "rows may differ in number, not in dtype or trailing shape: pass the same on every rank")
    sizes = [h[3] for h in headers]
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
