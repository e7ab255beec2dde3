"""DataParallel's wrapper as mode ``dp`` puts it around the model (:class:`DP`), and the two fixes it
carries: balanced batch slices and the caller's autocast dtype in every replica.

Example::

    >>> from torch import nn
    >>> lin = nn.Linear(2, 2)
    >>> DP(lin).module is lin, list(DP(lin).state_dict())
    (True, ['weight', 'bias'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DataParallel
from torch.nn.parallel._functions import Scatter

from ddpkit.strategies.forwarding import PlainStateDict


def balanced_split(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` slices of a batch of ``total`` that differ by at most one.

    torch's ``chunk`` splits 29 samples over 8 GPUs as [4, 4, 4, 4, 4, 4, 4, 1]: a 1-sample replica, which
    BatchNorm refuses in training ("Expected more than 1 value per channel").

    >>> balanced_split(29, 8), balanced_split(3, 2)
    ([4, 4, 4, 4, 4, 3, 3, 3], [2, 1])
    """
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def in_caller_autocast(calls: Sequence[Any], device_type: str) -> list[Any]:
    """Wrap callables so that each runs under the *calling* thread's autocast dtype, in whatever thread.

    Autocast state is per thread. torch's ``parallel_apply`` re-enters autocast in each replica thread with
    ``enabled=`` only, so the replicas take the device's default dtype (fp16 on CUDA) even inside
    ``autocast("bf16")``: fp16 math with no GradScaler. Returns the callables unchanged outside autocast.
    """
    if not torch.is_autocast_enabled(device_type):
        return list(calls)
    dtype = torch.get_autocast_dtype(device_type)

    def bind(call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return call(*args, **kwargs)
        return run

    return [bind(call) for call in calls]


def _batch_size(obj: Any, dim: int) -> int | None:
    """Size along ``dim`` of the first tensor in a (nested) forward input."""
    if isinstance(obj, torch.Tensor):
        return obj.shape[dim] if obj.dim() > dim else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return next((size for item in items if (size := _batch_size(item, dim)) is not None), None)


def _scatter(obj: Any, devices: list[int], sizes: list[int], dim: int) -> list[Any]:
    """torch's scatter of a nested input, with the given chunk sizes for tensors of the batch's size."""
    if isinstance(obj, torch.Tensor):
        fits = obj.dim() > dim and obj.shape[dim] == sum(sizes)
        return list(Scatter.apply(devices, sizes if fits else None, dim, obj))
    if isinstance(obj, tuple) and obj:
        slices = zip(*(_scatter(o, devices, sizes, dim) for o in obj))
        return [type(obj)(*parts) if hasattr(obj, "_fields") else tuple(parts) for parts in slices]
    if isinstance(obj, list) and obj:
        return [list(parts) for parts in zip(*(_scatter(o, devices, sizes, dim) for o in obj))]
    if isinstance(obj, dict) and obj:
        columns = [_scatter(v, devices, sizes, dim) for v in obj.values()]
        return [type(obj)(zip(obj.keys(), parts)) for parts in zip(*columns)]
    return [obj for _ in devices]


class DP(PlainStateDict, DataParallel):
    """torch's DataParallel whose state dict is the plain module's, with two fixes.

    Each replica runs under the caller's autocast dtype (bf16 stays bf16), and batches are split into
    slices that differ by at most one sample; a training batch smaller than the GPU count is an error.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.start_forwarding()  # a method called this way runs on the GPU-0 module, without replicas

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        size = _batch_size((inputs, kwargs), self.dim)
        if size is None:
            return super().scatter(inputs, kwargs, device_ids)
        if self.training and size < len(device_ids):
            raise ValueError(f"a training batch of {size} sample(s) cannot be split over {len(device_ids)} GPUs "
                             "(DataParallel gives each at least one; BatchNorm needs two); use a batch of at "
                             f"least {2 * len(device_ids)}, or drop_last=True in the DataLoader")
        sizes = balanced_split(size, min(size, len(device_ids)))
        devices = [int(d) for d in device_ids[: len(sizes)]]
        scattered_inputs = _scatter(tuple(inputs), devices, sizes, self.dim) if inputs else [() for _ in devices]
        scattered_kwargs = _scatter(kwargs, devices, sizes, self.dim) if kwargs else [{} for _ in devices]
        return tuple(scattered_inputs), tuple(scattered_kwargs)

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return super().parallel_apply(in_caller_autocast(replicas, "cuda"), inputs, kwargs)

