"""torch's wrappers as ddpkit uses them: DistributedDataParallel and DataParallel whose state dict is the plain
module's, with the checks and fixes described on each class, and :func:`unwrap`.

Example::

    >>> from torch import nn
    >>> lin = nn.Linear(2, 2)
    >>> unwrap(DP(lin)) is lin, list(DP(lin).state_dict())
    (True, ['weight', 'bias'])
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import JoinHook
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.nn.parallel._functions import Scatter

from ddpkit.core import process
from ddpkit.strategies import comm as comm_options
from ddpkit.strategies.consistency import FirstBackwardCheck, check_in_sync
from ddpkit.strategies.forwarding import ForwardsAttributes, fsdp_method, user_method
from ddpkit.strategies.syncbn import convert_sync_batchnorm, has_batchnorm


class _PlainStateDict(ForwardsAttributes):
    """Mixin: the wrapper saves and loads the wrapped module's state dict, with no ``module.`` prefix.

    ``load_state_dict`` also takes a dict saved from a wrapper by plain torch (keys ``module.*``). Names the
    wrapper lacks are the module's (:class:`ddpkit.strategies.forwarding.ForwardsAttributes`): ``model.init_hidden(4)``.
    """

    module: nn.Module  # set by the torch wrapper this is mixed into

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        state_dict = dict(state_dict)
        consume_prefix_in_state_dict_if_present(state_dict, "module.")
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


_LIVE_DDP: weakref.WeakSet[DDP] = weakref.WeakSet()


def _release_reducers() -> None:
    """At shutdown, free each DDP's reducer (which holds the process group) while Python is whole.

    Left to interpreter teardown, the gloo process group's destructor runs late and now and then hangs or
    aborts (SIGABRT) the process after training finished; a user's own ``destroy_process_group()`` does not
    help while a DDP model still references the group.
    """
    for model in list(_LIVE_DDP):
        for name in ("logger", "reducer"):
            model.__dict__.pop(name, None)
    _LIVE_DDP.clear()
    gc.collect()


class DDP(_PlainStateDict, DistributedDataParallel):
    """torch's DistributedDataParallel whose state dict is the plain module's.

    It also names, during the first backward, any parameter that got no gradient (instead of DDP's late
    "Expected to have finished reduction" error), and with ``check_sync_every=K`` compares parameter
    checksums across ranks every K training steps.

    A training step is a forward in training mode with gradients enabled, outside a join (:meth:`join`,
    :func:`ddpkit.join` or torch's own ``Join([model])``): evaluation forwards (``model.eval()`` or
    ``torch.no_grad()``) and the uneven steps of a join differ in number between ranks by design, so a check
    there would meet no peer (one rank in the checksums' all_gather, another in DDP's all-reduce or already
    past its loop).
    """

    refuses_layer_writes = True  # ForwardsAttributes: the reducer knows the layers of prepare time only

    def __init__(self, module: nn.Module, *args: Any, check_sync_every: int = 0, **kwargs: Any):
        super().__init__(module, *args, **kwargs)
        # every time, not only for the first DDP: a worker forked from a kernel that held DDP models starts with
        # fresh shutdown hooks (process.reset) but the kernel's _LIVE_DDP; on_shutdown keeps one copy
        process.on_shutdown(_release_reducers, always=True)
        _LIVE_DDP.add(self)
        self._check_sync_every = check_sync_every
        self._training_steps = 0  # counted alike on every rank: see the class docstring
        self._joined = False  # inside a join: from join_hook() (every Join asks for it) to its post-hook
        # static_graph: DDP itself finds, in the first iteration, the parameters that never get a gradient
        if not (kwargs.get("find_unused_parameters", False) or kwargs.get("static_graph", False)):
            self._first_backward = FirstBackwardCheck(module)
        # a method called this way (model.init_hidden) runs on the local module, outside DDP's forward: right for
        # set-up and inference; a loss from it is all-reduced only when a forward through DDP ran this step
        self.start_forwarding()

    def __getstate__(self) -> dict[str, Any]:
        # copy / pickle: forwarding starts again only after DDP's __setstate__ has set its own attributes
        # (logger, reducer), which would otherwise land in the user's module when it has such a name
        state = dict(super().__getstate__())
        state.pop("_forwarding", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__["_forwarding"] = True

    # Not traced by torch.compile (only this frame: the module inside is compiled as usual, with DDP's bucket
    # splitting): the checks and the heartbeat are Python side effects that would break the graph every step.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any):
        # a Join(enable=False) that was left asks nothing of the ranks: checks run there
        joined = self._joined and self._join_config.enable
        if self._check_sync_every and self.training and torch.is_grad_enabled() and not joined:
            if self._training_steps % self._check_sync_every == 0:
                check_in_sync(self.module, self.process_group)
            self._training_steps += 1
        process.heartbeat()
        return super().forward(*args, **kwargs)

    def join(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        """torch's ``join`` (what :func:`ddpkit.join` enters), with the sync checks paused inside."""
        return self._without_checks(super().join(*args, **kwargs))

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's hook, which every ``Join`` (torch's own ``Join([model])`` too) asks for as it is made: the
        checks pause from here until the hook's post-hook, which every rank runs once all have joined."""
        self._joined = True
        return _ResumeChecks(super().join_hook(**kwargs), self)

    @contextlib.contextmanager
    def _without_checks(self, context: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        try:
            with context:
                yield
        finally:  # also when the loop raised, and torch's Join skipped the post-hook
            self._joined = False


class _ResumeChecks(JoinHook):
    """DDP's join hook, resuming ``model``'s sync checks in its post-hook (the join ended on every rank)."""

    def __init__(self, hook: JoinHook, model: DDP):
        self.hook, self.model = hook, model

    def main_hook(self) -> None:
        self.hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.hook.post_hook(is_last_joiner)
        self.model._joined = False


def balanced_split(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` slices of a batch of ``total`` that differ by at most one.

    torch's ``chunk`` splits 29 samples over 8 GPUs as [4, 4, 4, 4, 4, 4, 4, 1]: a 1-sample replica, which
    BatchNorm refuses in training ("Expected more than 1 value per channel").

    >>> balanced_split(29, 8), balanced_split(3, 2)
    ([4, 4, 4, 4, 4, 3, 3, 3], [2, 1])
    """
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def in_caller_autocast(calls: Sequence[Any], device_type: str) -> list[Any]:
    """Wrap callables so that each runs under the *calling* thread's autocast dtype, in whatever thread.

    Autocast state is per thread. torch's ``parallel_apply`` re-enters autocast in each replica thread with
    ``enabled=`` only, so the replicas take the device's default dtype (fp16 on CUDA) even inside
    ``autocast("bf16")``: fp16 math with no GradScaler. Returns the callables unchanged outside autocast.
    """
    if not torch.is_autocast_enabled(device_type):
        return list(calls)
    dtype = torch.get_autocast_dtype(device_type)

    def bind(call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return call(*args, **kwargs)
        return run

    return [bind(call) for call in calls]


def _batch_size(obj: Any, dim: int) -> int | None:
    """Size along ``dim`` of the first tensor in a (nested) forward input."""
    if isinstance(obj, torch.Tensor):
        return obj.shape[dim] if obj.dim() > dim else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return next((size for item in items if (size := _batch_size(item, dim)) is not None), None)


def _scatter(obj: Any, devices: list[int], sizes: list[int], dim: int) -> list[Any]:
    """torch's scatter of a nested input, with the given chunk sizes for tensors of the batch's size."""
    if isinstance(obj, torch.Tensor):
        fits = obj.dim() > dim and obj.shape[dim] == sum(sizes)
        return list(Scatter.apply(devices, sizes if fits else None, dim, obj))
    if isinstance(obj, tuple) and obj:
        slices = zip(*(_scatter(o, devices, sizes, dim) for o in obj))
        return [type(obj)(*parts) if hasattr(obj, "_fields") else tuple(parts) for parts in slices]
    if isinstance(obj, list) and obj:
        return [list(parts) for parts in zip(*(_scatter(o, devices, sizes, dim) for o in obj))]
    if isinstance(obj, dict) and obj:
        columns = [_scatter(v, devices, sizes, dim) for v in obj.values()]
        return [type(obj)(zip(obj.keys(), parts)) for parts in zip(*columns)]
    return [obj for _ in devices]


class DP(_PlainStateDict, DataParallel):
    """torch's DataParallel whose state dict is the plain module's, with two fixes.

    Each replica runs under the caller's autocast dtype (bf16 stays bf16), and batches are split into
    slices that differ by at most one sample; a training batch smaller than the GPU count is an error.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.start_forwarding()  # a method called this way runs on the GPU-0 module, without replicas

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[Any]) -> Any:
        size = _batch_size((inputs, kwargs), self.dim)
        if size is None:
            return super().scatter(inputs, kwargs, device_ids)
        if self.training and size < len(device_ids):
            raise ValueError(f"a training batch of {size} sample(s) cannot be split over {len(device_ids)} GPUs "
                             "(DataParallel gives each at least one; BatchNorm needs two); use a batch of at "
                             f"least {2 * len(device_ids)}, or drop_last=True in the DataLoader")
        sizes = balanced_split(size, min(size, len(device_ids)))
        devices = [int(d) for d in device_ids[: len(sizes)]]
        scattered_inputs = _scatter(tuple(inputs), devices, sizes, self.dim) if inputs else [() for _ in devices]
        scattered_kwargs = _scatter(kwargs, devices, sizes, self.dim) if kwargs else [{} for _ in devices]
        return tuple(scattered_inputs), tuple(scattered_kwargs)

    def parallel_apply(self, replicas: Sequence[Any], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        return super().parallel_apply(in_caller_autocast(replicas, "cuda"), inputs, kwargs)


class FSDP(ForwardsAttributes, nn.Module):
    """The root of a model sharded by FSDP2's ``fully_shard``, whose state dict is the full, plain one.

    ``state_dict()`` all-gathers each sharded tensor (call it on every rank: it is collective) and
    ``load_state_dict`` takes a full state dict (from any mode) and keeps this rank's slices. For models too
    big to gather, :class:`ddpkit.Checkpointer` saves shards instead. ``model.decode(z)`` runs the module's
    method as an FSDP forward (:func:`ddpkit.strategies.forwarding.fsdp_method`): call it on every rank, like
    ``model(x)``.
    """

    refuses_layer_writes = True  # ForwardsAttributes: the shards are the layers of prepare time only

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._forward_methods: dict[str, Any] = {}
        self.start_forwarding()

    def _forwarded(self, inner: nn.Module, name: str, value: Any) -> Any:
        return fsdp_method(inner, name, self._forward_methods) if user_method(inner, name, value) else value

    def forward(self, *args: Any, **kwargs: Any):
        process.heartbeat()
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled():
            # FSDP2 keeps the root gathered after a forward, for the backward; with none coming (evaluation, a
            # sanity check before the optimizer is built) model.parameters() would stay the whole copies, and
            # an optimizer built from them would train nothing
            self.module.reshard()  # type: ignore[operator]  # FSDPModule.reshard
        return out

    def state_dict(self, *args: Any, **kwargs: Any):
        from torch.distributed.tensor import DTensor

        local = self.module.state_dict(*args, **kwargs)
        for key, value in local.items():  # the same keys in the same order on every rank: one gather each
            if isinstance(value, DTensor):
                local[key] = value.full_tensor()
        return local

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state_dict = dict(state_dict)
        consume_prefix_in_state_dict_if_present(state_dict, "module.")
        return set_model_state_dict(self.module, state_dict,
                                    options=StateDictOptions(full_state_dict=True, strict=strict))


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under any DDP / DataParallel / FSDP / ``torch.compile`` wrappers.

    In fsdp mode that module holds this rank's shards (DTensor parameters).

    >>> lin = nn.Linear(2, 2)
    >>> unwrap(DataParallel(lin)) is lin
    True
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel, FSDP)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def sync_batchnorms(model: nn.Module, state: process.State) -> nn.Module:
    """BatchNorm layers -> synchronised ones (statistics over the global batch), said once; ddp and fsdp."""
    if not has_batchnorm(model):
        return model
    if state.is_main:
        print("ddpkit: BatchNorm -> SyncBatchNorm (statistics over the global batch)", file=sys.stderr, flush=True)
    return convert_sync_batchnorm(model, state.device)


def wrap_ddp(model: nn.Module, state: process.State, *, sync_batchnorm: bool = True, check_sync_every: int = 0,
             comm: comm_options.CommConfig | None = None, tools: Any = None, **ddp_kwargs: Any) -> nn.Module:
    """SyncBatchNorm (unless ``sync_batchnorm=False``), then :class:`DDP` with the communication options."""
    if sync_batchnorm:
        model = sync_batchnorms(model, state)
    device_ids = [state.device.index] if state.device.type == "cuda" else None
    comm = tools.comm_config(comm) if tools else comm
    if comm is not None:
        ddp_kwargs = {**comm.ddp_kwargs(), **ddp_kwargs}
    wrapped = DDP(model, device_ids=device_ids, check_sync_every=check_sync_every, **ddp_kwargs)
    if not (tools and tools.on_ddp(wrapped)) and comm is not None:
        comm_options.register(wrapped, comm, state.backend or "gloo")
    return wrapped
