"""One global order of sample positions per epoch, split across ranks: rank r takes positions r, r + W, ...
The order is ddpkit's own seeded shuffle (:class:`ShardSampler`) or a script's sampler (:class:`SamplerShard`,
``data_loader(sampler=...)``); either way it is the same on every rank and for every world size, so one process
with batch ``B * W`` sees the same global batches as W processes with batch ``B``.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=8, sampler=WeightedRandomSampler(weights, len(train_set)))
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import operator
import os
import random
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler, WeightedRandomSampler


def epoch_number(epoch: Any) -> int:
    """``epoch`` as an int >= 0, or a one-line ValueError.

    >>> epoch_number(2), epoch_number(torch.tensor(3))
    (2, 3)
    """
    try:
        number = operator.index(epoch)
    except TypeError:
        number = -1
    if number < 0:
        raise ValueError(f"set_epoch({epoch!r}): expected an epoch number (an int >= 0); pass the loop's "
                         "counter, as in `for epoch in range(loader.epoch, epochs): loader.set_epoch(epoch)`")
    return number


class EpochSampler(Sampler[int]):
    """Rank ``rank``'s positions of an epoch's global order of ``size`` positions, from global position
    ``start`` (a mid-epoch resume). ``uneven`` decides what happens when ``size`` does not divide by the world
    size W: ``pad`` repeats positions from the start of the order so every rank gets the same count (torch's
    DistributedSampler does the same), ``drop`` drops the tail (keeping a multiple of ``multiple``: ``ddpkit
    verify``'s N), ``join`` leaves ranks with counts that differ by at most one (evaluation loaders; training
    then needs ``ddpkit.join``). Subclasses say what the order is (:meth:`__iter__`) and how long (``size``).
    """

    def __init__(self, size: int, rank: int, world_size: int, seed: int, uneven: str, multiple: int | None):
        self.size, self.rank, self.world_size, self.seed, self.uneven = size, rank, world_size, seed, uneven
        self.multiple = multiple or world_size
        self.epoch = 0
        self.start = 0
        # the owning loader's (weakly: no cycle), so the script's own set_epoch (the DistributedSampler habit)
        # reaches the loader
        self.on_set_epoch: weakref.WeakMethod[Callable[[int], None]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (pickle, deepcopy) is the sampler alone: it does not reach its loader."""
        return {**self.__dict__, "on_set_epoch": None}

    def set_epoch(self, epoch: int) -> None:
        """Take ``epoch``'s order. Under :class:`ddpkit.data.loader.ShardedDataLoader` this is the script's word and
        wins over the loader's own count.

        >>> sampler = ShardSampler(4, rank=0, world_size=1); sampler.set_epoch(3); sampler.epoch
        3
        """
        number = epoch_number(epoch)
        owner = self.on_set_epoch() if self.on_set_epoch is not None else None
        if owner is None:
            self.epoch = number
        else:  # the loader sets self.epoch: a pass already open (iter() before the first batch) keeps its own
            owner(number)

    def _total(self) -> int:
        if self.uneven == "pad":
            return -(-self.size // self.world_size) * self.world_size
        if self.uneven == "drop":
            return self.size // self.multiple * self.multiple
        return self.size

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self._total(), self.world_size))


class ShardSampler(EpochSampler):
    """ddpkit's own order: a permutation of the dataset seeded with ``seed + epoch`` (or dataset order).

    >>> [list(ShardSampler(5, rank=r, world_size=2, shuffle=False, uneven="join")) for r in (0, 1)]
    [[0, 2, 4], [1, 3]]
    """

    def __init__(self, size: int, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 uneven: str = "pad", multiple: int | None = None):
        super().__init__(size, rank, world_size, seed, uneven, multiple)
        self.shuffle = shuffle

    def global_order(self) -> list[int]:
        """This epoch's order of the whole dataset (independent of the world size)."""
        if not self.shuffle:
            return list(range(self.size))
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def __iter__(self) -> Iterator[int]:
        order, total = self.global_order(), self._total()
        while len(order) < total:  # pad: wrap around (more than once for tiny datasets)
            order += order[: total - len(order)]
        return iter(order[self.start + self.rank:total:self.world_size])


