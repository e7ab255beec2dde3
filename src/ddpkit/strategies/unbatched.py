"""A recurrent layer fed a 2-D batch reads it as one sequence: said once, at the first training forward.

``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` take a 2-D input as one *unbatched* sequence, ``(L, H_in)``, whatever
``batch_first`` says. A script that hands them a loader's ``(batch, features)`` rows trains a recurrence across
its samples: row i's state flows into row i+1. At N processes each rank's share of the batch is another, shorter
sequence, so the training differs from one process's (ML-LSTM in the fifteenth held-out set: ``ddpkit verify``
FAILed, rightly, and nothing said why). The hooks look at the first training forward of each such layer and
are removed after it: no cost per step.

The same for a 3-D input with ``batch_first=False`` whose first axis, which torch reads as time, is the batch size of
a training loader of ``ddpkit.data_loader`` and whose second is not (closeheat's LSTM tutorial embeds ``(batch,
seq)`` rows and hands them on as they are): a batch-major input read time-major, each rank's "sequence" its share of
the batch. A time-major input (``pad_sequence``'s ``(T, B, ...)``) has the loader's batch on its second axis: nothing
said.

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

from ddpkit.core import process


def watch(model: nn.Module, world_size: int) -> None:
    """Hook each recurrent layer of ``model`` until its first training forward (nothing with one process). The hook
    is a partial of a module-level function: a model saved whole before that forward still pickles."""
    if world_size < 2:
        return
    for name, module in model.named_modules():
        if isinstance(module, nn.RNNBase):
            module.register_forward_pre_hook(functools.partial(_first, name=name or "the model",
                                                               world_size=world_size), with_kwargs=True)


def _first(module: nn.Module, args: tuple, kwargs: dict, name: str, world_size: int) -> None:
    if not module.training:
        return
    hooks = module._forward_pre_hooks
    for key in [k for k, h in hooks.items() if getattr(h, "func", None) is _first]:
        del hooks[key]
    x = args[0] if args else kwargs.get("input")  # (``self.lstm(input=x)``)
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        warnings.warn(
            f"ddpkit: {name!r} ({type(module).__name__}) got a 2-D input {tuple(x.shape)}: torch reads it as one "
            f"sequence of {x.shape[0]} steps (unbatched), so each of the {world_size} processes trains on another, "
            "shorter sequence of the batch's rows and the training differs from one process's; if each row is a "
            "sample, give it a time axis (x.unsqueeze(1) with batch_first=True: (batch, 1, features))",
            stacklevel=2)
    elif isinstance(x, torch.Tensor) and _batch_as_time(module, x):
        warnings.warn(
            f"ddpkit: {name!r} ({type(module).__name__}, batch_first=False) got {tuple(x.shape)}: torch reads its "
            f"first axis as time, and {x.shape[0]} is the training loader's batch per process, so each of the "
            f"{world_size} processes runs the recurrence across its share of the batch's samples and the training "
            "differs from one process's; if the input is (batch, seq, features), pass batch_first=True to "
            f"{type(module).__name__} (its hidden state stays (layers, batch, hidden)), or x.transpose(0, 1)" +
            (f"; if its second axis folds the batch with another ({x.shape[1]} = {x.shape[0]} x "
             f"{x.shape[1] // x.shape[0]}, a hierarchical model's words of each sentence), this is right"
             if x.shape[1] % x.shape[0] == 0 else ""),
            stacklevel=2)


def _batch_as_time(module: nn.Module, x: torch.Tensor) -> bool:
    """A 3-D input whose time axis (``batch_first=False``) has the last training loader's per-process batch size
    and whose batch axis has not (the same size on both: nothing can be told)."""
    batch = process.current().train_batch
    return batch is not None and x.dim() == 3 and not getattr(module, "batch_first", True) and \
        x.shape[0] == batch and x.shape[1] != batch
