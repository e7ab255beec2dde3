"""Streaming (iterable) datasets: each sample read by exactly one (rank, DataLoader worker), the same number
of steps on every rank, seeded shuffling, exact evaluation, and resume in the middle of a stream.

Example::

    loader = ddpkit.data_loader(stream, batch_size=32)        # any torch IterableDataset, unchanged
    for epoch in range(loader.epoch, 3):
        for x, y in loader: ...                               # every rank takes the same number of steps

How a stream is split. The (rank, worker) pairs are *slots*: ``slot = rank * workers + worker`` out of
``world_size * workers``. A dataset that exposes shards (``n_shards`` and ``shard(num_shards=, index=)``)
gives whole shards to slots, ranks first (shard i, in a seeded order per epoch when shuffling, to rank
i % world_size and that rank's worker (i // world_size) % workers), so no worker decodes what it drops and
every rank has a shard when there are at least as many shards as ranks. Any other stream, and one with fewer
shards than ranks (said once), is split round robin: slot s keeps samples s, s + slots, ... of the stream, so
every worker reads the whole stream and keeps its share (exact; reading costs what it costs).

Batches are formed inside the workers and carry how many samples of its slot each worker has consumed;
that count, per slot, is the stream position a checkpoint keeps (not the data), with the *turn*: which of
the rank's workers hands out the next batch. torch's DataLoader takes the workers' batches in turn, always
from its worker 0 first; so a restored pass rotates the slots (torch's worker i reads the slot of worker
``(i + turn) % workers``) and replays each slot up to its count without training on it: the run continues
with the next unseen batch, in the order of an uninterrupted run, after an odd number of batches as well.
"""

from __future__ import annotations

import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ddpkit.core import process
from ddpkit.data.loader import Observed, empty_batch
from ddpkit.data.pinning import pinned
from ddpkit.runtime import collectives, control, phases

# batches agreed on at once (a window): at most 16, about 64 MiB, and what a rank reads in half a second; a rank
# holds up to two (the next is read and offered while this one trains)
WINDOW_BATCHES, WINDOW_BYTES, WINDOW_SECONDS = 16, 64 << 20, 0.5


class _Batch(NamedTuple):
    """A batch formed in a worker, with its slot and how many of the slot's samples are consumed after it."""

    slot: int
    consumed: int
    data: Any

    def pin_memory(self) -> _Batch:
        """What the DataLoader's ``pin_memory=True`` calls: torch's pinning, except for tensors off the CPU (a
        stream may yield tensors already on the GPU; torch's own pinning raises on them)."""
        return _Batch(self.slot, self.consumed, pinned(self.data))


def next_window(size: int, read: int, waited: float, largest: int) -> int:
    """This rank's proposal for how many batches to hold ahead of the next agreement (the ranks take the MIN, in
    the agreement itself): twice the last window, so the first step waits for one batch, not 16; at most 16; at
    most 64 MiB of batches the size of the ``largest`` (bytes) just read; and no more than it reads in half a
    second, from ``read`` batches that kept it ``waited`` seconds (a peer waits in the agreement while it reads).

    >>> next_window(1, 1, 0.0, 100), next_window(16, 16, 0.0, 100), next_window(8, 8, 0.0, 32 << 20)
    (2, 16, 2)
    """
    by_bytes = WINDOW_BYTES // max(1, largest)
    by_time = int(WINDOW_SECONDS * read / waited) if read and waited > 0 else WINDOW_BATCHES  # none: ran dry
    return max(1, min(2 * size, WINDOW_BATCHES, by_bytes, by_time))


