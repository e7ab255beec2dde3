"""Streaming (iterable) datasets: each sample read by exactly one (rank, DataLoader worker), the same number
of steps on every rank, seeded shuffling, exact evaluation, and resume in the middle of a stream.

Example::

    loader = ddpkit.data_loader(stream, batch_size=32)        # any torch IterableDataset, unchanged
    for epoch in range(loader.epoch, 3):
        for x, y in loader: ...                               # every rank takes the same number of steps

How a stream is split. The (rank, worker) pairs are *slots*: ``slot = rank * workers + worker`` out of
``world_size * workers``. A dataset that exposes shards (``n_shards`` and ``shard(num_shards=, index=)``)
gives whole shards to slots (shard i to slot i % slots, in a seeded order per epoch when shuffling), so no
worker decodes what it drops. Any other stream is split round robin: slot s keeps samples s, s + slots, ...
of the stream, so every worker reads the whole stream and keeps its share (exact; reading costs what it costs).

Batches are formed inside the workers and carry how many samples of its slot each worker has consumed;
that count, per slot, is the stream position a checkpoint keeps (not the data), with the *turn*: which of
the rank's workers hands out the next batch. torch's DataLoader takes the workers' batches in turn, always
from its worker 0 first; so a restored pass rotates the slots (torch's worker i reads the slot of worker
``(i + turn) % workers``) and replays each slot up to its count without training on it: the run continues
with the next unseen batch, in the order of an uninterrupted run, after an odd number of batches as well.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ddpkit import faults


class _Slots(IterableDataset):
    """The user's stream, cut to this (rank, worker) slot, shuffled, skipped and batched in the worker."""

    def __init__(self, dataset: Any, rank: int, world_size: int, batch_size: int, collate: Callable[[list], Any],
                 shuffle: bool, seed: int, buffer: int, drop_last: bool):
        self.dataset, self.rank, self.world_size, self.batch_size = dataset, rank, world_size, batch_size
        self.collate, self.shuffle, self.seed, self.buffer, self.drop_last = collate, shuffle, seed, buffer, drop_last
        self.epoch = 0
        self.skip: dict[int, int] = {}  # slot -> samples of it already consumed (a restored position)
        self.turn = 0  # the worker whose batch comes next: torch starts with its worker 0, which reads that one

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker, workers = ((info.id + self.turn) % info.num_workers, info.num_workers) if info else (0, 1)
        if info is not None and worker != info.id and is_hf(self.dataset):
            _as_worker(info, worker)  # a Hugging Face stream picks its worker's shards by get_worker_info()
        return self._batches(self.rank * workers + worker, self.world_size * workers)

    def _batches(self, slot: int, slots: int) -> Iterator[tuple[int, int, Any]]:
        samples = self._samples(slot, slots)
        if self.shuffle and self.buffer > 1:
            samples = shuffled(samples, self.buffer, random.Random(f"{self.seed}-{self.epoch}-{slot}"))
        skip, consumed, batch = self.skip.get(slot, 0), 0, []
        for sample in samples:
            consumed += 1
            if consumed <= skip:  # seen before the checkpoint: replayed, not trained on
                continue
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield slot, consumed, self.collate(batch)
                batch = []
        if batch and not self.drop_last:
            yield slot, consumed, self.collate(batch)

    def _samples(self, slot: int, slots: int) -> Iterator[Any]:
        if is_hf(self.dataset):  # split by rank already (split_dataset_by_node); it splits by worker itself
            yield from self.dataset
            return
        if has_shards(self.dataset):
            order = list(range(self.dataset.n_shards))
            if self.shuffle:
                random.Random(f"{self.seed}-{self.epoch}-shards").shuffle(order)
            for index in order[slot::slots]:
                yield from self.dataset.shard(num_shards=self.dataset.n_shards, index=index)
            return
        for position, sample in enumerate(self.dataset):
            if position % slots == slot:
                yield sample


def _as_worker(info: Any, worker: int) -> None:
    """Make ``get_worker_info()`` in this worker process say ``worker`` (torch keeps it in a module global)."""
    from torch.utils.data._utils import worker as torch_worker

    torch_worker._worker_info = type(info)(id=worker, num_workers=info.num_workers, seed=info.seed,
                                           dataset=info.dataset)


