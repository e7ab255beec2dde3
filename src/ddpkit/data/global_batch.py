"""A global batch that does not depend on the world size: how ``G`` samples are split into micro-steps and
across the processes (:func:`plan`), and the sampler that hands each rank its micro-batches
(:class:`GlobalBatchSampler`). :mod:`ddpkit.data.steps` groups them into optimizer steps.

Global step ``b`` of an epoch is positions ``[start + b*G, start + (b+1)*G)`` of the epoch's global order (the
same order at every world size). It is cut into ``k`` *micro-steps* of near-equal size, and micro-step ``j``
is shared by the W processes, rank r taking its positions r, r + W, ... Every rank runs the same ``k``
forwards and backwards (fsdp's gathers, SyncBatchNorm and DDP's buffer broadcast are collective), and the
loss of a micro-batch of m samples is scaled by ``m * W / G``: DDP (and FSDP) average the W gradients, so an
optimizer step sums exactly the gradient of the mean loss over the G samples, as one process would.

Example (48 samples, micro-batches of at most 8 per process)::

    >>> [s.micro_steps for s in plan(100, 48, world_size=2, micro_batch_size=8)]   # 48 + 48 + 4 samples
    [3, 3, 1]
    >>> plan(100, 48, world_size=2, micro_batch_size=8)[0].mine(rank=1)
    [8, 8, 8]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ddpkit.data.samplers import EpochSampler

__all__ = ["GlobalBatchSampler", "StepShape", "largest_micro_batch", "micro_steps", "plan"]


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One global step: ``samples`` positions of the global order, in ``chunks`` (one per micro-step).

    >>> StepShape(10, (5, 5), 2).mine(rank=1), StepShape(10, (5, 5), 2).weights(rank=1)
    ([2, 2], [0.4, 0.4])
    """

    samples: int  # positions of the global order this step takes (G, or fewer at the epoch's end)
    chunks: tuple[int, ...]  # samples of each micro-step, all processes together
    world_size: int

    @property
    def micro_steps(self) -> int:
        return len(self.chunks)

    def mine(self, rank: int) -> list[int]:
        """This rank's real samples in each micro-step (0: it gets one padding sample of weight 0)."""
        return [len(range(rank, chunk, self.world_size)) for chunk in self.chunks]

    def weights(self, rank: int) -> list[float]:
        """The factor on each micro-batch's mean loss: ``m * W / samples`` (0 for padding)."""
        return [m * self.world_size / self.samples for m in self.mine(rank)]


