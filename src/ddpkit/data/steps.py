"""The loader of optimizer steps ``ddpkit.data_loader(..., global_batch_size=G, micro_batch_size=M)`` builds: each
item is a :class:`Step` of the same ``G`` samples at any world size, which yields this rank's micro-batches,
keeps the gradient all-reduce for the last of them, and scales each micro-batch's loss so the step equals
one process's step over the ``G`` samples (:mod:`ddpkit.data.global_batch` says how they are split).

Example::

    loader = ddpkit.data_loader(train_set, global_batch_size=48, micro_batch_size=8)
    for epoch in range(loader.epoch, epochs):
        for step in loader:                            # one optimizer step: 48 samples, at 1, 2, 3 ... processes
            for x, y in step.micro_batches(model):     # this rank's share, at most 8 at a time
                step.backward(loss_fn(model(x), y))    # the mean loss, scaled; all-reduced on the last only
            optimizer.step()
            optimizer.zero_grad()

Accelerate writes the same loop with ``with accelerator.accumulate(model):`` around each batch and a
``gradient_accumulation_steps`` fixed up front; Fabric with ``fabric.no_backward_sync(model, enabled=...)``
and the arithmetic left to the script. Here the accumulation count follows the world size, the global
batch does not.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.data.global_batch import GlobalBatchSampler, StepShape
from ddpkit.data.loader import ShardedDataLoader
from ddpkit.data.samplers import EpochSampler
from ddpkit.runtime import group as runtime
from ddpkit.strategies.forwarding import uncompiled

__all__ = ["GlobalBatchLoader", "Step"]


class Step:
    """One optimizer step's micro-batches on this rank. Iterate :meth:`micro_batches` (or the step itself,
    which all-reduces after every micro-batch: the same result, more traffic) and call :meth:`backward` on each
    micro-batch's mean loss; ``scale`` is the factor it applies (``m * W / G`` for m samples here, or
    ``n * W / N`` for n counted items of the step's N with the loader's ``count=``), ``sync`` whether the
    current micro-batch is the one whose backward all-reduces. ``index``: the step's number in its epoch;
    ``micro_steps``: how many micro-batches every rank takes; ``samples``: this rank's real samples (a padding
    sample of weight 0 is not one); ``global_samples``: the step's samples over all ranks; with ``count=``,
    ``count`` and ``global_count``: the items counted here and over all ranks (None without it)."""

    def __init__(self, shape: StepShape, rank: int, index: int, source: Iterator[Any], on_done: Any,
                 count: Callable[[Any], Any] | None = None):
        self.index, self.micro_steps, self.global_samples = index, shape.micro_steps, shape.samples
        self.samples = sum(shape.mine(rank))
        self._weights = shape.weights(rank)
        self._source, self._on_done, self._count, self._world = source, on_done, count, shape.world_size
        self.handed = 0  # micro-batches handed out
        self.owns_source = False  # the loop over steps was left: this step closes the pass when read
        self.ended = False  # the pass ended inside this step (the data ran out)
        self.scale, self.sync = self._weights[0], self.micro_steps == 1
        self.count: float | None = None
        self.global_count: float | None = None
        self._model: nn.Module | None = None
        self._kept: torch.Tensor | None = None  # a parameter whose gradient the last backward left
        self._version: int | None = None  # ... and that gradient's version then

    def micro_batches(self, model: nn.Module | None = None) -> Iterator[Any]:
        """This rank's micro-batches; with ``model``, every one but the last runs (forward and backward, inside
        the loop body) without the gradient all-reduce, as ``ddpkit.no_sync(model)``."""
        if self.handed:
            raise RuntimeError(f"step {self.index}'s micro-batches were already iterated ({self.handed} of "
                               f"{self.micro_steps}); iterate step.micro_batches(model) once per step")
        # with count=, the step's items are counted over all ranks before the first backward: every
        # micro-batch of this rank is read first (as Hugging Face's trainer does for num_items_in_batch)
        self._model = model
        batches, scales = self._counted() if self._count is not None else (None, self._weights)
        for j, scale in enumerate(scales):
            if batches is not None:
                batch = batches[j]
            else:
                try:
                    batch = next(self._source)
                except StopIteration:
                    self._ran_out(j)
                    return
            self.handed, self.scale, self.sync = j + 1, scale, j + 1 == self.micro_steps
            if self.sync:
                self._on_done()
            context = contextlib.nullcontext() if model is None or self.sync else \
                runtime.ensure_init().strategy.no_sync(uncompiled(model))  # as ddpkit.no_sync(model)
            with context:
                yield batch
        if self.owns_source:
            self._source.close()  # type: ignore[attr-defined]

    def _ran_out(self, j: int) -> None:
        self.ended = True
        if j:  # gradients of micro-batches that skipped the all-reduce: a step here trains apart
            raise RuntimeError(f"the pass ended inside step {self.index}, after {j} of its {self.micro_steps} "
                               "micro-batches: their gradients were never all-reduced; end passes between steps")

    def _counted(self) -> tuple[list[Any], list[float]]:
        """Every micro-batch of this rank and its loss factor ``n * W / N``: n items counted in it (0 in a
        padding micro-batch), N over the whole step, from one all-reduce of a number on the group's device."""
        batches: list[Any] = []
        for j in range(self.micro_steps):
            try:
                batches.append(next(self._source))
            except StopIteration:
                self._ran_out(j)
                return [], []
        assert self._count is not None
        counts = [checked_count(self._count(batch)) if weight > 0 else 0.0
                  for batch, weight in zip(batches, self._weights)]
        self.count = total = sum(counts)
        if self._world > 1:
            state = runtime.ensure_init()
            summed = torch.tensor([total], dtype=torch.float64, device=state.device)
            dist.all_reduce(summed)
            total = summed.item()
        self.global_count = total
        return batches, [n * self._world / total if total else 0.0 for n in counts]

    def __iter__(self) -> Iterator[Any]:
        return self.micro_batches(None)

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * step.scale).backward()``: ``loss`` is the mean over this micro-batch (torch's losses'
        default), or with the loader's ``count=`` the mean over the items it counts. With a GradScaler:
        ``step.backward(scaler.scale(loss))``. A micro-batch with nothing counted (``step.scale == 0``, e.g. every
        label ``-100``) adds nothing, even where its mean is torch's 0/0 NaN."""
        if self._erased():
            earlier = "micro-batch 1" if self.handed == 2 else f"micro-batches 1-{self.handed - 1}"
            raise RuntimeError(f"step {self.index}: the gradients of {earlier} were erased before micro-batch "
                               f"{self.handed}'s backward (optimizer.zero_grad() inside step.micro_batches()?): the "
                               "step would train on its last micro-batch only; call optimizer.zero_grad() once per "
                               "step, after optimizer.step()")
        if self.scale == 0:
            loss = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)
        (loss * self.scale).backward()
        if self._kept is None and not self.sync:
            # one parameter's gradient is watched: zero_grad() drops it (set_to_none, torch's default) or zeroes it
            # in place (a new version). fsdp keeps a skipped sync's gradients elsewhere: no parameter has one, and
            # nothing is watched. Without the model (`for batch in step`), a parameter the loss reached
            params = self._model.parameters() if self._model is not None else _leaves(loss)
            self._kept = next((p for p in params if p.grad is not None), None)
        if self._kept is not None and self._kept.grad is not None:  # what this backward left; a change after it
            self._version = self._kept.grad._version  # is the loop's own

    def _erased(self) -> bool:
        """The watched gradient was dropped, or changed in place to zeros, since the last backward."""
        if self._kept is None:
            return False
        grad = self._kept.grad
        # only a gradient changed in place is read (a sync on a GPU): a plain loop never changes it in between
        return grad is None or (grad._version != self._version and not bool(grad.any()))