class SamplerShard(EpochSampler):
    """A script's sampler as the global order: its stream of indices, read on every rank, and this rank's
    positions of it. The stream is drawn seeded ``seed + epoch`` on every rank (their global RNGs differ:
    ``init(seed=)`` adds the rank), so every rank reads the same order and a resume replays it: a sampler with
    a ``generator`` attribute (``RandomSampler``, ``WeightedRandomSampler``, ``SubsetRandomSampler``) gets a new
    generator so seeded; and whatever the sampler draws from torch's (CPU) or python's global RNG is drawn from
    a copy seeded so (:class:`_Isolated`), leaving the script's own RNGs untouched. A sampler with
    ``set_epoch`` also gets the epoch. ``len(sampler)`` is read at each pass (a pool that grows between epochs).

    >>> from torch.utils.data import SequentialSampler
    >>> [list(SamplerShard(SequentialSampler(range(5)), r, world_size=2, seed=0, uneven="pad")) for r in (0, 1)]
    [[0, 2, 4], [1, 3, 0]]
    """

    def __init__(self, sampler: Sampler[int], rank: int, world_size: int, seed: int, uneven: str,
                 multiple: int | None = None):
        super().__init__(len(sampler), rank, world_size, seed, uneven, multiple)  # type: ignore[arg-type]
        self.sampler = sampler

    def __len__(self) -> int:
        self.size = len(self.sampler)  # type: ignore[arg-type]
        return super().__len__()

    def __iter__(self) -> Iterator[int]:
        # seeded now, not at the first index: the pass's epoch is the one set when the pass began
        self.size = len(self.sampler)  # type: ignore[arg-type]
        if self.size < self.world_size:  # the same test as data_loader's, for a pool that shrank
            raise ValueError(too_few(self.sampler, self.size, self.world_size))
        if hasattr(self.sampler, "generator"):
            with contextlib.suppress(AttributeError):  # a read-only property: the global RNG's copy seeds it
                self.sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
                _seeded.add(self.sampler.generator)
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
        stream = iter(_Isolated(self.sampler, self.seed + self.epoch))
        return self._positions(stream, self.start + self.rank, self._total())

    def _positions(self, stream: Iterator[int], first: int, total: int) -> Iterator[int]:
        world, size = self.world_size, min(self.size, total)  # size: the positions read from the stream
        head = self._row(stream, 0, size)  # what pad repeats
        if first < len(head):
            yield head[first]
        mine = max(world, first // world * world)  # the row of W positions this rank's next one is in
        skipped = _skip(stream, min(mine, size) - world)  # a resume: the rows before its own, at C speed
        if skipped < min(mine, size) - world:
            raise ValueError(self._overstated(world + skipped))
        block = _ROWS * world
        for row in range(mine, size, block):
            # whole blocks of rows, their bounds the same on every rank, read before this rank's indices of
            # them: a stream shorter than len() ends in the same block, so at the same step, on every rank
            yield from self._row(stream, row, size, block)[first % world::world]
        for position in range(max(self.size, first), total):  # pad: wrap around to the stream's start
            if (position - first) % world == 0:
                yield head[(position - self.size) % len(head)]

    def _row(self, stream: Iterator[int], row: int, size: int, count: int | None = None) -> list[int]:
        """Positions ``row`` to ``row + count`` (W) of the stream, fewer at its end; the error if it ends early."""
        want = min(count or self.world_size, size - row)
        got = list(itertools.islice(stream, want))
        if len(got) < want:
            raise ValueError(self._overstated(row + len(got)))
        return got

    def _overstated(self, yielded: int) -> str:
        name, size = type(self.sampler).__name__, self.size
        return (f"sampler={name}(...) yielded {yielded} indices but len() said {size}: every rank must take "
                f"the same number of steps, so the stream must be as long as len(); make __len__ return the "
                "number of indices __iter__ yields")


class _Isolated:
    """A sampler's stream drawn with torch's CPU RNG, python's ``random`` and numpy's (when imported) seeded
    ``seed``: copies, so the script's own RNGs are left where they were; read in chunks so the swap costs
    little per index.

    >>> before = torch.get_rng_state()
    >>> list(_Isolated(range(3), seed=0)), torch.equal(before, torch.get_rng_state())
    ([0, 1, 2], True)
    """

    CHUNK = 65536

    def __init__(self, sampler: Any, seed: int):
        self.sampler, self.seed = sampler, seed
        self.stream: Iterator[int] | None = None
        self.states: dict[str, Any] = {"torch": torch.Generator().manual_seed(seed).get_state(),
                                       "python": random.Random(seed).getstate()}

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._chunks())  # not a python __next__: C speed per index

    def _chunks(self) -> Iterator[list[int]]:
        # a swap costs about 1 ms (numpy's state is large): chunks grow from 256 indices (a quick first batch)
        # to CHUNK (a few ns per index)
        size = 256
        while True:
            with self._swapped():
                if self.stream is None:  # iter() too: a sampler may draw its whole order there
                    self.stream = iter(self.sampler)
                chunk = list(itertools.islice(self.stream, size))
            yield chunk
            if len(chunk) < size:
                return
            size = min(2 * size, self.CHUNK)

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        """The stream's RNG states in place of the process's, for one chunk."""
        numpy = sys.modules.get("numpy")  # a sampler drawing from numpy has imported it
        if numpy is not None and "numpy" not in self.states:
            self.states["numpy"] = numpy.random.RandomState(self.seed % 2**32).get_state()
        saved = random.getstate(), numpy.random.get_state() if numpy is not None else None
        with torch.random.fork_rng(devices=[]):  # CPU only: a CUDA RNG is not touched (nor initialised)
            torch.set_rng_state(self.states["torch"])
            random.setstate(self.states["python"])
            if numpy is not None:
                numpy.random.set_state(self.states["numpy"])
            try:
                yield
            finally:
                self.states["torch"], self.states["python"] = torch.get_rng_state(), random.getstate()
                random.setstate(saved[0])
                if numpy is not None:
                    self.states["numpy"] = numpy.random.get_state()
                    numpy.random.set_state(saved[1])


