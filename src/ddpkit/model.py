"""Put a model on this process's device and wrap it for the chosen mode.

Example::

    model = ddpkit.prepare_model(Net())       # device, SyncBatchNorm (DDP), DDP / DataParallel / nothing
    loss = loss_fn(model(x), y)               # forward and backward unchanged
    torch.save(model.state_dict(), "w.pt")    # no "module." prefix, in every mode
    model.init_hidden(bsz)                    # the module's own methods and attributes, through the wrapper
    ddpkit.unwrap(model)                      # the plain module

The preparing itself belongs to the mode (:meth:`ddpkit.strategies.base.Strategy.prepare`): one file per mode
under :mod:`ddpkit.strategies`, its wrapper class beside it (``ddp.py``, ``ddp_wrapper.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core import process
from ddpkit.data import unprepared
from ddpkit.runtime import group as runtime
from ddpkit.runtime import phases
from ddpkit.strategies import comm as comm_options
from ddpkit.strategies import meta, redirect, replicas
from ddpkit.strategies.forwarding import ForwardsAttributes, uncompiled, unwrap
from ddpkit.strategies.fsdp_wrapper import Shard

__all__ = ["MicroStep", "accumulate", "init_empty", "no_sync", "prepare_model", "unwrap"]


@contextlib.contextmanager
def init_empty(budget_mb: float | None = None, optimizer_slots: int = 2,
               shard_size: int | None = None) -> Iterator[None]:
    """Build modules on the meta device: shapes only, no memory and no initialisation yet.

    ``prepare_model`` then shards the model and initialises each rank's shard, module by module, with the
    module's own ``reset_parameters`` (or ``init_fn``), drawing the same random numbers in the same order
    as building the model normally would: the same seed gives the same weights.

    ``budget_mb``: refuse, before anything is allocated, a model whose training state (parameters, gradients,
    ``optimizer_slots`` tensors per parameter: Adam 2) would not fit one process in the current mode::

        with ddpkit.init_empty(budget_mb=600):    # ddp: "does not fit: 806 MB needed per process, ..."
            model = Net()

    ``shard_size``: in hsdp, the one ``prepare_model`` will get (the budget is counted for that many processes
    sharing the state; default: one node's processes, as prepare_model's default).
    """
    with meta.meta_build() as owners:
        yield
    if budget_mb is None:
        return
    state = runtime.ensure_init()
    if runtime.tools().on_budget(budget_mb, optimizer_slots):  # ddpkit plan counts every mode itself
        meta.check_budget(owners, budget_mb, optimizer_slots, state, shard_size)


def no_sync(model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """Context in which backward skips the gradient all-reduce (gradient accumulation's non-final micro-steps).

    Put forward *and* backward inside. A no-op in modes without one (single, dp) or with ``enabled=False``, so
    one loop serves all::

        for i, (x, y) in enumerate(loader):
            with ddpkit.no_sync(model, enabled=(i + 1) % accum != 0):
                (loss_fn(model(x), y) / accum).backward()
            if (i + 1) % accum == 0:
                optimizer.step(); optimizer.zero_grad()
    """
    if not enabled:
        return contextlib.nullcontext()
    return runtime.ensure_init().strategy.no_sync(uncompiled(model))


class MicroStep(contextlib.AbstractContextManager["MicroStep"]):
    """One micro-step of gradient accumulation (made by :func:`accumulate`): ``sync`` says whether its
    backward all-reduces (then step the optimizer), ``size`` how many micro-batches its group has (divide the
    loss by it). Entered, it is :func:`no_sync` for the micro-steps that do not sync."""

    def __init__(self, model: nn.Module, sync: bool, size: int):
        self.sync, self.size, self._model = sync, size, model
        self._context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def __enter__(self) -> MicroStep:
        self._context = no_sync(self._model, enabled=not self.sync)
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool | None:
        return self._context.__exit__(*exc)


def accumulate(model: nn.Module, step: int, steps: int, total: int | None = None) -> MicroStep:
    """Gradient accumulation over ``steps`` micro-batches: micro-step ``step`` (0-based, in this epoch) of
    ``total`` (``len(loader)``) skips the gradient all-reduce unless it ends a group (DDP's ``no_sync``, FSDP's
    ``set_requires_gradient_sync(False)``; nothing to skip in single and dp). Put forward and backward inside::

        for i, (x, y) in enumerate(loader):
            with ddpkit.accumulate(model, i, steps=4, total=len(loader)) as micro:
                (loss_fn(model(x), y) / micro.size).backward()
            if micro.sync:
                optimizer.step()
                optimizer.zero_grad()

    Groups are ``steps`` micro-batches from the start of each epoch; the last micro-step of the epoch
    (``step == total - 1``) always syncs, so an epoch of 10 batches with ``steps=4`` steps the optimizer
    after batches 4, 8 and 10, and the last group's ``size`` is 2: each update averages the samples it saw,
    as one process with a batch of ``steps`` times the global batch does. Without ``total`` (a stream) a
    trailing partial group is left accumulated: call ``optimizer.zero_grad()`` at each epoch's start.
    ``step`` and ``total`` must be the same on every rank (``len()`` of a ddpkit loader is), or ranks that
    disagree on syncing hang in the all-reduce.

    What equals one process exactly: ``size`` counts micro-batches, not samples, so an update equals one
    process's big-batch step when the micro-batches it sums are full. A last, smaller micro-batch (42
    samples in micro-batches of 4) weighs as much as a full one: use ``drop_last=True`` or a dataset size
    that the global micro-batch divides. A loader resumed mid-epoch yields the remaining batches, and
    ``len(loader)`` is the full epoch's before the pass but the remaining count inside it: pass
    ``total=len(loader)`` inside the loop, as above, and ``step`` counts from 0 at the resume point. So
    checkpoint on steps where ``micro.sync`` is true (no half-accumulated gradient is lost) and the groups
    are those of an uninterrupted run when the resume point is a multiple of ``steps``.

    >>> [accumulate(nn.Linear(1, 1), i, steps=4, total=6).sync for i in range(6)]
    [False, False, False, True, False, True]
    """
    if steps < 1 or step < 0 or (total is not None and not 0 <= step < total):
        raise ValueError(f"accumulate(step={step}, steps={steps}, total={total}): expected steps >= 1 and "
                         "0 <= step < total; pass the micro-step's index in this epoch (enumerate(loader)) and "
                         "total=len(loader)")
    start = step - step % steps
    end = start + steps if total is None else min(start + steps, total)
    return MicroStep(model, sync=step + 1 == end, size=end - start)


def prepare_model(model: nn.Module, *, sync_batchnorm: bool = True, check_sync_every: int | str = "auto",
                  heal: bool | str = False, comm: comm_options.CommConfig | None = None, shard: Shard = None,
                  shard_size: int | None = None, init_fn: meta.InitFn | None = None,
                  compile: bool | dict[str, Any] = False, forward_methods: Sequence[str] = (),
                  **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for the mode :func:`ddpkit.init` chose.

    - ``ddp``: BatchNorm layers become SyncBatchNorm (``sync_batchnorm=False`` opts out; ddpkit's works on
      CPU too), then DistributedDataParallel with ``ddp_kwargs`` (e.g. ``find_unused_parameters=True``;
      ignored in the other modes).
    - ``dp``: DataParallel over every visible GPU. Each replica computes BatchNorm statistics on its slice of
      the batch; running statistics are those of the GPU-0 replica (torch discards the others').
    - ``fsdp``: BatchNorm as in ddp, then FSDP2's ``fully_shard`` on each block and the root; ``shard`` picks
      the blocks (a parameter count, default 1M, or a list of classes: ``shard=[Block]``); ``ddp_kwargs`` go
      to ``fully_shard`` (e.g. ``mp_policy=MixedPrecisionPolicy(...)``). Build the optimizer afterwards.
    - ``hsdp``: as fsdp, sharded inside each group of ``shard_size`` consecutive ranks (default: one node's
      processes) and replicated across the groups (a 2-D mesh; ignored in the other modes).
    - ``single``: just the move.

    ``forward_methods``: methods of your class that run the layers in a training step, the loss taken from them
    (a normalising flow's ``loss = -model.log_probs(x).mean()``): in ddp each call runs as DDP's forward, so its
    gradients are averaged, as Lightning Fabric's ``mark_forward_method`` does. Call them on every rank, like
    ``model(x)``. In fsdp every method of your class runs as an FSDP forward already; ignored in dp and single.

    A model built inside :func:`ddpkit.init_empty` (meta device) is materialised here, in fsdp mode one shard
    per rank, by each module's ``reset_parameters`` or ``init_fn(module)``.

    The returned wrapper's ``state_dict()`` has no ``module.`` prefix and its ``load_state_dict`` accepts one.
    In DDP, a parameter that gets no gradient in the first backward is named in an error (pass
    ``find_unused_parameters=True``, or ``comm=CommConfig(static_graph=True)``, if that is intended), the
    first training step checks that all ranks hold the same weights (an init applied after ``prepare_model``
    under a per-rank seed would train a different model on each rank), and then the replicas' fingerprints are
    compared every few training steps (``check_sync_every='auto'``: as often as 0.1 % of the run's time allows;
    K: every K steps; 0: never); a rank that left the others is named with the step, the tensor and the likely
    cause, and ``heal=True`` copies the majority's weights and optimizer state to it instead (3 or more ranks;
    ``heal='rank0'``: rank 0's win a tie). Evaluation forwards, in ``model.eval()`` or ``torch.no_grad()``, and
    the steps inside ``ddpkit.join`` are not counted: their number differs between ranks. ``comm`` sets DDP's
    communication options (bucket size,
    compression, ...; see :class:`ddpkit.CommConfig`).

    ``compile=True`` (or a dict of ``torch.compile`` options) compiles the module in place, inside the
    wrapper (so state dicts keep their plain names): in fsdp block by block, as torch recommends. A model
    passed already compiled (``torch.compile(model)``) is taken apart, wrapped, and compiled again inside.
    """
    if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # compiled before: its wrapper
        model, compile = model._orig_mod, compile or True  # would hide DDP / FSDP from dynamo and add a prefix
    inner = prepared_inside(model)
    if inner:  # two wrappers nested would all-reduce the part twice and name its weights ``0.module.weight``
        warnings.warn(f"prepare_model(model): the model holds {', '.join(map(repr, inner))}, prepared already: "
                      "its plain module is put back in its place, and the whole model is prepared once (a part "
                      "trained alone first, then a model built around it)", stacklevel=2)
    lazy_refused(model)
    state = runtime.ensure_init()
    mode = state.strategy
    # each mode keeps the options it uses and ignores the others on purpose: the same script runs in every mode
    replicas.validate(check_sync_every, heal)  # before anything moves: a typo costs no wrap
    methods = redirect.validate(model, forward_methods)
    options = dict(sync_batchnorm=sync_batchnorm, check_sync_every=check_sync_every, heal=heal, comm=comm,
                   shard=shard, shard_size=shard_size, init_fn=init_fn, **ddp_kwargs)
    # move (a meta model: materialise, unless the mode shards it first), let the launching tool hook it, wrap
    wrapped = mode.prepare(model, state, options, runtime.tools())
    if methods and hasattr(wrapped, "forward_methods"):  # (ddp's wrapper: the calls it runs as its forward)
        wrapped.forward_methods = methods
    process.current().prepared += 1
    unprepared.watch(sharding=False)  # the first step says so when no ddpkit training loader fed it
    if compile:
        mode.compile(wrapped, {} if compile is True else dict(compile))
    phases.watch_model(wrapped, compiled=bool(compile))  # under ddpkit launch: where each step's time goes
    return wrapped


