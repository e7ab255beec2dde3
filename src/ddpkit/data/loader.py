"""The map-style loader ``ddpkit.data_loader`` builds (:mod:`ddpkit.data.build`): a DataLoader over this rank's
shard that reshuffles every epoch by itself, resumes mid-epoch, and pads evaluation passes with empty batches
where every forward is collective.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=32)              # a ShardedDataLoader, 32 per process
    for epoch in range(10):
        for x, y in loader:                                            # each pass: the next epoch's order
            ...

The global order of an epoch is one seeded permutation of the whole dataset, the same for every world
size; rank r takes every world_size-th index of it from position r. So one process with batch ``B * N``
sees the same global batches as N processes with batch ``B`` each.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddpkit.core import process
from ddpkit.data.samplers import EpochSampler
from ddpkit.strategies import replicas

__all__ = ["Observed", "ShardedDataLoader", "empty_batch"]

Observer = Callable[[], "bool | None"]
FetchWatcher = Callable[["bool | None"], None]


class Observed:
    """The per-batch observers of a ddpkit loader: the one place a tool (``ddpkit verify``, ``bench``) sees
    the batches, so the loaders carry no tool's fields.

    ``loader.observe(fn)``: ``fn()`` runs right before each batch is handed out (``loader.steps_taken``
    counts the batches handed out before it); returning ``False`` ends the pass there, without that batch,
    as a ``break`` would. Observers run in the order given; once one returns ``False`` the later ones do not
    run (they see only batches handed out). Example, at most 3 batches in all::

        loader.observe(lambda: loader.steps_taken < 3)
    """

    _observers: list[Observer]
    _fetch_watchers: tuple[FetchWatcher, ...] = ()

    def observe(self, fn: Observer) -> None:
        self._observers.append(fn)

    def watch_fetch(self, fn: FetchWatcher) -> None:
        """``fn(True)`` as the loop asks for a batch, ``fn(False)`` once it is there, ``fn(None)`` when the pass
        ended instead: the phase report's data time. A loader nobody watches iterates as it would without this."""
        self._fetch_watchers = (*self._fetch_watchers, fn)

    def _timed(self, batches: Iterable[Any]) -> Iterable[Any]:
        return _timed(batches, self._fetch_watchers) if self._fetch_watchers else batches

    def _admitted(self) -> bool:
        """True: hand out the next batch; False: an observer ended the pass."""
        return not self._observers or all(fn() is not False for fn in self._observers)  # none: a normal run


