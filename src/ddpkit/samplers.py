"""One global order of sample positions per epoch, split across ranks: rank r takes positions r, r + W, ...
The order is ddpkit's own seeded shuffle (:class:`ShardSampler`) or a script's sampler (:class:`SamplerShard`,
``data_loader(sampler=...)``); either way it is the same on every rank and for every world size, so one process
with batch ``B * W`` sees the same global batches as W processes with batch ``B``.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=8, sampler=WeightedRandomSampler(weights, len(train_set)))
"""

from __future__ import annotations

import collections
import itertools
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler


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
        """Take ``epoch``'s order. Under :class:`ddpkit.data.ShardedDataLoader` this is the script's word and
        wins over the loader's own count.

        >>> sampler = ShardSampler(4, rank=0, world_size=1); sampler.set_epoch(3); sampler.epoch
        3
        """
        self.epoch = epoch_number(epoch)
        owner = self.on_set_epoch() if self.on_set_epoch is not None else None
        if owner is not None:
            owner(self.epoch)

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
    positions of it. A sampler that draws from a ``generator`` attribute (``RandomSampler``,
    ``WeightedRandomSampler``, ``SubsetRandomSampler``) gets a new one seeded ``seed + epoch`` each pass, so
    every rank draws the same stream (their global RNGs differ: ``init(seed=)`` adds the rank) and a resume
    replays it; others get ``set_epoch(epoch)`` if they have it, and must give every rank the same order.
    The stream is read lazily: a sampler of ``num_samples=10**10`` costs what the loop takes of it.

    >>> from torch.utils.data import SequentialSampler
    >>> [list(SamplerShard(SequentialSampler(range(5)), r, world_size=2, seed=0, uneven="pad")) for r in (0, 1)]
    [[0, 2, 4], [1, 3, 0]]
    """

    def __init__(self, sampler: Sampler[int], rank: int, world_size: int, seed: int, uneven: str,
                 multiple: int | None = None):
        super().__init__(len(sampler), rank, world_size, seed, uneven, multiple)  # type: ignore[arg-type]
        self.sampler = sampler

    def __iter__(self) -> Iterator[int]:
        # seeded now, not at the first index: the pass's epoch is the one set when the pass began
        if hasattr(self.sampler, "generator"):
            self.sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
            _seeded.add(self.sampler.generator)
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
        return self._positions(iter(self.sampler), self.start + self.rank, self._total())

    def _positions(self, stream: Iterator[int], first: int, total: int) -> Iterator[int]:
        world, size = self.world_size, min(self.size, total)  # size: the positions read from the stream
        head = list(itertools.islice(stream, min(world, size)))  # what pad repeats
        yield from head[first::world]  # positions < W: one at most
        mine = first if first >= len(head) else first + world  # this rank's next position after the head
        if mine < size:
            collections.deque(itertools.islice(stream, mine - len(head)), maxlen=0)  # skip, at C speed
            yield from itertools.islice(stream, 0, size - mine, world)
        for position in range(max(self.size, first), total):  # pad: wrap around to the stream's start
            if (position - first) % world == 0:
                yield head[(position - self.size) % len(head)]


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
    if shuffle:
        raise ValueError(f"sampler= decides the order, got shuffle=True with sampler={name}(...); drop shuffle=")
    if not callable(getattr(sampler, "__len__", None)):
        raise ValueError(f"sampler={name}(...) has no len(): the ranks split its positions into equal shares; "
                         "give it a length (torch's samplers take num_samples=, e.g. 10**10 for a loop that "
                         "breaks after its steps)")
    return sampler