def _skip(stream: Iterator[int], count: int) -> int:
    """Read ``count`` indices of ``stream`` (at C speed); how many there were."""
    last = collections.deque(zip(itertools.count(1), itertools.islice(stream, count)), maxlen=1)
    return last[0][0] if last else 0


def too_few(sampler: Any, size: int, world_size: int) -> str:
    """The one-line error for a sampler of fewer indices than the job has processes."""
    processes = f"{world_size} process" + ("es" if world_size != 1 else "")
    return (f"sampler={type(sampler).__name__}(...) has {size} indices but the job has {processes}: each rank "
            f"needs at least one sample; use fewer processes or a sampler of at least {world_size} indices")


_ROWS = 64  # rows of W indices SamplerShard reads at a time

# generators SamplerShard gave a sampler: a loader built again over that sampler is not refused for "its own"
_seeded: weakref.WeakSet[torch.Generator] = weakref.WeakSet()


def user_sampler(sampler: Any, loader_kwargs: dict[str, Any], shuffle: bool | None) -> Sampler[int] | None:
    """The script's ``sampler=`` (None without one), checked against the other DataLoader arguments: what
    cannot be split across ranks is refused in one line.

    >>> user_sampler(None, {}, None) is None
    True
    """
    if loader_kwargs.get("batch_sampler") is not None:
        raise ValueError("batch_sampler= is not supported by data_loader: it splits samples across ranks, not "
                         "batches; pass sampler= (its indices are split across ranks, batch_size= batches them)")
    if sampler is None:
        return None
    name = type(sampler).__name__
    if isinstance(sampler, DistributedSampler):
        raise ValueError(f"sampler={name}(...) splits the data by rank, and data_loader already does (each rank "
                         "would get 1/W of its share); drop sampler= (shuffle=, seed=, uneven= do the rest)")
    if getattr(sampler, "generator", None) is not None and sampler.generator not in _seeded:
        raise ValueError(f"sampler={name}(...) has its own generator: data_loader seeds one per epoch so every "
                         "rank draws the same order and a resume replays it; build it without generator= and "
                         "pass data_loader(..., seed=N)")
    _check_drawable(sampler)
    if shuffle:
        raise ValueError(f"sampler= decides the order, got shuffle=True with sampler={name}(...); drop shuffle=")
    if not callable(getattr(sampler, "__len__", None)):
        raise ValueError(f"sampler={name}(...) has no len(): the ranks split its positions into equal shares; "
                         "give it a length (torch's samplers take num_samples=, e.g. 10**10 for a loop that "
                         "breaks after its steps)")
    return sampler


# bytes an index of a WeightedRandomSampler's stream costs at once: torch.multinomial's int64, then .tolist()'s
# python int (32) and its list slot (8)
_BYTES_PER_DRAWN_INDEX = 48


def _check_drawable(sampler: Any) -> None:
    """A WeightedRandomSampler draws its whole stream at the first batch: refuse one this machine cannot hold
    (``num_samples=10**10`` as an "endless" stream: 480 GB), rather than fail or swap there.

    >>> _check_drawable(WeightedRandomSampler([1.0, 2.0], num_samples=10**6))
    """
    if not isinstance(sampler, WeightedRandomSampler) or not hasattr(os, "sysconf"):
        return
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    need = sampler.num_samples * _BYTES_PER_DRAWN_INDEX
    if need > memory:
        raise ValueError(f"sampler=WeightedRandomSampler(num_samples={sampler.num_samples}) draws its whole stream "
                         f"at the first batch (torch.multinomial, then a list: {need / 2**30:.0f} GiB; this machine "
                         f"has {memory / 2**30:.0f} GiB): it is not an endless stream; pass num_samples=len(dataset) "
                         "and loop over epochs (each pass draws anew)")