def _leaves(loss: torch.Tensor, limit: int = 10_000) -> Iterator[torch.Tensor]:
    """The leaf tensors ``loss``'s graph accumulates gradients into, depth first (at most ``limit`` nodes)."""
    stack: list[Any] = [loss.grad_fn]
    seen: set[Any] = set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: the leaf itself
            yield node.variable
        stack.extend(child for child, _ in node.next_functions)


def checked_count(value: Any) -> float:
    """A micro-batch's count as a float: a number or one-element tensor, finite and >= 0."""
    number = value
    if isinstance(value, torch.Tensor):
        number = value.item() if value.numel() == 1 else value
    elif hasattr(value, "item") and getattr(value, "size", None) == 1:  # a numpy scalar (np.count_nonzero) or array
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < float("inf"):
        raise ValueError(f"count(batch) returned {value!r}: expected the number of items the micro-batch's mean "
                         "loss averages (a number or one-element tensor >= 0), e.g. "
                         "count=lambda batch: (batch['labels'] != -100).sum()")
    return float(number)


class GlobalBatchLoader(ShardedDataLoader):
    """A :class:`~ddpkit.data.loader.ShardedDataLoader` whose items are :class:`Step` s. ``len()``: steps of
    the epoch (the rest of it inside a pass); :meth:`state_dict` holds the epoch and the global position of
    the steps handed out entirely, so a resume at any world size continues the same global batches (save
    after ``optimizer.step()``: a step cut in half restarts whole). ``micro_steps``: a full step's count."""

    def __init__(self, dataset: Any, batch_sampler: GlobalBatchSampler,
                 count: Callable[[Any], Any] | None = None, **kwargs: Any):
        self._done = 0  # global samples of the steps handed out entirely in the open pass
        self.count = count  # how many items a micro-batch's loss averages (None: its samples, the default)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.global_batch, self.micro_steps = batch_sampler.global_batch, batch_sampler.micro_steps
        # `loader.sampler.set_epoch(epoch)`, the DistributedSampler habit, reaches the order: torch left its
        # default sampler there (unused with a batch_sampler) and refuses to set the attribute after __init__
        object.__setattr__(self, "sampler", batch_sampler)

    def _shard_sampler(self) -> EpochSampler:
        return self._global_sampler()

    def _global_sampler(self) -> GlobalBatchSampler:
        assert isinstance(self.batch_sampler, GlobalBatchSampler), "GlobalBatchLoader is built by ddpkit.data_loader"
        return self.batch_sampler

    def __len__(self) -> int:
        return len(self._global_sampler().shapes(self.state_dict()["position"]))

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}`` as every loader has, and the world size and micro-steps it ran with (said
        back when a resume runs at another world size)."""
        return {"epoch": self.epoch, "position": self._start + (0 if self._batches is None else self._done),
                "world_size": self._global_sampler().world_size, "micro_steps": self.micro_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        super().load_state_dict(state)
        line = resized(state, self._global_sampler().world_size, self.micro_steps, self.global_batch)
        if line and runtime.ensure_init().is_main:
            print(line, file=sys.stderr, flush=True)

    def _admit(self) -> bool:
        return True  # the observers see steps (in _steps): one that ends a pass ends it between two steps

    def __iter__(self):
        micro = super().__iter__()  # the pass opens here: epoch and start set on the sampler
        self._done = 0
        return self._steps(micro, self._passes, self._global_sampler().shapes(self._start))

    def _steps(self, micro: Iterator[Any], number: int, shapes: list[StepShape]) -> Iterator[Step]:
        rank, first = self._shard_sampler().rank, -(-self._start // self.global_batch)  # a resume's first step

        def done(samples: int) -> Any:
            def count() -> None:
                if number == self._passes:  # counted when handed out, by the current pass only
                    self._done += samples
            return count

        current: Step | None = None
        try:
            for index, shape in enumerate(shapes):
                if not super()._admit():  # an observer (verify's and bench's step cap) ended the pass here
                    if number == self._passes:  # a source never started runs no finally when closed below
                        self._close_pass(finished=False)
                    return
                current = Step(shape, rank, first + index, micro, done(shape.samples), self.count)
                yield current
                if current.ended:
                    return
                if current.handed < current.micro_steps:
                    handed, current = current.handed, None
                    raise RuntimeError(f"step {first + index} handed out {handed} of its {shape.micro_steps} "
                                       "micro-batches before the next step was asked for; iterate all of "
                                       "step.micro_batches(model) in each step (the samples would be lost)")
            current = None
            next(micro, None)  # the epoch's end: the pass closes as a finished one
        finally:
            if current is not None and current.handed < current.micro_steps and not current.ended:
                # left (or dropped: `step = next(iter(loader))`) with a step still to be read: the step keeps the
                # rest of the pass and closes it once its last micro-batch is read
                current.owns_source = True
            else:  # at the end, and at a `break` between steps: the pass closes now
                micro.close()  # type: ignore[attr-defined]


def resized(saved: dict[str, int], world_size: int, micro_steps: int, global_batch: int) -> str | None:
    """The line a resume at another world size prints (None: the same world size, or a state saved without it).

    >>> resized({"world_size": 2, "micro_steps": 2}, 1, 4, 16)
    'ddpkit: resumed at world size 1 (saved at 2): the global batch stays 16, now 4 micro-steps a step (were 2)'
    >>> crafted = [{"world_size": "2\\nddpkit: forged"}, {"world_size": 2, "micro_steps": -1}]
    >>> resized(crafted[0], 1, 4, 16) is None, resized(crafted[1], 1, 4, 16).endswith("4 micro-steps a step")
    (True, True)
    """
    was, before = (saved.get(key) for key in ("world_size", "micro_steps"))  # a crafted file: only counts are said
    if not _count(was) or was == world_size:
        return None
    return (f"ddpkit: resumed at world size {world_size} (saved at {was}): the global batch stays {global_batch}, "
            f"now {micro_steps} micro-steps a step" + (f" (were {before})" if _count(before) else ""))


def _count(value: Any) -> bool:
    return type(value) is int and 1 <= value <= 1 << 40
