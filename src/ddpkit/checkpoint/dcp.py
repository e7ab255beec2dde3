"""Sharded checkpoints: models and optimizer state written by every rank through torch.distributed.checkpoint.

In a sharding mode (fsdp) :class:`ddpkit.Checkpointer` keeps ``ckpt-<step>/shards/`` (torch's DCP format:
one ``__<rank>_0.distcp`` per rank plus ``.metadata``) beside ``state.pt`` (step, RNG, loaders, schedulers,
the optimizers' ``param_groups``). Only tensors go into the shards, so nothing there is unpickled but DCP's
``.metadata``, which :class:`SafeReader` reads with an allow-list of torch's own metadata classes. DCP
reshards on load, so a checkpoint saved by 2 processes resumes on 3, or on one (no process group).

:func:`full_model_state` reads one plain state dict of a model from either format (``ddpkit consolidate``,
:mod:`ddpkit.commands.consolidate`, writes it to a file).

Example::

    state = full_model_state("runs/exp/ckpt-0000000100")     # no process group needed
    model.load_state_dict(state)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint import bounds, safeload
from ddpkit.checkpoint.reasons import PeerWriteError
from ddpkit.core.errors import UsageError, first_line
from ddpkit.strategies.forwarding import unwrap

SHARDS = "shards"  # the DCP directory inside a checkpoint

def _owner(optimizer: torch.optim.Optimizer, models: Mapping[str, nn.Module]) -> nn.Module:
    """The model whose parameters ``optimizer`` trains (the state dict names them by its FQNs)."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    for model in models.values():
        if any(p is first for p in model.parameters()):
            return unwrap(model)
    raise ValueError(f"{type(optimizer).__name__} trains no parameter of the models passed with it "
                     f"({', '.join(models) or 'none'}); pass its model to the same save/restore call")


def split(objects: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for the shards, the rest) of ``objects``' state dicts; collective in a sharded mode.

    The models' and optimizers' (collective) come first, the other objects' (local) last: one of those failing
    on one rank then leaves no peer inside a collective, and the ranks can agree on the failure."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    models = {k: v for k, v in objects.items() if isinstance(v, nn.Module)}
    tensors: dict[str, Any] = {k: get_model_state_dict(unwrap(m)) for k, m in models.items()}
    rest: dict[str, Any] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            state = get_optimizer_state_dict(_owner(obj, models), obj)
            tensors[name] = state["state"]
            rest[name] = {"param_groups": state["param_groups"]}
    for name, obj in objects.items():
        if name not in models and name not in tensors:
            rest[name] = obj.state_dict()
    return {k: tensors[k] for k in objects if k in tensors}, {k: rest[k] for k in objects if k in rest}


def save(tensors: dict[str, Any], directory: str) -> None:
    """Every rank writes its shard (fsynced) into ``directory``; rank 0 adds ``.metadata`` last.
    A failed write raises OSError on every rank, naming the rank and its error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
    except CheckpointException as exc:  # a BaseException: `except Exception` would let it through
        raise write_error(exc) from None


def write_error(exc: Any) -> ShardWriteError:
    """DCP's CheckpointException of a save as one line naming the first rank whose part failed."""
    rank, failure = min(exc.failures.items())
    error: Any = failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack) in torch 2.x
    return ShardWriteError(rank, f"{type(error).__name__}: {first_line(error, 160)}",
                           io=isinstance(error, OSError))


class ShardWriteError(PeerWriteError):
    """One rank's shard could not be written; raised on every rank, naming that rank (``failed_rank``);
    ``io``: that rank's error was an OSError (a full disk), not a programming error.

    >>> str(ShardWriteError(1, "OSError: [Errno 28] No space left on device"))
    'rank 1: OSError: [Errno 28] No space left on device'
    """


