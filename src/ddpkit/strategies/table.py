"""Parallel modes as one table: each mode is a small object, and every question whose answer depends on the
mode asks it (device, backend, how to wrap the model, ``no_sync``, ``join``, each process's share of the
batch, the checkpoint's CUDA generators, the full state dict to save).

single / dp / ddp are the built-in entries. Another mode is one :class:`Strategy` subclass, made known with
:func:`register`, or from another package through the ``ddpkit.strategies`` entry point group (so the
launcher and every worker find it without an import in the script).

Example::

    >>> sorted(STRATEGIES)
    ['ddp', 'dp', 'fsdp', 'single']
    >>> get("ddp").multi_process, get("dp").min_gpus
    (True, 2)

Nothing here imports torch at module level: ``ddpkit launch`` reads the table before it needs torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ddpkit.core.environment import LaunchEnvError, ProcessEnv, visible_gpus

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

ENTRY_POINTS = "ddpkit.strategies"


class Strategy:
    """The single-device answers; subclasses override what their mode changes."""

    name: ClassVar[str] = "single"
    title: ClassVar[str] = "single device"  # how the start-up line names the mode
    multi_process: ClassVar[bool] = False  # one process per device, in a process group
    min_gpus: ClassVar[int] = 0  # with fewer usable GPUs the mode falls back to single
    shards: ClassVar[bool] = False  # wrap() shards the model (and materialises a meta one, one shard per rank)
    collective_forward: ClassVar[bool] = False  # every forward needs every rank (eval loaders then pad with empties)

    def device(self, env: ProcessEnv, gpus: int) -> torch.device:
        import torch

        return torch.device("cuda", 0) if gpus else torch.device("cpu")

    def backend(self, device: torch.device) -> str | None:
        """The process-group backend; None: no group."""
        return None

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        """``model`` is on the device already; options: sync_batchnorm, check_sync_every, comm, tools, ddp_kwargs."""
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def compile(self, model: nn.Module, options: dict[str, Any]) -> None:
        """``torch.compile`` the wrapped module in place (``nn.Module.compile``): the wrapper, its hooks and the
        state-dict names stay as they are."""
        from ddpkit.strategies.wrappers import unwrap

        unwrap(model).compile(**options)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def batch_share(self, state: Any) -> int:
        """How many processes share one global batch (``batch_size`` is per process)."""
        return 1

    def describe_batch(self, state: Any, batch_size: int, steps: int | None) -> str:
        """The start-up line about the batch; ``steps`` None: a stream, whose length nobody knows up front."""
        return f"global batch {batch_size} (one process), {_per_epoch(steps)}"

    def cuda_rng_devices(self, current: int, count: int) -> list[int]:
        """The GPUs whose generators a checkpoint keeps."""
        return [current]

    def state_bytes(self, params: int, largest_block: int, world_size: int, slots: int) -> int:
        """Training state one process holds, in elements: parameters, gradients, ``slots`` optimizer tensors
        per parameter (Adam: 2, SGD with momentum: 1)."""
        return params * (2 + slots)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's full state dict, as a checkpoint saves it (plain names, no wrapper prefix)."""
        from ddpkit.strategies.wrappers import unwrap

        return unwrap(model).state_dict()


class DataParallel(Strategy):
    """One process drives every visible GPU through ``torch.nn.DataParallel``."""

    name = "dp"
    title = "DataParallel"
    min_gpus = 2

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        from ddpkit.strategies.wrappers import DP

        return DP(model)

    def describe_batch(self, state: Any, batch_size: int, steps: int | None) -> str:
        gpus = visible_gpus()
        return f"global batch {batch_size}, split by DataParallel across {gpus} GPUs, {_per_epoch(steps)}"

    def cuda_rng_devices(self, current: int, count: int) -> list[int]:
        return list(range(count))  # dropout runs in a replica on every GPU


