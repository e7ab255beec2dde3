"""A script's own ``worker_init_fn`` seeds its loader workers alike on every rank (``np.random.seed(42 +
worker_id)``): rank 1's worker 0 then draws what rank 0's worker 0 draws. Where the draws pick the samples (a
dataset that ignores its index and samples at random, a random crop position per slice) every rank trains on the
same ones, silently half the data at 2 processes; where they augment, the ranks' augmentations repeat each other.
torch's own worker seeds are this rank's (ddpkit's loader generator differs per rank); the script's override them.
So on ranks other than 0, after the script's function, the global generators it may have seeded (``random``,
numpy's, torch's) are reseeded from their own next draw mixed with the rank: still fixed by the script's seed at
any rerun, different per rank. Rank 0 keeps the script's seeds as they are.

Example::

    kwargs["worker_init_fn"] = RankedWorkerInit(script_fn, state.rank)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

SPREAD = 1_000_003  # a prime: rank r's seeds are r steps of it from rank 0's


class RankedWorkerInit:
    """``fn(worker_id)``, then (rank > 0) each global generator reseeded from its own draw and the rank. A class,
    not a closure: a worker started by spawn receives it pickled."""

    def __init__(self, fn: Callable[[int], Any], rank: int):
        self.fn, self.rank = fn, rank

    def __call__(self, worker_id: int) -> None:
        self.fn(worker_id)
        if self.rank == 0:
            return
        random.seed(random.getrandbits(32) + self.rank * SPREAD)
        torch.manual_seed(int(torch.randint(2**31, (1,)).item()) + self.rank * SPREAD)
        try:
            import numpy as np
        except ImportError:  # (no numpy: nothing of it was seeded)
            return
        np.random.seed((int(np.random.randint(2**31)) + self.rank * SPREAD) % 2**32)
