"""A DataLoader that shards the dataset across ranks and reshuffles every epoch by itself.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=32)              # 32 per process in DDP
    test_loader = ddpkit.data_loader(test_set, 256, train=False)       # exact: no padded duplicates
    for epoch in range(10):
        for x, y in loader:                                            # each pass: the next epoch's order
            ...

The global order of an epoch is one seeded permutation of the whole dataset, the same for every world
size; rank r takes every world_size-th index of it from position r. So one process with batch ``B * N``
sees the same global batches as N processes with batch ``B`` each.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpkit import faults, runtime, strategy
from ddpkit.environment import usable_cores
from ddpkit.loader_settings import cores_per_process, loader_defaults
from ddpkit.options import Uneven, check
from ddpkit.samplers import EpochSampler, SamplerShard, ShardSampler, epoch_number, too_few, user_sampler

__all__ = ["ShardSampler", "ShardedDataLoader", "data_loader", "epoch_number", "join"]


class ShardedDataLoader(DataLoader):
    """A ``torch.utils.data.DataLoader`` that counts epochs: each pass takes the next epoch's order.

    A pass is the epoch's once it has handed out a batch: one that runs to its end, one left early
    (``break`` after a fixed number of steps) and one whose iterator is kept unfinished all move the loader
    to the next epoch, from its beginning; an ``iter()`` that hands out nothing moves nothing. ``epoch`` is
    the epoch of the current pass, or of the next one between passes; loop over ``range(loader.epoch,
    epochs)`` and a resumed run continues where it stopped. The script's own :meth:`set_epoch` (or
    ``loader.sampler.set_epoch``) wins. :meth:`state_dict` holds the epoch and the global position in it
    (world-size free), so a resume on another number of processes continues the same global order.
    ``max_steps`` (set by ``ddpkit verify`` and ``bench``) ends iteration after that many batches in total.

    Example (fixed steps per epoch)::

        for epoch in range(loader.epoch, epochs):
            for i, (x, y) in enumerate(loader):
                ...
                if i == steps_per_epoch - 1:
                    break                      # the next pass is epoch + 1's order
    """

    def __init__(self, *args: Any, join: bool = False, max_steps: int | None = None,
                 equal_steps: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epoch = 0
        self.join = join
        self.equal_steps = equal_steps  # pass length of every rank: shorter ranks end with empty batches
        self.max_steps = max_steps
        self.steps_taken = 0
        self._start = 0  # global position the current / next pass starts from
        self._batches: int | None = None  # batches handed out in the open pass; None between passes
        self._requested: int | None = None  # set_epoch during a pass: the next pass's epoch
        self._passes = 0  # numbers the passes: an old pass closed late must leave the current one alone
        self._generator_state: torch.Tensor | None = None  # generator state at the start of the current pass
        self.step_times: list[float] | None = None  # hand-out times of the batches, for `ddpkit bench`
        self._shard_sampler().on_set_epoch = weakref.WeakMethod(self._take_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` (``loader.sampler.set_epoch(epoch)`` does the same).

        Between passes it applies at once (``loader.epoch`` reads it); during a pass, to the next pass. The
        epoch a checkpoint was restored in keeps its position, so a script that names its epochs resumes
        mid-epoch as well, and a checkpoint saved on the step that leaves an epoch resumes in the next::

            for epoch in range(step // steps_per_epoch, epochs):
                loader.set_epoch(epoch)
                for x, y in loader: ...        # `break` after steps_per_epoch steps
        """
        self._shard_sampler().set_epoch(epoch)

    def _take_epoch(self, epoch: int) -> None:
        if self._batches is not None:  # the open pass keeps its epoch (and its checkpoint position)
            self._requested = epoch
            return
        if epoch != self.epoch:  # a restored position belongs to its own epoch only
            self._start = 0
        self.epoch = self._shard_sampler().epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: position counts global samples of ``epoch`` already consumed."""
        world = self._shard_sampler().world_size
        taken = 0 if self._batches is None else self._batches * (self.batch_size or 1) * world
        return {"epoch": self.epoch, "position": self._start + taken}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._start = int(state["epoch"]), int(state["position"])
        self._batches = self._requested = None
        self._passes += 1  # a pass open before the restore is not the restored one

    def generator_state(self) -> torch.Tensor | None:
        """This rank's worker-seed generator as it was when the current pass began (for checkpoints)."""
        if self.generator is None:
            return None
        return self._generator_state if self._batches is not None else self.generator.get_state()

    def __iter__(self):
        if self.join and not _joining:
            raise RuntimeError("uneven='join' gives ranks different numbers of batches; run the loop inside "
                               "`with ddpkit.join(model):` or use uneven='pad' / 'drop'")
        self._close_pass(finished=False)  # a pass still open: its iterator was kept, never finished
        sampler = self._shard_sampler()
        sampler.epoch, sampler.start = self.epoch, self._start  # not set_epoch: that is the script's call
        self._batches, self._passes = 0, self._passes + 1
        if self.generator is not None:
            self._generator_state = self.generator.get_state()
        return self._counted(super().__iter__(), self._passes)

    def _close_pass(self, finished: bool) -> None:
        """End the open pass: one that ran to its end or handed out a batch was its epoch's."""
        if self._batches is None:
            return
        if finished or self._batches:
            self.epoch, self._start = self.epoch + 1, 0
        self._batches = None
        if self._requested is not None:
            epoch, self._requested = self._requested, None
            self._take_epoch(epoch)

    def _shard_sampler(self) -> EpochSampler:
        assert isinstance(self.sampler, EpochSampler), "ShardedDataLoader is built by ddpkit.data_loader"
        return self.sampler

    def _counted(self, batches: Any, number: int) -> Iterator[Any]:
        if self.equal_steps is not None:
            batches = _padded_with_empty(batches, self.equal_steps)
        finished = False
        try:
            for batch in batches:
                if self.max_steps is not None and self.steps_taken >= self.max_steps:
                    return
                self.steps_taken += 1
                if number == self._passes:  # counted when handed out (a checkpoint in the loop body includes
                    self._batches = (self._batches or 0) + 1  # it), by the current pass only: not an older one
                faults.heartbeat()
                if self.step_times is not None:
                    self.step_times.append(time.perf_counter())
                yield batch
            finished = True
        finally:  # at the end, and at a `break` (CPython closes the iterator as the loop is left)
            if number == self._passes:
                self._close_pass(finished)


