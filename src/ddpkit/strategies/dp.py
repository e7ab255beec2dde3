"""Mode ``dp``: one process drives every visible GPU through ``torch.nn.DataParallel`` (the wrapper class
is :class:`ddpkit.strategies.dp_wrapper.DP`).

Example::

    >>> DataParallelStrategy().min_gpus, DataParallelStrategy().cuda_rng_devices(0, 4)
    (2, [0, 1, 2, 3])

Torch-free at module level, like every table entry (``ddpkit launch`` reads the table before it loads
torch): the wrapper, a subclass of torch's, lives in ``dp_wrapper.py`` and is imported when a model is wrapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit.core.environment import visible_gpus
from ddpkit.strategies.base import Strategy, per_epoch

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn


class DataParallelStrategy(Strategy):
    """One process drives every visible GPU through ``torch.nn.DataParallel``; no options of its own."""

    name = "dp"
    title = "DataParallel"
    min_gpus = 2

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        from ddpkit.strategies.dp_wrapper import DP

        return DP(model)

    def describe_batch(self, state: Any, batch_size: int, steps: int | None) -> str:
        gpus = visible_gpus()
        return f"global batch {batch_size}, split by DataParallel across {gpus} GPUs, {per_epoch(steps)}"

    def cuda_rng_devices(self, current: int, count: int) -> list[int]:
        return list(range(count))  # dropout runs in a replica on every GPU