def is_hf(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset``: it hands its shards to DataLoader workers by itself."""
    return type(dataset).__module__.startswith("datasets.") and type(dataset).__name__ == "IterableDataset"


def has_shards(dataset: Any) -> bool:
    return isinstance(getattr(dataset, "n_shards", None), int) and callable(getattr(dataset, "shard", None))


def shuffled(samples: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A bounded shuffle: fill a buffer of ``size``, then emit a random element and put the next one in its place.

    >>> list(shuffled(iter(range(5)), 1, random.Random(0)))
    [0, 1, 2, 3, 4]
    >>> sorted(shuffled(iter(range(10)), 4, random.Random(0))) == list(range(10))
    True
    """
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        index = rng.randrange(size)
        buffer[index], sample = sample, buffer[index]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


class StreamLoader(DataLoader):
    """A DataLoader over this rank's share of a stream (built by :func:`ddpkit.data_loader`).

    ``agree``: ``"drop"`` ends the pass on every rank at the step where the first rank runs dry (one small
    all-reduce per step); ``"empty"`` lets ranks that ran dry hand out empty batches until every rank has
    (modes whose forward is collective, in evaluation); None: ranks end on their own (evaluation, join).
    """

    def __init__(self, slots: _Slots, agree: str | None, group_size: int, **kwargs: Any):
        super().__init__(slots, batch_size=None, **kwargs)
        self.slots, self.agree, self.group_size = slots, agree, group_size
        self.epoch = 0
        self.max_steps: int | None = None  # ddpkit verify / bench
        self.steps_taken = 0
        self.step_times: list[float] | None = None
        self._consumed: dict[int, int] = {}  # slot -> samples consumed in the current / next pass
        self._turn = 0  # this rank's worker whose batch is next (a pass left early continues with it)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._consumed, self._turn = epoch, {}, 0

    def _workers(self) -> int:
        return max(1, self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "world_size", "workers", "consumed", "turns"}``: every slot's position and every rank's
        next worker. Collective with several processes (call it on every rank, as :class:`ddpkit.Checkpointer`
        does)."""
        workers = self._workers()
        mine = torch.tensor([*(self._consumed.get(self.slots.rank * workers + w, 0) for w in range(workers)),
                             self._turn])
        rows = [mine]
        if self.group_size > 1:
            rows = [torch.empty_like(mine) for _ in range(self.group_size)]
            dist.all_gather(rows, mine)
        return {"epoch": self.epoch, "world_size": self.group_size, "workers": workers,
                "consumed": [n for row in rows for n in row[:-1].tolist()], "turns": [int(row[-1]) for row in rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["world_size"], state["workers"]) != (self.group_size, self._workers()):
            raise ValueError(f"this stream position was saved by {state['world_size']} process(es) x "
                             f"{state['workers']} loader worker(s), and each (rank, worker) reads its own part of "
                             f"the stream; resume with the same --nproc-per-node and num_workers, or restore "
                             f"without the loader to start epoch {state['epoch']} over")
        self.epoch = int(state["epoch"])
        self._consumed = {slot: int(n) for slot, n in enumerate(state["consumed"]) if n}
        # saved before turns were kept: worker 0 (right after an even number of batches with 2 workers)
        self._turn = int(state.get("turns", [0] * self.group_size)[self.slots.rank])

    def __iter__(self):  # a generator of batches (DataLoader.__iter__ returns a _BaseDataLoaderIter)
        self.slots.epoch, self.slots.skip, self.slots.turn = self.epoch, dict(self._consumed), self._turn
        return self._passing(super().__iter__())

    def _passing(self, batches: Any) -> Iterator[Any]:
        try:
            yield from self._steps(batches)
        finally:  # a pass that stops early leaves workers mid-stream: stop them now, not whenever GC runs
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _steps(self, batches: Iterator[tuple[int, int, Any]]) -> Iterator[Any]:
        """One batch ahead: the agreement on the next batch runs (asynchronously) during the step on this one."""
        last: Any = None
        item = next(batches, None)
        pending = self._agree_on(item)
        while self.max_steps is None or self.steps_taken < self.max_steps:
            if not self._agreed(pending, item):
                break
            current = item
            item = next(batches, None) if current is not None else None
            pending = self._agree_on(item)
            if current is None:  # "empty": other ranks still have data, and their forward needs this rank
                from ddpkit.data import empty_batch

                yield empty_batch(last)
                continue
            slot, consumed, last = current
            self._consumed[slot] = consumed
            self._turn = (slot % self._workers() + 1) % self._workers()  # slot = rank * workers + worker
            self.steps_taken += 1
            faults.heartbeat()
            if self.step_times is not None:
                self.step_times.append(time.perf_counter())
            yield last
        if pending is not None:  # every rank launched it: finish it before the next collective
            pending[0].wait()
        self.epoch, self._consumed, self._turn = self.epoch + 1, {}, 0

    def _agree_on(self, item: Any) -> tuple[Any, torch.Tensor] | None:
        """Start the all-reduce of "I have a batch" (MIN: all have one; MAX: any has one), or None."""
        if not self.agree or self.group_size == 1:
            return None
        flag = torch.tensor([int(item is not None)])
        op = dist.ReduceOp.MIN if self.agree == "drop" else dist.ReduceOp.MAX
        # on the default group, ahead of the step's own collectives (a group of its own measured slower on 2 cores)
        return dist.all_reduce(flag, op=op, async_op=True), flag

    @staticmethod
    def _agreed(pending: tuple[Any, torch.Tensor] | None, item: Any) -> bool:
        if pending is None:
            return item is not None
        work, flag = pending
        work.wait()
        return bool(flag.item())


def stream_loader(dataset: IterableDataset, batch_size: int, state: Any, *, train: bool, uneven: str,
                  shuffle: bool, seed: int, shuffle_buffer: int, collective_forward: bool,
                  **loader_kwargs: Any) -> StreamLoader:
    """The loader :func:`ddpkit.data_loader` builds for an ``IterableDataset``."""
    if uneven == "pad":
        raise ValueError("uneven='pad' needs the dataset's length, which a stream does not have; streams take "
                         "'drop' (the default: every rank stops when the first runs dry) or 'join'")
    collate = loader_kwargs.pop("collate_fn", None) or default_collate
    drop_last = bool(loader_kwargs.pop("drop_last", False))
    for ignored in ("sampler", "batch_sampler", "shuffle"):
        if loader_kwargs.pop(ignored, None) is not None:
            raise ValueError(f"{ignored}= does not apply to a stream (it has no indices); ddpkit splits it across "
                             "ranks and workers itself; use shuffle=True / shuffle_buffer= for order")
    if is_hf(dataset):  # the library's own rank split (whole shards when they divide, else every world_size-th)
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(dataset, rank=state.rank, world_size=state.world_size)
    slots = _Slots(dataset, state.rank, state.world_size, batch_size, collate, shuffle, seed, shuffle_buffer,
                   drop_last)
    agree = ("drop" if uneven == "drop" else None) if train else ("empty" if collective_forward else None)
    return StreamLoader(slots, agree, state.world_size, **loader_kwargs)