def load(objects: Mapping[str, Any], directory: str, rest: Mapping[str, Any],
         verify: Callable[[list[str]], str | None] | None = None) -> None:
    """Load a sharded checkpoint into ``objects`` (any mode, any world size: DCP reshards); ``verify``: checks
    the files of ``directory`` this rank reads before it reads them (:func:`safeload.reader`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    models = {k: v for k, v in objects.items() if isinstance(v, nn.Module)}
    optimizers = {k: v for k, v in objects.items() if isinstance(v, torch.optim.Optimizer)}
    targets: dict[str, Any] = {k: get_model_state_dict(unwrap(m)) for k, m in models.items()}
    owners = {k: _owner(o, models) for k, o in optimizers.items()}
    targets.update({k: get_optimizer_state_dict(owners[k], o)["state"] for k, o in optimizers.items()})
    checked = safeload.read_metadata(directory)  # refused here, on every rank, before DCP plans anything
    try:
        dcp.load(targets, storage_reader=safeload.reader(directory, checked, verify), planner=safeload.planner())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException (a BaseException) carries every rank's traceback
        raise _read_error(exc, os.path.dirname(directory), "does not fit these objects") from None
    for name, model in models.items():
        set_model_state_dict(unwrap(model), targets[name])
    for name, optimizer in optimizers.items():
        state = {"state": targets[name], "param_groups": rest[name]["param_groups"]}
        set_optimizer_state_dict(owners[name], optimizer, state)


def _read_error(exc: BaseException, checkpoint: str, verdict: str) -> Exception:
    """One line of a documented class for a failed read of shards: a refusal as it is, an OSError (the disk) as
    one, anything else (a damaged shard file, another model's checkpoint) a ValueError."""
    cause = _cause(exc)
    if isinstance(cause, safeload.UnsafeCheckpoint):
        return safeload.UnsafeCheckpoint(f"checkpoint {checkpoint}: {cause}")
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    said = next((line for line in lines if "Missing key" in line or "Error" in line), lines[0] if lines else "")
    if isinstance(cause, OSError):
        return OSError(cause.errno, f"checkpoint {checkpoint}: its shards cannot be read: {said[:300]}")
    return ValueError(f"checkpoint {checkpoint} {verdict}: {type(cause).__name__}: {said[:300]} (a damaged shard "
                      "file, or a checkpoint saved from another model or configuration?)")


def _cause(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else ``exc``)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    failure = failures[min(failures)]
    return failure[0] if isinstance(failure, tuple) else failure  # (exception, its stack) in torch 2.x


def full_model_state(checkpoint: str, name: str = "model") -> dict[str, torch.Tensor]:
    """The plain, whole state dict of object ``name`` in a checkpoint of either format (no process group)."""
    shards = os.path.join(checkpoint, SHARDS)
    if not os.path.isdir(shards):
        payload = bounds.load_state(checkpoint)
        if name not in payload["objects"]:
            raise UsageError(f"{checkpoint} has no {name!r} (it has {sorted(payload['objects'])}); pass --name")
        return _model_state(checkpoint, name, payload["objects"][name], payload["objects"])
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    everything: dict[str, Any] = {}
    checked = safeload.read_metadata(shards)
    try:
        _load_state_dict(everything, storage_reader=safeload.reader(shards, checked),
                         planner=safeload.planner(empty=True), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise _read_error(exc, checkpoint, "cannot be read") from None
    if name not in everything:
        raise UsageError(f"{checkpoint} has no {name!r} (it has {sorted(everything)}); pass --name")
    return _model_state(checkpoint, name, everything[name], everything)


def _model_state(checkpoint: str, name: str, saved: Any, objects: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``saved`` when it is a model's state dict (tensors by name), else one line naming the models there.

    >>> _model_state("ckpt", "optimizer", {"state": {}, "param_groups": []}, {"model": {"w": torch.ones(1)}})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ddpkit.core.errors.UsageError: 'optimizer' in ckpt is not a model's state dict (...); pass --name of a model: model
    """
    def is_model(obj: Any) -> bool:  # tensors by name; a module's get_extra_state() is kept as it is, untensored
        return isinstance(obj, Mapping) and any(isinstance(v, torch.Tensor) for v in obj.values()) and all(
            isinstance(v, torch.Tensor) or str(k).endswith("_extra_state") for k, v in obj.items())

    if is_model(saved):
        return dict(saved)
    models = sorted(k for k, v in objects.items() if is_model(v))
    kind = f"a dict of {', '.join(map(str, list(saved)[:4]))}" if isinstance(saved, Mapping) and saved else \
        type(saved).__name__
    raise UsageError(f"{name!r} in {checkpoint} is not a model's state dict (no tensors by name: {kind}); pass "
                     f"--name of a model: {', '.join(models) or 'this checkpoint holds none'}")
