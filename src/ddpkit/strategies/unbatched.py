"""A recurrent layer fed a 2-D batch reads it as one sequence: said once, at the first training forward.

``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` take a 2-D input as one *unbatched* sequence, ``(L, H_in)``, whatever
``batch_first`` says. A script that hands them a loader's ``(batch, features)`` rows trains a recurrence across
its samples: row i's state flows into row i+1. At N processes each rank's share of the batch is another, shorter
sequence, so the training differs from one process's (ML-LSTM in the fifteenth held-out set: ``ddpkit verify``
FAILed, rightly, and nothing said why). The hooks look at the first training forward of each such layer and
are removed after it: no cost per step.

Example::

    >>> import warnings
    >>> import torch
    >>> from torch import nn
    >>> lstm = nn.LSTM(4, 8)
    >>> watch(lstm, world_size=2)
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = lstm(torch.randn(16, 4))
    >>> "one sequence of 16 steps" in str(caught[0].message), lstm._forward_pre_hooks
    (True, OrderedDict())
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn


def watch(model: nn.Module, world_size: int) -> None:
    """Hook each recurrent layer of ``model`` until its first training forward (nothing with one process). The hook
    is a partial of a module-level function: a model saved whole before that forward still pickles."""
    if world_size < 2:
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.RNNBase):
            module.register_forward_pre_hook(functools.partial(_first, name=name or "the model",
                                                               world_size=world_size))


def _first(module: nn.Module, args: tuple, name: str, world_size: int) -> None:
    if not module.training:
        return
    hooks = module._forward_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "func", None) is _first]:
        del hooks[key]
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        warnings.warn(
            f"ddpkit: {name!r} ({type(module).__name__}) got a 2-D input {tuple(x.shape)}: torch reads it as one "
            f"sequence of {x.shape[0]} steps (unbatched), so each of the {world_size} processes trains on another, "
            "shorter sequence of the batch's rows and the training differs from one process's; if each row is a "
            "sample, give it a time axis (x.unsqueeze(1) with batch_first=True: (batch, 1, features))",
            stacklevel=2)