def _nbytes(data: Any) -> int:
    """About how much memory a batch takes: tensors and arrays by their data, other leaves (bytes, str) by
    ``sys.getsizeof``."""
    if isinstance(data, torch.Tensor):
        return data.element_size() * data.numel()
    if isinstance(getattr(data, "nbytes", None), int):  # a numpy array
        return int(data.nbytes)
    if isinstance(data, Mapping):
        return sum(_nbytes(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(_nbytes(v) for v in data)
    return sys.getsizeof(data)


class _Hand:
    """The batches a rank holds ahead of its training loop (about 64 MiB at most), and what reading them cost since
    the last agreement (for :func:`next_window`).

    How it tops up after a step (:meth:`top_up`) depends on who reads. Loader workers read in parallel with the
    training loop but only a few batches ahead (torch's prefetch): a whole window asked for at once waits for
    them to make it, so the hand grows by at most one batch a step towards two windows (2 ranks, 2 workers,
    0.02 s a sample and a step: 4.15 s an epoch where a window at once took 6.1 s). Without workers reading is
    this thread's own work either way, and the next window read at once ran 11 % faster than a batch a step
    (the stream bench, 2 processes).
    """

    def __init__(self, source: Iterator[_Batch], workers: int):
        self.source, self.ended, self.workers = source, False, workers
        self.batches: deque[tuple[_Batch, int]] = deque()
        self.held = self.read = self.largest = 0
        self.waited = 0.0

    def __len__(self) -> int:
        return len(self.batches)

    def top_up(self, size: int, agreed: int) -> None:
        """Read after a step; ``size``: the agreed window, ``agreed``: batches held that every rank agreed on."""
        if self.workers:
            self.fill(max(2 * size - 1, agreed + 1), agreed, most=2)
        else:
            self.fill(agreed + size, agreed)

    def fill(self, target: int, agreed: int = 0, most: int | None = None) -> None:
        """Read towards ``target`` batches held, at most ``most`` now and about 64 MiB, but always one beyond the
        ``agreed`` ones whatever they weigh (unless the stream ran dry): an offer of 0 ends the pass on every
        rank."""
        reads = 0
        while not self.ended and len(self.batches) < target and (len(self.batches) <= agreed or (
                self.held < WINDOW_BYTES and (most is None or reads < most))):
            start = time.perf_counter()
            item = next(self.source, None)
            self.waited += time.perf_counter() - start
            if item is None:
                self.ended = True
                return
            nbytes = _nbytes(item.data)
            self.batches.append((item, nbytes))
            self.held, self.read, self.largest = self.held + nbytes, self.read + 1, max(self.largest, nbytes)
            reads += 1

    def pop(self) -> _Batch | None:
        if not self.batches:
            return None
        item, nbytes = self.batches.popleft()
        self.held -= nbytes
        return item

    def proposal(self, size: int) -> int:
        proposed = next_window(size, self.read, self.waited, self.largest)
        self.read = self.largest = 0
        self.waited = 0.0
        return proposed


class _Slots(IterableDataset):
    """The user's stream, cut to this (rank, worker) slot, shuffled, skipped and batched in the worker."""

    def __init__(self, dataset: Any, rank: int, world_size: int, batch_size: int, collate: Callable[[list], Any],
                 shuffle: bool, seed: int, buffer: int, drop_last: bool):
        self.dataset, self.rank, self.world_size, self.batch_size = dataset, rank, world_size, batch_size
        self.collate, self.shuffle, self.seed, self.buffer, self.drop_last = collate, shuffle, seed, buffer, drop_last
        self.epoch = 0
        self.whole_shards = has_shards(dataset) and dataset.n_shards >= world_size  # else: round robin
        self.skip: dict[int, int] = {}  # slot -> samples of it already consumed (a restored position)
        self.turn = 0  # the worker whose batch comes next: torch starts with its worker 0, which reads that one

    def __iter__(self) -> Iterator[_Batch]:
        info = get_worker_info()
        worker, workers = ((info.id + self.turn) % info.num_workers, info.num_workers) if info else (0, 1)
        if info is not None and worker != info.id and is_hf(self.dataset):
            _as_worker(info, worker)  # a Hugging Face stream picks its worker's shards by get_worker_info()
        return self._batches(self.rank * workers + worker, self.world_size * workers)

    def _batches(self, slot: int, slots: int) -> Iterator[_Batch]:
        samples = self._samples(slot, slots)
        if self.shuffle and self.buffer > 1:
            samples = shuffled(samples, self.buffer, random.Random(f"{self.seed}-{self.epoch}-{slot}"))
        # islice, list, zip and deque do the per-sample work in C: this loop runs once per batch, not per sample
        counter = itertools.count()
        deque(zip(itertools.islice(samples, self.skip.get(slot, 0)), counter), maxlen=0)  # replayed, not trained
        consumed = next(counter)  # zip pulls the counter once per sample it passed on
        while batch := list(itertools.islice(samples, self.batch_size)):
            consumed += len(batch)
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield _Batch(slot, consumed, self.collate(batch))

    def _samples(self, slot: int, slots: int) -> Iterator[Any]:
        if is_hf(self.dataset):  # split by rank already (split_dataset_by_node); it splits by worker itself
            return iter(self.dataset)
        if self.whole_shards:
            order = list(range(self.dataset.n_shards))
            if self.shuffle:
                random.Random(f"{self.seed}-{self.epoch}-shards").shuffle(order)
            rank, worker = divmod(slot, slots // self.world_size)
            mine = order[rank + self.world_size * worker::slots]  # ranks first: each has a shard
            return itertools.chain.from_iterable(
                self.dataset.shard(num_shards=self.dataset.n_shards, index=index) for index in mine)
        return itertools.islice(self.dataset, slot, None, slots)  # round robin: samples slot, slot + slots, ...


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


def shard_notice(n_shards: int | None, world_size: int, *, hf: bool) -> str | None:
    """What to tell the user when a sharded stream cannot give each rank whole shards (None: nothing to say).

    ``n_shards``: the user's stream's own count (a Hugging Face stream's before split_dataset_by_node).

    >>> shard_notice(8, 4, hf=True) is None, shard_notice(2, 3, hf=False)[:39]
    (True, 'ddpkit: the stream has 2 shard(s) for 3')
    """
    if n_shards is None:
        return None
    if hf:  # split_dataset_by_node: whole files per rank when they divide, else every world_size-th sample
        if n_shards % world_size == 0:
            return None
        return (f"ddpkit: the Hugging Face stream has {n_shards} shard(s) for {world_size} processes, which do not "
                f"divide: split_dataset_by_node gives each rank 1 sample in every {world_size}, so each rank reads "
                f"every shard (exact, but each reads the whole stream): give it a multiple of {world_size} shards")
    if n_shards >= world_size:
        return None
    return (f"ddpkit: the stream has {n_shards} shard(s) for {world_size} processes, so some rank would get none; "
            "each (rank, worker) reads every shard and keeps its share of the samples instead (exact, but each "
            "reads the whole stream): give it at least one shard per process")


def shuffled(samples: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A bounded shuffle: fill a buffer of ``size``, then emit a random element and put the next one in its place.

    >>> list(shuffled(iter(range(5)), 1, random.Random(0)))
    [0, 1, 2, 3, 4]
    >>> sorted(shuffled(iter(range(10)), 4, random.Random(0))) == list(range(10))
    True
    """
    samples = iter(samples)
    buffer = list(itertools.islice(samples, size))
    if len(buffer) == size:
        # what randrange(size) calls after checking its arguments: the same draws, without the checks per sample
        draw: Callable[[int], int] = rng._randbelow  # type: ignore[attr-defined]
        for sample in samples:
            index = draw(size)
            buffer[index], sample = sample, buffer[index]
            yield sample
    rng.shuffle(buffer)
    yield from buffer


class StreamLoader(Observed, DataLoader):
    """A DataLoader over this rank's share of a stream (built by :func:`ddpkit.data_loader`).

    ``agree``: ``"drop"`` ends the pass on every rank at the step where the first rank runs dry; ``"empty"``
    lets ranks that ran dry hand out empty batches until every rank has (modes whose forward is collective,
    in evaluation); None: ranks end on their own (evaluation, join). The ranks agree on a count of batches
    each holds ahead (a window of 1 growing to 16, see :func:`next_window`): one small all-reduce per window,
    in flight while the window before it trains.
    ``join``: ``uneven="join"``, iterated only inside ``ddpkit.join`` (elsewhere the last step would hang).
    """

    def __init__(self, slots: _Slots, agree: str | None, group_size: int, join: bool = False, **kwargs: Any):
        super().__init__(slots, batch_size=None, **kwargs)
        self.slots, self.agree, self.group_size, self.join = slots, agree, group_size, join
        self.epoch = 0
        self._observers = []  # see Observed: a tool's cap and timer
        self.steps_taken = 0
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
        mine = torch.tensor([[*(self._consumed.get(self.slots.rank * workers + w, 0) for w in range(workers)),
                              self._turn]])
        rows = collectives.gather(mine)  # one row per rank, in rank order
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
        # no agreement: the rank that runs dry first would leave the rest
        if self.join and not process.current().joining:
            raise RuntimeError("uneven='join' gives ranks different numbers of batches; run the loop inside "
                               "`with ddpkit.join(model):` or use uneven='drop'")
        self.slots.epoch, self.slots.skip, self.slots.turn = self.epoch, dict(self._consumed), self._turn
        return self._passing(super().__iter__())

    def _passing(self, batches: Any) -> Iterator[Any]:
        try:
            yield from self._steps(batches)
        finally:  # a pass that stops early leaves workers mid-stream: stop them now, not whenever GC runs
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def _steps(self, batches: Iterator[_Batch]) -> Iterator[Any]:
        last: Any = None
        for item in self._timed(self._agreed(batches)):
            if not self._admitted():
                break
            if item is None:  # "empty": other ranks still have data, and their forward needs this rank
                yield empty_batch(last)
                continue
            slot, consumed, last = item
            self._consumed[slot] = consumed
            self._turn = (slot % self._workers() + 1) % self._workers()  # slot = rank * workers + worker
            self.steps_taken += 1
            process.heartbeat()
            yield last
        self.epoch, self._consumed, self._turn = self.epoch + 1, {}, 0

    def _agreed(self, batches: Iterator[_Batch]) -> Iterator[_Batch | None]:
        """This rank's batches, in rounds of a length every rank agreed on (None: an empty batch, "empty").

        Each rank reads ahead and offers the ranks a count of batches it holds beyond those already agreed on;
        they agree on the MIN ("drop") or MAX ("empty") of the offers: a rank offers none only once it has run
        dry, so the pass ends at a count of 0. The same all-reduce agrees on the next window (the MIN of every
        rank's :func:`next_window`): it starts at one batch and grows to 16, every rank alike. The offer for
        the next round travels while this round trains, so a step waits for it only when a peer is behind."""
        if not self.agree or self.group_size == 1:  # nobody to agree with: batches as they are asked for
            yield from batches
            return
        hand, size = _Hand(iter(batches), self.num_workers), 1
        op = "min" if self.agree == "drop" else "max"
        hand.fill(1)
        offer = control.agree([len(hand), hand.proposal(size)], [op, "min"])
        while True:
            with phases.waiting():  # the phase report: a rank that waits here waits for a slower peer
                rounds, size = offer.values()
            if rounds == 0:
                return
            for left in range(rounds - 1, -1, -1):
                yield hand.pop()  # None only once this rank has run dry ("empty": its peers have not)
                hand.top_up(size, agreed=left)
                if left == rounds - 1:  # after the round's first step: the next offer travels while it trains
                    offer = control.agree([max(0, len(hand) - left), hand.proposal(size)], [op, "min"])


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
    original, hf = dataset, is_hf(dataset)
    if hf:  # the library's own rank split (whole shards when they divide, else every world_size-th)
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(dataset, rank=state.rank, world_size=state.world_size)
    slots = _Slots(dataset, state.rank, state.world_size, batch_size, collate, shuffle, seed, shuffle_buffer,
                   drop_last)
    notice = shard_notice(getattr(original, "n_shards", None) if has_shards(original) or hf else None,
                          state.world_size, hf=hf)
    if notice and state.is_main:
        print(notice, file=sys.stderr, flush=True)
    agree = ("drop" if uneven == "drop" else None) if train else ("empty" if collective_forward else None)
    return StreamLoader(slots, agree, state.world_size, join=train and uneven == "join", **loader_kwargs)