def _split(total: int, parts: int) -> tuple[int, ...]:
    """``total`` in ``parts`` sizes that differ by at most one, larger first."""
    return tuple(total // parts + (1 if i < total % parts else 0) for i in range(parts))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _largest(samples: int, parts: int, world_size: int) -> int:
    """The largest micro-batch one process takes when ``samples`` go in ``parts`` micro-steps."""
    return _ceil(_ceil(samples, parts), world_size)


def _fewest(samples: int, world_size: int, limit: int) -> int:
    """The fewest micro-steps that keep every process's micro-batch within ``limit``."""
    return next(k for k in range(1, samples + 1) if _largest(samples, k, world_size) <= limit)


def micro_steps(global_batch: int, world_size: int, micro_batch_size: int | None,
                accumulation_steps: int | None = None) -> int:
    """How many micro-steps a full global step takes: ``accumulation_steps`` when given, else the fewest that
    keep every process's micro-batch within ``micro_batch_size`` (1 without a limit). A one-line ValueError
    when no count works: each process needs at least one sample in every micro-step.

    >>> micro_steps(48, 1, 8), micro_steps(48, 2, 8), micro_steps(48, 3, 8), micro_steps(48, 4, 8)
    (6, 3, 2, 2)
    """
    for name, value in (("global_batch_size", global_batch), ("micro_batch_size", micro_batch_size),
                        ("accumulation_steps", accumulation_steps)):
        if value is not None and (type(value) is not int or value < 1):  # bool, float, str: refused, not rounded
            raise ValueError(f"{name}={value!r}: expected a whole number >= 1 (e.g. {name}=8)")
    asked = f"global_batch_size={global_batch} over {world_size} process{'es' if world_size != 1 else ''}"
    if global_batch < world_size:
        raise ValueError(f"{asked}: every process needs at least one sample of each step; use "
                         f"global_batch_size >= {world_size} or at most {global_batch} processes")
    if accumulation_steps is not None:
        k = accumulation_steps
        if global_batch // k < world_size:
            raise ValueError(f"{asked} with accumulation_steps={k}: each micro-step needs at least one sample per "
                             f"process; use accumulation_steps between 1 and {global_batch // world_size}")
    else:
        k = 1 if micro_batch_size is None else _fewest(global_batch, world_size, micro_batch_size)
    largest = _largest(global_batch, k, world_size)
    if micro_batch_size is not None and largest > micro_batch_size:
        raise ValueError(f"{asked} with accumulation_steps={k} gives micro-batches of {largest} per process, over "
                         f"micro_batch_size={micro_batch_size}; use accumulation_steps >= "
                         f"{micro_steps(global_batch, world_size, micro_batch_size)} or drop it")
    if global_batch // k < world_size:  # a micro-step smaller than the job: some process would have nothing
        fits = next(m for m in range(micro_batch_size or 1, global_batch + 1)  # m = G / W: one micro-step
                    if global_batch // _fewest(global_batch, world_size, m) >= world_size)
        raise ValueError(f"{asked} with micro_batch_size={micro_batch_size} needs {k} micro-steps, and a micro-step "
                         f"of {global_batch // k} samples leaves a process without one; use micro_batch_size >= "
                         f"{fits}, or a global batch that divides by {world_size}")
    return k


def largest_micro_batch(global_batch: int, world_size: int, micro_batch_size: int | None,
                        accumulation_steps: int | None = None) -> int:
    """The most samples one process takes in a micro-step of a full step.

    >>> [largest_micro_batch(48, w, 8) for w in (1, 2, 3, 4)]
    [8, 8, 8, 6]
    """
    return _largest(global_batch, micro_steps(global_batch, world_size, micro_batch_size, accumulation_steps),
                    world_size)


def plan(total: int, global_batch: int, world_size: int, micro_batch_size: int | None = None,
         accumulation_steps: int | None = None, drop_last: bool = False) -> list[StepShape]:
    """The global steps over ``total`` positions: full steps of ``global_batch``, then the rest (unless
    ``drop_last``): in the fewest micro-steps that keep ``micro_batch_size`` (without one, the full steps' count
    or fewer, so each has a sample per process where it can). A micro-step of fewer samples than processes
    gives the ranks past its end one padding sample of weight 0.

    >>> [(s.samples, s.chunks) for s in plan(11, 4, world_size=2, micro_batch_size=1)]
    [(4, (2, 2)), (4, (2, 2)), (3, (2, 1))]
    """
    k = micro_steps(global_batch, world_size, micro_batch_size, accumulation_steps)
    full, rest = divmod(total, global_batch)
    if drop_last and not full and total:
        raise ValueError(f"global_batch_size={global_batch} with drop_last=True over {total} samples makes no step: "
                         f"every epoch would be empty; use global_batch_size <= {total} or drop drop_last")
    steps = [StepShape(global_batch, _split(global_batch, k), world_size)] * full
    if rest and not drop_last:
        if micro_batch_size is None:
            last = max(1, min(k, rest // world_size))
        else:  # the fewest micro-steps within the limit (never more than a full step's)
            last = min(k, _fewest(rest, world_size, micro_batch_size))
        steps.append(StepShape(rest, _split(rest, last), world_size))
    return steps


class GlobalBatchSampler(EpochSampler):
    """Rank ``rank``'s micro-batches (lists of dataset indices), step after step, from global position
    ``start`` of the epoch's order. ``order`` is the whole global order (a one-process
    :class:`~ddpkit.data.samplers.ShardSampler` or :class:`~ddpkit.data.samplers.SamplerShard`); it takes this
    sampler's epoch and start at each pass. ``len()``: the micro-batches of the rest of the epoch.

    >>> from ddpkit.data.samplers import ShardSampler
    >>> order = ShardSampler(6, rank=0, world_size=1, shuffle=False, uneven="join")
    >>> list(GlobalBatchSampler(order, rank=1, world_size=2, global_batch=4, micro_batch_size=1))
    [[1], [3], [5]]
    """

    def __init__(self, order: EpochSampler, rank: int, world_size: int, global_batch: int,
                 micro_batch_size: int | None = None, accumulation_steps: int | None = None,
                 drop_last: bool = False):
        super().__init__(order.size, rank, world_size, order.seed, "join", None)
        self.order, self.global_batch = order, global_batch
        self.micro_batch_size, self.accumulation_steps, self.drop_last = micro_batch_size, accumulation_steps, drop_last
        self.micro_steps = micro_steps(global_batch, world_size, micro_batch_size, accumulation_steps)  # checked now

    def shapes(self, start: int) -> list[StepShape]:
        """The steps of this epoch from global position ``start`` (nothing of the sampler changes)."""
        self.order.start = 0  # len() from the epoch's start; a pass sets its own start when it begins
        remaining = max(0, len(self.order) - start)  # a script's sampler may change its length between epochs
        return plan(remaining, self.global_batch, self.world_size, self.micro_batch_size,
                    self.accumulation_steps, self.drop_last)

    def __len__(self) -> int:
        return sum(shape.micro_steps for shape in self.shapes(self.start))

    def __iter__(self) -> Iterator[list[int]]:  # type: ignore[override]  # a batch sampler: lists of indices
        shapes = self.shapes(self.start)
        self.order.epoch, self.order.start = self.epoch, self.start
        return self._micro_batches(shapes, iter(self.order))  # the order drawn now, as the pass begins

    def _micro_batches(self, shapes: list[StepShape], positions: Iterator[int]) -> Iterator[list[int]]:
        for shape in shapes:
            taken = [next(positions) for _ in range(shape.samples)]
            offset = 0
            for chunk in shape.chunks:
                part = taken[offset:offset + chunk]
                offset += chunk
                # a micro-step smaller than the job: the ranks past its end take its first sample, at weight 0
                yield part[self.rank::self.world_size] or part[:1]
