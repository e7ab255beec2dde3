"""The mode object every mode is: :class:`Strategy`, whose answers are the single-device ones (it *is* the
``single`` mode), and :class:`Options`, what a mode takes from ``prepare_model``'s keyword arguments.

A mode answers every question whose answer depends on the mode: device, backend, how to prepare the model
(:meth:`Strategy.prepare`: move or materialise, the tool hooks, :meth:`Strategy.wrap`), ``no_sync``, ``join``,
each process's share of the batch, the checkpoint's CUDA generators, the full state dict to save.

Example::

    >>> Strategy().options({"init_fn": print, "check_sync_every": 4, "find_unused_parameters": True})
    Options(init_fn=<built-in function print>)

Torch-free at module level (torch is imported inside the methods that need it): ``ddpkit launch`` reads the
table of modes before it loads torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ddpkit.core import process
from ddpkit.core.environment import ProcessEnv

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


# prepare_model's own keyword arguments (and the tools): any other keyword is the wrapper's (``**ddp_kwargs``)
NAMED = frozenset({"sync_batchnorm", "check_sync_every", "heal", "comm", "shard", "shard_size", "init_fn", "tools"})


@dataclasses.dataclass(frozen=True)
class Options:
    """What every mode takes from ``prepare_model``: ``init_fn(module)`` initialises a model built inside
    ``ddpkit.init_empty()`` (after each module's ``reset_parameters``). A mode with more says so in a subclass;
    the keywords that are none of prepare_model's own (``**ddp_kwargs``) go to the field named ``kwargs_field``,
    if it has one."""

    kwargs_field: ClassVar[str | None] = None
    init_fn: Any = None

    @classmethod
    def build(cls, given: Mapping[str, Any]) -> Options:
        """The fields this mode has, from ``prepare_model``'s flat keywords; the rest is ignored on purpose: the
        same script (with ``check_sync_every=`` or ``shard=``) runs in every mode."""
        # a keyword spelled like the kwargs field (prepare_model(net, ddp_kwargs={...})) is the wrapper's, which
        # refuses it as before, not the field: the field holds the keywords prepare_model does not name
        names = {f.name for f in dataclasses.fields(cls)} - {cls.kwargs_field}
        kept = {name: value for name, value in given.items() if name in names}
        if cls.kwargs_field is not None:
            kept[cls.kwargs_field] = {k: v for k, v in given.items() if k not in names and k not in NAMED}
        return cls(**kept)


class Strategy:
    """The single-device answers; subclasses override what their mode changes."""

    name: ClassVar[str] = "single"
    title: ClassVar[str] = "single device"  # how the start-up line names the mode
    multi_process: ClassVar[bool] = False  # one process per device, in a process group
    min_gpus: ClassVar[int] = 0  # with fewer usable GPUs the mode falls back to single
    shards: ClassVar[bool] = False  # each rank holds a shard of the model (checkpoints are saved sharded)
    collective_forward: ClassVar[bool] = False  # every forward needs every rank (eval loaders then pad with empties)
    options_type: ClassVar[type[Options]] = Options  # what wrap() is handed

    def device(self, env: ProcessEnv, gpus: int) -> torch.device:
        import torch

        return torch.device("cuda", 0) if gpus else torch.device("cpu")

    def backend(self, device: torch.device) -> str | None:
        """The process-group backend; None: no group."""
        return None

    def options(self, given: Mapping[str, Any]) -> Any:
        """This mode's typed :class:`Options` from ``prepare_model``'s flat keyword arguments."""
        return self.options_type.build(given)

    def prepare(self, model: nn.Module, state: Any, options: Mapping[str, Any], tools: Any) -> nn.Module:
        """In this order: move ``model`` to the device (a meta model: materialise it there, by each module's
        ``reset_parameters`` then ``init_fn``; a mode that ``shards`` materialises inside its wrap, one shard per
        rank), let the launching tool hook the plain model, wrap; a model materialised by the wrap is hooked
        after it, on every rank (its full state dict is a collective).

        ``options`` are prepare_model's keywords, flat; :meth:`wrap` gets them so (with ``tools=``), ``shard``,
        ``shard_size`` and ``init_fn`` only in a mode that shards, as ever: a mode of another package written for
        ``wrap(model, state, **options)`` keeps working. Each built-in mode reads them through its typed
        :class:`Options` (:meth:`options`)."""
        from ddpkit.strategies.meta import materialize, on_meta

        empty = on_meta(model)
        if tools.place(model, state.device, options):  # a tool's stand-in (ddpkit plan's fake tensors)
            empty = False
        elif not empty:
            model = model.to(state.device)
        elif not self.shards:
            materialize(model, state.device, options.get("init_fn"))
            empty = False
        if not empty:
            tools.on_model(model, state.is_main, process.on_shutdown)
        passed = dict(options) if self.shards else {k: v for k, v in options.items()
                                                    if k not in ("shard", "shard_size", "init_fn")}
        wrapped = self.wrap(model, state, tools=tools, **passed)
        if empty:
            tools.on_model(wrapped, state.is_main, process.on_shutdown)
        return wrapped

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        """``model`` is on the device already (a meta model, in a mode that shards); ``options``: prepare_model's
        keywords (``sync_batchnorm``, ``check_sync_every``, ``comm``, the wrapper's own, and ``shard``,
        ``init_fn`` in a mode that shards) and ``tools``, the launching command's hooks (``ddpkit verify``,
        ``bench``). The built-in modes read them as their :class:`Options`: ``self.options(options)``."""
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def compile(self, model: nn.Module, options: dict[str, Any]) -> None:
        """``torch.compile`` the wrapped module in place (``nn.Module.compile``): the wrapper, its hooks and the
        state-dict names stay as they are."""
        from ddpkit.strategies.forwarding import unwrap

        unwrap(model).compile(**options)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def batch_share(self, state: Any) -> int:
        """How many processes share one global batch (``batch_size`` is per process)."""
        return 1

    def describe_batch(self, state: Any, batch_size: int, steps: int | None) -> str:
        """The start-up line about the batch; ``steps`` None: a stream, whose length nobody knows up front."""
        return f"global batch {batch_size} (one process), {per_epoch(steps)}"

    def cuda_rng_devices(self, current: int, count: int) -> list[int]:
        """The GPUs whose generators a checkpoint keeps."""
        return [current]

    def shard_group_size(self, state: Any, shard_size: int | None = None) -> int:
        """How many processes share one copy of the model's state (a mode that shards splits it that many ways;
        hsdp: ``shard_size``, by default one node's processes); :meth:`state_bytes` gets it as ``world_size``."""
        return int(state.world_size)

    def state_bytes(self, params: int, largest_block: int, world_size: int, slots: int) -> int:
        """Training state one process holds, in elements: parameters, gradients, ``slots`` optimizer tensors
        per parameter (Adam: 2, SGD with momentum: 1)."""
        return params * (2 + slots)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's full state dict, as a checkpoint saves it (plain names, no wrapper prefix)."""
        from ddpkit.strategies.forwarding import unwrap

        return unwrap(model).state_dict()


def per_epoch(steps: int | None) -> str:
    return f"{steps} steps/epoch" if steps is not None else "a stream (an epoch ends when the first rank runs dry)"