def empty_batch(batch: Any) -> Any:
    """A batch of 0 samples shaped like ``batch`` (tensors sliced to ``[:0]``, per-sample lists emptied).

    >>> empty_batch([torch.ones(3, 2), {"id": torch.arange(3), "name": ["a", "b", "c"]}])
    [tensor([], size=(0, 2)), {'id': tensor([], dtype=torch.int64), 'name': []}]
    """
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)((k, empty_batch(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        if not any(isinstance(item, (torch.Tensor, dict, list, tuple)) for item in batch):
            return type(batch)() if not hasattr(batch, "_fields") else batch  # per-sample values: none left
        items = [empty_batch(item) for item in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _padded_with_empty(batches: Any, total: int) -> Iterator[Any]:
    """``batches``, then empty batches up to ``total``: every rank runs the same number of forwards."""
    count, last = 0, None
    for last in batches:
        count += 1
        yield last
    for _ in range(total - count):
        yield empty_batch(last)


_joining = False


@contextlib.contextmanager
def join(model: torch.nn.Module):
    """Let ranks run different numbers of training steps without a hang (torch's ``Join`` for DDP).

    Ranks that run out of batches shadow the others' all-reduces until every rank is done. Does not work
    with SyncBatchNorm (its collectives run in forward): pass ``sync_batchnorm=False`` or use ``uneven='pad'``.
    Outside DDP it does nothing.

    Example::

        loader = ddpkit.data_loader(train_set, 32, uneven="join")
        with ddpkit.join(model):
            for x, y in loader: ...
    """
    global _joining
    context = strategy.get(runtime.ensure_init().mode).join(model)
    _joining = True
    try:
        with context:
            yield
    finally:
        _joining = False


def data_loader(dataset: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                train: bool = True, shuffle: bool | None = None, uneven: Uneven | None = None, seed: int = 0,
                shuffle_buffer: int = 1000, **loader_kwargs: Any) -> Any:
    """Build a loader over this rank's shard of ``dataset``.

    ``batch_size`` is **per process** in DDP (global batch = batch_size x world size) and **global** in
    DP and single mode (DataParallel splits each batch across the GPUs). Or give ``global_batch_size``: it
    must divide by the world size, and each process takes its share. The global batch is printed once.

    ``train=True``: shuffled (seed ``seed`` + epoch) and ``uneven`` decides the tail: ``pad`` (default;
    repeats a few samples so every rank takes the same steps), ``drop``, or ``join`` (no repeats, unequal
    steps; wrap the loop in :func:`join`). ``train=False`` (evaluation): dataset order, no padding, so
    metrics reduced with :func:`ddpkit.reduce` / :func:`ddpkit.gather` count every sample exactly once. In
    fsdp mode (every forward gathers parameters from all ranks) a rank with fewer samples ends its pass with
    empty batches (0 samples) so all ranks run the same forwards: sum per batch, not mean.

    Each rank's DataLoader workers get their own reproducible seeds (from ``seed`` and the rank). Other
    keyword arguments (``num_workers``, ``collate_fn``, ``drop_last``, ...) go to ``DataLoader``, but for
    ``sampler=``: a sampler of your own (weighted, with replacement) gives the order instead of the shuffle;
    its stream, seeded ``seed`` + epoch, is split across ranks by position (:class:`ddpkit.samplers.SamplerShard`,
    docs/samplers.md). ``batch_sampler=`` is refused.

    A ``torch.utils.data.IterableDataset`` (a stream) is split across ranks and loader workers so each sample
    is read by exactly one of them (:mod:`ddpkit.streams`); ``uneven`` is then ``drop`` (the default: every
    rank stops when the first runs dry, agreed each step) or ``join``, ``shuffle`` is a seeded shard order
    plus a buffer of ``shuffle_buffer`` samples, reseeded per epoch; ``train=False`` reads every sample once.
    A Hugging Face ``datasets`` stream is split by rank with its own ``split_dataset_by_node``.
    """
    state, tools = runtime.ensure_init(), runtime.tools()
    batch_size = _per_process_batch(batch_size, global_batch_size, state)
    if uneven is not None:
        check("uneven", uneven, Uneven)
    if isinstance(dataset, IterableDataset):
        return _stream_loader(dataset, batch_size, state, tools, train, shuffle, uneven or "drop", seed,
                              shuffle_buffer, loader_kwargs, given_globally=global_batch_size is not None)
    uneven = uneven or "pad"
    own = user_sampler(loader_kwargs.pop("sampler", None), loader_kwargs, shuffle)
    if own is not None and len(own) < state.world_size:  # type: ignore[arg-type]  # what the ranks share
        raise ValueError(too_few(own, len(own), state.world_size))  # type: ignore[arg-type]
    if len(dataset) < state.world_size:
        raise ValueError(f"dataset has {len(dataset)} samples but the job has {state.world_size} processes: "
                         "each rank needs at least one sample; use fewer processes or a larger dataset")
    shuffle = train if shuffle is None else shuffle
    sampler_uneven = "join"  # evaluation: no sample repeated or left out
    if train:
        batch_size = tools.train_batch(batch_size, global_batch_size is not None)  # verify: the global batch
        sampler_uneven = tools.uneven(uneven)
    sampler = ShardSampler(len(dataset), state.rank, state.world_size, shuffle, seed, sampler_uneven,
                           multiple=tools.drop_multiple) if own is None else \
        SamplerShard(own, state.rank, state.world_size, seed, sampler_uneven, multiple=tools.drop_multiple)
    cores = cores_per_process(usable_cores(), os.cpu_count() or 1, state.local_world_size)
    loader_kwargs = {**loader_defaults(dataset, state.device.type, cores, loader_kwargs.get("num_workers")),
                     **loader_kwargs}
    # Worker seeds derive from this generator: distinct per rank, identical across reruns.
    loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed * 1_000_003 + state.rank))
    # a mode whose forward is collective (fsdp gathers parameters) needs every rank to take every eval step
    equal = None
    if not train and strategy.get(state.mode).collective_forward:
        first = len(range(0, sampler.size, state.world_size))  # rank 0 has the most samples, so the most batches
        equal = first // batch_size if loader_kwargs.get("drop_last") else -(-first // batch_size)
    loader = ShardedDataLoader(dataset, batch_size=batch_size, sampler=sampler, join=train and uneven == "join",
                               equal_steps=equal, **loader_kwargs)
    if train:
        _announce(loader, state, tools, batch_size, len(loader))
    return loader


def _announce(loader: Any, state: runtime.State, tools: Any, batch_size: int, steps: int | None) -> None:
    """A training loader: hook the tools in, and say the global batch once."""
    mode = strategy.get(state.mode)
    global_batch = batch_size * mode.batch_share(state)
    tools.on_loader(loader, state.rank, lambda: {"global_batch": global_batch, "mode": state.mode,
                                                 "device": str(state.device)}, runtime.on_shutdown)
    if state.is_main:
        workers = f", {loader.num_workers} loader workers per process" if loader.num_workers else ""
        print(f"ddpkit: {mode.describe_batch(state, batch_size, steps)}{workers}", file=sys.stderr, flush=True)


def _stream_loader(dataset: IterableDataset, batch_size: int, state: runtime.State, tools: Any, train: bool,
                   shuffle: bool | None, uneven: str, seed: int, shuffle_buffer: int,
                   loader_kwargs: dict[str, Any], given_globally: bool = False) -> Any:
    """An IterableDataset: :mod:`ddpkit.streams` splits it across ranks and workers."""
    from ddpkit import streams

    if loader_kwargs.get("persistent_workers"):
        raise ValueError("persistent_workers=True would keep last epoch's stream position in the workers; "
                         "drop it for a stream")
    if state.device.type == "cuda":
        loader_kwargs.setdefault("pin_memory", True)
    if train:
        batch_size = tools.train_batch(batch_size, given_globally)
    loader = streams.stream_loader(dataset, batch_size, state, train=train, uneven=uneven,
                                   shuffle=train if shuffle is None else shuffle, seed=seed,
                                   shuffle_buffer=shuffle_buffer,
                                   collective_forward=strategy.get(state.mode).collective_forward, **loader_kwargs)
    if train:
        _announce(loader, state, tools, batch_size, None)
    return loader


def _per_process_batch(batch_size: int | None, global_batch_size: int | None, state: runtime.State) -> int:
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError("give exactly one of batch_size (per process) and global_batch_size, "
                         f"got {batch_size} and {global_batch_size}")
    if batch_size is not None:
        return batch_size
    assert global_batch_size is not None
    shares = strategy.get(state.mode).batch_share(state)
    if global_batch_size % shares:
        raise ValueError(f"global_batch_size={global_batch_size} does not divide by {shares} processes; pass a "
                         f"multiple of {shares} (e.g. {global_batch_size // shares * shares or shares}) or batch_size=")
    return global_batch_size // shares
