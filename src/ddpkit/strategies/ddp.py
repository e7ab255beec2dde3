"""Mode ``ddp``: one process per device, gradients all-reduced during backward (DistributedDataParallel;
the wrapper class is :class:`ddpkit.strategies.ddp_wrapper.DDP`).

Example::

    >>> DDPStrategy().options({"check_sync_every": 50, "shard": 8, "static_graph": True})  # doctest: +ELLIPSIS
    DDPOptions(init_fn=None, sync_batchnorm=True, check_sync_every=50, heal=False, ..., ddp_kwargs={...})

Torch-free at module level, like every table entry (``ddpkit launch`` reads the table before it loads
torch): the wrapper, a subclass of torch's, lives in ``ddp_wrapper.py`` and is imported when a model is wrapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from ddpkit.core.environment import LaunchEnvError, ProcessEnv
from ddpkit.strategies.base import Options, Strategy, per_epoch

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


@dataclasses.dataclass(frozen=True)
class DDPOptions(Options):
    """``sync_batchnorm``: BatchNorm -> SyncBatchNorm first; ``check_sync_every``: compare the replicas'
    fingerprints every K training steps ('auto': as often as 0.1 % of the time allows; 0: never); ``heal``: copy
    the majority's weights to a rank that left it (True) or rank 0's on a tie ('rank0'); ``comm``: a
    :class:`ddpkit.CommConfig`; ``ddp_kwargs``: DistributedDataParallel's own
    (``find_unused_parameters=True``)."""

    kwargs_field = "ddp_kwargs"
    sync_batchnorm: bool = True
    check_sync_every: int | str = "auto"
    heal: bool | str = False
    comm: Any = None  # a ddpkit.strategies.comm.CommConfig (a torch module: not imported here)
    ddp_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class DDPStrategy(Strategy):
    """One process per device; gradients all-reduced during backward (DistributedDataParallel)."""

    name = "ddp"
    title = "DistributedDataParallel"
    multi_process = True
    options_type: ClassVar[type[Options]] = DDPOptions

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

    def wrap(self, model: nn.Module, state: Any, **given: Any) -> nn.Module:
        """SyncBatchNorm (unless ``sync_batchnorm=False``), then :class:`DDP` with the communication options
        (the launching tool may replace them, or install its own communication hook)."""
        options, tools = self.options(given), given.get("tools")
        from ddpkit.strategies import comm as comm_options
        from ddpkit.strategies.ddp_wrapper import DDP
        from ddpkit.strategies.frozen import frozen, prepare_frozen
        from ddpkit.strategies.syncbn import sync_batchnorms
        from ddpkit.strategies.unbatched import watch

        watch(model, state.world_size)  # (an LSTM fed (batch, features) rows: one sequence, split across ranks)
        if frozen(model):  # a target or teacher network: no gradient to average, and torch's DDP refuses it
            return prepare_frozen(model, state, options.sync_batchnorm)
        if options.sync_batchnorm:
            model = sync_batchnorms(model, state)
        device_ids = [state.device.index] if state.device.type == "cuda" else None
        comm = tools.comm_config(options.comm) if tools else options.comm
        ddp_kwargs = dict(options.ddp_kwargs)
        if comm is not None:
            ddp_kwargs = {**comm.ddp_kwargs(), **ddp_kwargs}
        wrapped = DDP(model, device_ids=device_ids, check_sync_every=options.check_sync_every,
                      heal=options.heal, **ddp_kwargs)
        if tools and tools.on_ddp(wrapped):
            wrapped._replicas.every = 0  # the tool's own hook may sync nothing (bench's compute-only timing run)
        elif comm is not None:
            comm_options.register(wrapped, comm, state.backend or "gloo")
        return wrapped

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        if model.static_graph and not getattr(model, "_static_graph_delay_allreduce_enqueued", True):
            # static_graph records the graph in its first backward, which must all-reduce (torch's reducer
            # asserts inside no_sync then): that one micro-batch syncs. The step's result is the same: an
            # averaged gradient, equal on every rank, stays itself when the last micro-batch averages again
            return contextlib.nullcontext()
        return model.no_sync()

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
                f"{state.world_size} processes, {per_epoch(steps)}")
