"""A DataLoader that shards the dataset across ranks and reshuffles every epoch by itself.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=32)   # 32 per process in DDP
    for epoch in range(10):
        for x, y in loader:                                 # set_epoch is called for you
            ...

The global order of an epoch is one seeded permutation of the whole dataset, the same for every world
size; rank r takes every world_size-th index of it from position r (torch's DistributedSampler). So one
process with batch ``B * N`` sees the same global batches as N processes with batch ``B`` each.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpkit import runtime


class ShardedDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` whose sampler gets ``set_epoch(epoch)`` at the start of each pass.

    The epoch counts passes over the loader from 0; :meth:`set_epoch` moves it (e.g. after a resume).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return super().__iter__()


def data_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
                seed: int = 0, **loader_kwargs: Any) -> ShardedDataLoader:
    """Build a loader over this rank's shard of ``dataset``.

    ``batch_size`` is **per process** in DDP (global batch = batch_size x world size) and **global** in
    DP and single mode (DataParallel splits each batch across the GPUs). The global batch is printed once.
    ``shuffle`` uses a permutation seeded by ``seed`` and the epoch. With ``drop_last=False`` the sampler
    pads the last round with repeats from the start so every rank takes the same number of steps.
    Other keyword arguments (``num_workers``, ``collate_fn``, ...) go to ``DataLoader``.
    """
    state = runtime.current()
    if len(dataset) < state.world_size:
        raise ValueError(f"dataset has {len(dataset)} samples but the job has {state.world_size} processes: "
                         "each rank needs at least one sample; use fewer processes or a larger dataset")
    sampler = DistributedSampler(dataset, num_replicas=state.world_size, rank=state.rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    if state.device.type == "cuda":
        loader_kwargs.setdefault("pin_memory", True)
    loader = ShardedDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                               **loader_kwargs)
    if state.is_main:
        print(f"ddpkit: {describe_batch(state, batch_size, len(loader))}", file=sys.stderr, flush=True)
    return loader


def describe_batch(state: runtime.State, batch_size: int, steps: int) -> str:
    """One line about batch sizes, e.g. ``global batch 64 = 32 per process x 2 processes, 29 steps/epoch``."""
    if state.mode == "dp":
        gpus = torch.cuda.device_count()
        return f"global batch {batch_size}, split by DataParallel across {gpus} GPUs, {steps} steps/epoch"
    if state.mode == "ddp":
        return (f"global batch {batch_size * state.world_size} = {batch_size} per process x "
                f"{state.world_size} processes, {steps} steps/epoch")
    return f"global batch {batch_size} (one process), {steps} steps/epoch"