class Distributed(Strategy):
    """One process per device; gradients all-reduced during backward (DistributedDataParallel)."""

    name = "ddp"
    title = "DistributedDataParallel"
    multi_process = True

    def device(self, env: ProcessEnv, gpus: int) -> torch.device:
        import torch

        if gpus <= 1:  # no GPU, or one GPU per process (Slurm --gpus-per-task=1, MPI wrappers): it is ours
            return super().device(env, gpus)
        if env.local_rank >= gpus:
            raise LaunchEnvError(
                f"local rank {env.local_rank} has no GPU of its own: {gpus} visible; start at most "
                f"{gpus} processes per node (--nproc-per-node {gpus}) or run on the CPU (--device cpu)")
        return torch.device("cuda", env.local_rank)

    def backend(self, device: torch.device) -> str | None:
        return "nccl" if device.type == "cuda" else "gloo"

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        from ddpkit.strategies.wrappers import wrap_ddp

        return wrap_ddp(model, state, **options)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        from torch.nn.parallel import DistributedDataParallel

        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        from torch.nn import SyncBatchNorm as TorchSyncBatchNorm
        from torch.nn.parallel import DistributedDataParallel

        from ddpkit.strategies.syncbn import SyncBatchNorm

        if not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        if any(isinstance(m, (TorchSyncBatchNorm, SyncBatchNorm)) for m in model.modules()):
            raise ValueError("ddpkit.join cannot run with SyncBatchNorm (collectives in forward would hang); "
                             "prepare_model(..., sync_batchnorm=False) or data_loader(..., uneven='pad')")
        return model.join()

    def batch_share(self, state: Any) -> int:
        return state.world_size

    def state_bytes(self, params: int, largest_block: int, world_size: int, slots: int) -> int:
        return params * (3 + slots)  # + the reducer's gradient buckets

    def describe_batch(self, state: Any, batch_size: int, steps: int | None) -> str:
        return (f"global batch {batch_size * state.world_size} = {batch_size} per process x "
                f"{state.world_size} processes, {_per_epoch(steps)}")


class Sharded(Distributed):
    """One process per device; parameters, gradients and optimizer state sharded (FSDP2 ``fully_shard``)."""

    name = "fsdp"
    title = "FullyShardedDataParallel (FSDP2)"
    shards = True
    collective_forward = True

    def wrap(self, model: nn.Module, state: Any, **options: Any) -> nn.Module:
        from ddpkit.strategies import sharded
        for unused in ("check_sync_every", "comm", "tools"):  # DDP's: the replicas they check do not exist here
            options.pop(unused, None)
        return sharded.wrap(model, state, **options)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        from ddpkit.strategies import sharded
        return sharded.no_sync(model)

    def compile(self, model: nn.Module, options: dict[str, Any]) -> None:
        """Each sharded block on its own (torch's advice for FSDP2: all-gathers stay outside the graphs); the
        root only when it is the one group."""
        from torch.distributed.fsdp import FSDPModule

        from ddpkit.strategies.wrappers import unwrap

        root = unwrap(model)
        blocks: list[nn.Module] = [m for m in root.modules() if isinstance(m, FSDPModule) and m is not root]
        for block in blocks or [root]:
            block.compile(**options)

    def join(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        raise ValueError("ddpkit.join cannot run in fsdp mode (every forward gathers parameters from all ranks, "
                         "so a rank that finished early would hang the others); use "
                         "data_loader(..., uneven='pad') or 'drop'")

    def state_bytes(self, params: int, largest_block: int, world_size: int, slots: int) -> int:
        # this rank's shards, plus one block gathered whole with its unsharded gradient during backward
        return -(-params // world_size) * (2 + slots) + 2 * largest_block

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        return model.state_dict()  # ddpkit's FSDP wrapper gathers the full tensors (collective)


def _per_epoch(steps: int | None) -> str:
    return f"{steps} steps/epoch" if steps is not None else "a stream (an epoch ends when the first rank runs dry)"


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Strategy(), DataParallel(), Distributed(), Sharded())}


def register(strategy: Strategy) -> Strategy:
    """Add (or replace) a mode; returns it. ``auto`` is not a mode name: it chooses among them."""
    if not strategy.name or strategy.name == "auto":
        raise ValueError(f"a strategy needs a name other than 'auto', got {strategy.name!r}")
    STRATEGIES[strategy.name] = strategy
    return strategy


def get(name: str, error: Callable[[str], Exception] = ValueError) -> Strategy:
    """The mode called ``name``, looking in installed packages' entry points for names not built in."""
    if name not in STRATEGIES:
        from importlib.metadata import entry_points

        for point in entry_points(group=ENTRY_POINTS, name=name):
            register(point.load()())
    if name not in STRATEGIES:
        raise error(f"mode {name!r} is not one of auto, {', '.join(sorted(STRATEGIES))}; "
                    "pass one of them (or omit it for auto)")
    return STRATEGIES[name]
