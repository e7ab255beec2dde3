"""Put a model on this process's device and wrap it for the chosen mode.

Example::

    model = ddpkit.prepare_model(Net())       # device, SyncBatchNorm (DDP), DDP / DataParallel / nothing
    loss = loss_fn(model(x), y)               # forward and backward unchanged
    torch.save(model.state_dict(), "w.pt")    # no "module." prefix, in every mode
    ddpkit.unwrap(model).my_method()          # the plain module
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ddpkit import runtime
from ddpkit.syncbn import convert_sync_batchnorm, has_batchnorm


class _PlainStateDict:
    """Mixin: the wrapper saves and loads the wrapped module's state dict, with no ``module.`` prefix.

    ``load_state_dict`` also takes a dict saved from a wrapper by plain torch (keys ``module.*``).
    """

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        state_dict = dict(state_dict)
        consume_prefix_in_state_dict_if_present(state_dict, "module.")
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class DDP(_PlainStateDict, DistributedDataParallel):
    """torch's DistributedDataParallel whose state dict is the plain module's."""


class DP(_PlainStateDict, DataParallel):
    """torch's DataParallel whose state dict is the plain module's."""


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under any DDP / DataParallel / ``torch.compile`` wrappers.

    >>> lin = nn.Linear(2, 2)
    >>> unwrap(DataParallel(lin)) is lin
    True
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def prepare_model(model: nn.Module, *, sync_batchnorm: bool = True, **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to this process's device and wrap it for the mode :func:`ddpkit.init` chose.

    - ``ddp``: BatchNorm layers become SyncBatchNorm (``sync_batchnorm=False`` opts out; ddpkit's works on
      CPU too), then DistributedDataParallel with ``ddp_kwargs`` (e.g. ``find_unused_parameters=True``;
      ignored in the other modes).
    - ``dp``: DataParallel over every visible GPU. Each replica computes BatchNorm statistics on its slice of
      the batch; running statistics are those of the GPU-0 replica (torch discards the others').
    - ``single``: just the move.

    The returned wrapper's ``state_dict()`` has no ``module.`` prefix and its ``load_state_dict`` accepts one.
    """
    state = runtime.current()
    model = model.to(state.device)
    if state.mode == "ddp":
        if sync_batchnorm and has_batchnorm(model):
            model = convert_sync_batchnorm(model, state.device)
            if state.is_main:
                print("ddpkit: BatchNorm -> SyncBatchNorm (statistics over the global batch)",
                      file=sys.stderr, flush=True)
        device_ids = [state.device.index] if state.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, **ddp_kwargs)
    # ddp_kwargs are ignored outside DDP on purpose: the same script must run in every mode.
    if state.mode == "dp":
        return DP(model)
    return model