class ShardedDataLoader(Observed, DataLoader):
    """A ``torch.utils.data.DataLoader`` that counts epochs: each pass takes the next epoch's order.

    A pass is the epoch's once it has handed out a batch: one that runs to its end, one left early
    (``break`` after a fixed number of steps) and one whose iterator is kept unfinished all move the loader
    to the next epoch, from its beginning; an ``iter()`` that hands out nothing moves nothing. ``epoch`` is
    the epoch of the current pass, or of the next one between passes; loop over ``range(loader.epoch,
    epochs)`` and a resumed run continues where it stopped. The script's own :meth:`set_epoch` (or
    ``loader.sampler.set_epoch``) wins. :meth:`state_dict` holds the epoch and the global position in it
    (world-size free), so a resume on another number of processes continues the same global order.
    :meth:`~Observed.observe` sees each batch as it is handed out, and may end the pass.

    Example (fixed steps per epoch)::

        for epoch in range(loader.epoch, epochs):
            for i, (x, y) in enumerate(loader):
                ...
                if i == steps_per_epoch - 1:
                    break                      # the next pass is epoch + 1's order
    """

    count: Callable[[Any], Any] | None = None

    def __init__(self, *args: Any, join: bool = False, equal_steps: int | None = None, train: bool = False,
                 weights: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # batch_count=: each batch counted as it is handed out (:class:`~ddpkit.data.weighted.BatchWeights`)
        self.weights = weights
        if weights is not None:  # (what a loader of steps calls its count= too: tools read it)
            self.count = weights.fn
        self.epoch = 0
        self.join, self.train = join, train
        self.equal_steps = equal_steps  # pass length of every rank: shorter ranks end with empty batches
        self._observers = []
        self.steps_taken = 0  # batches handed out, all passes together
        self._start = 0  # global position the current / next pass starts from
        self._batches: int | None = None  # batches handed out in the open pass; None between passes
        self._requested: int | None = None  # set_epoch during a pass: the next pass's epoch
        self._passes = 0  # numbers the passes: an old pass closed late must leave the current one alone
        self._unchecked = 0  # training batches since the replicas were last compared at a pass's end
        self._generator_state: torch.Tensor | None = None  # generator state at the start of the current pass
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
        """Continue at ``state`` (a :meth:`state_dict`): its epoch, past the samples it had taken. A value that is
        no whole number >= 0 (a crafted file's ``{"epoch": 1, "position": -4}``) is refused with one line::

            ValueError: loader state position=-4: expected whole numbers >= 0 (the epoch, the samples of it ...
        """
        bad = [f"{key}={state.get(key)!r}" for key in ("epoch", "position") if not _count(state.get(key))]
        if bad:  # a crafted file's value would otherwise surface as "generator raised StopIteration" mid-epoch
            raise ValueError(f"loader state {', '.join(bad)}: expected whole numbers >= 0 (the epoch, the samples of "
                             "it already taken); restore a checkpoint this loader's script wrote")
        self.epoch, self._start = int(state["epoch"]), int(state["position"])
        self._batches = self._requested = None
        self._passes += 1  # a pass open before the restore is not the restored one

    def generator_state(self) -> torch.Tensor | None:
        """This rank's worker-seed generator as it was when the current pass began (for checkpoints)."""
        if self.generator is None:
            return None
        return self._generator_state if self._batches is not None else self.generator.get_state()

    def __iter__(self):
        if self.join and not process.current().joining:
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

    def _admit(self) -> bool:
        """Before each batch: the observers' say, and the count they read (a loader of steps admits steps)."""
        if not self._admitted():
            return False
        self.steps_taken += 1
        return True

    def _counted(self, batches: Any, number: int) -> Iterator[Any]:
        if self.equal_steps is not None:
            batches = _padded_with_empty(batches, self.equal_steps)
        finished, handed = False, 0
        try:
            for batch in self._timed(batches):
                if not self._admit():
                    return
                if number == self._passes:  # counted when handed out (a checkpoint in the loop body includes
                    self._batches = (self._batches or 0) + 1  # it), by the current pass only: not an older one
                handed += 1
                process.heartbeat()
                if self.weights is not None:
                    self.weights.weigh(batch)
                yield batch
            finished = True
            self._unchecked += handed
            if self.train and not self.join and not process.current().joining and \
                    self._unchecked >= replicas.PASS_STEPS:
                # every rank ends the pass at the same step: the replicas are compared there too, so a script that
                # ends with dist.destroy_process_group() (no check at the job's end) has its last epochs checked;
                # not after every short pass (14 steps of the demo): each look is a collective
                self._unchecked = 0
                replicas.check_all()
        finally:  # at the end, and at a `break` (CPython closes the iterator as the loop is left)
            if number == self._passes:
                self._close_pass(finished)
            if self.weights is not None:
                self.weights.close()


def _count(value: Any) -> bool:
    """A whole number >= 0 (an int, or an integer tensor of one element, as a checkpoint may hold it)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool and int(value) >= 0
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _timed(batches: Iterable[Any], watchers: tuple[FetchWatcher, ...],
           finalizing: Callable[[], bool] = sys.is_finalizing) -> Iterator[Any]:
    """``batches``, telling ``watchers`` when each fetch starts and how it ended. A pass still open when the
    interpreter exits (a script's module-level ``iter(loader)``) is closed while modules are torn down and
    their globals are None: the watchers are not told then (``finalizing``, bound here, still answers)."""
    it = iter(batches)
    while True:
        for fn in watchers:
            fn(True)
        try:
            batch = next(it)
        except StopIteration:
            _ended(watchers)
            return
        except BaseException:  # a worker's error (raised on), a KeyboardInterrupt: no batch came either
            _ended(watchers)
            raise
        for fn in watchers:
            fn(False)
        try:
            yield batch
        except GeneratorExit:  # closed there: the loop was left with break, or an observer ended the pass
            if not finalizing():
                _ended(watchers)
            raise


def _ended(watchers: tuple[FetchWatcher, ...]) -> None:
    for fn in watchers:
        fn(None)


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