def lazy_refused(model: nn.Module) -> None:
    """A model with lazy layers (``nn.LazyLinear``) not sized yet is refused in every mode, in one line: DDP cannot
    wrap parameters that do not exist yet, nor FSDP shard them, nor the first step compare them across ranks.

    >>> lazy_refused(nn.Linear(2, 2))
    >>> try:
    ...     lazy_refused(nn.Sequential(nn.LazyLinear(3)))
    ... except ValueError as e:
    ...     print(str(e)[:60], "...", str(e)[-35:])
    prepare_model(model): 0.weight, 0.bias are lazy (nn.LazyLine ... build nn.Linear with its input size
    """
    lazy = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if nn.parameter.is_lazy(t)]
    if not lazy:
        return
    layer = type(model.get_submodule(lazy[0].rpartition(".")[0])).__name__  # (the first one's layer)
    shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
    plain = layer[4:] if layer.startswith("Lazy") else layer
    raise ValueError(f"prepare_model(model): {shown} are lazy (nn.{layer}, sized by the first forward), not sized "
                     "yet; expected a model whose parameters exist; run one forward on a sample batch before "
                     f"prepare_model (with torch.no_grad(): model(x)), or build nn.{plain} with its input size")


def prepared_inside(model: nn.Module) -> list[str]:
    """Put back the plain module of each submodule of ``model`` that is a DDP or ddpkit wrapper already (a backbone
    prepared and trained alone, then ``nn.Sequential(backbone, head)`` prepared; a base class's ``self.model``
    inside a subclass's): their names, [] when there are none.

    >>> prepared_inside(nn.Sequential(nn.Linear(2, 2)))
    []
    """
    found: list[str] = []
    for name, sub in list(model.named_modules()):
        if sub is model or not isinstance(sub, (DistributedDataParallel, ForwardsAttributes)) or \
                any(name.startswith(f"{done}.") for done in found):  # (inside one put back already)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent._modules[child] = unwrap(model.get_submodule(name))
        found.append(name)
    return found
