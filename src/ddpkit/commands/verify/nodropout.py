"""Dropout that no module or float attribute holds, off during a verify run's forwards: a probability handed to
``F.scaled_dot_product_attention(..., dropout_p=...)`` (Hugging Face's sdpa attention: BERT, ViT, ... in
transformers 4.4x) or to ``F.dropout(x, p, training=self.training)``, written in the model's own forward.

verify compares one process with N: a random mask drawn in each forward differs between them by design, so every
such model ended "cannot compare exactly" after verify had said dropout was off. :func:`watch` enters a
``TorchFunctionMode`` for the prepared model's forward (and leaves it after), in which those calls get
``dropout_p=0`` / ``training=False``; outside the forward the script's calls are as it wrote them. A forward
recomputed in the backward by ``torch.utils.checkpoint(use_reentrant=True)`` runs outside it: its dropout is on.

Example::

    >>> import torch
    >>> x = torch.ones(2, 4)
    >>> with NoDropout():
    ...     bool((F.dropout(x, 0.5, training=True) == x).all()), bool((torch.dropout(x, 0.5, train=True) == x).all())
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["NoDropout", "watch"]

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
# torch's own forms, ``torch.dropout(x, p, train)`` (a course's MLP wrote ``torch.dropout(z, 0.2, train=True)``:
# on in verify's runs while its line said dropout was off, then "cannot compare exactly"); ``train`` by keyword
_TORCH_DROPOUTS = {torch.dropout, torch.dropout_, torch.alpha_dropout, torch.alpha_dropout_, torch.feature_dropout,
                   torch.feature_dropout_, torch.feature_alpha_dropout, torch.feature_alpha_dropout_}
_ENTERED: list[TorchFunctionMode] = []  # the modes of the forwards in progress (a model in a model)


class NoDropout(TorchFunctionMode):
    """``dropout_p`` of scaled_dot_product_attention 0, functional dropout's ``training`` False."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # (query, key, value, attn_mask, dropout_p, ...)
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        elif func in _DROPOUTS or func in _TORCH_DROPOUTS:
            if len(args) > 2:  # (input, p, training, inplace)
                args = (*args[:2], False, *args[3:])
            else:
                kwargs["train" if func in _TORCH_DROPOUTS else "training"] = False
        return func(*args, **kwargs)


def watch(model: nn.Module) -> None:
    """The mode on during each forward of ``model``."""
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_leave, always_call=True)  # (left also when the forward raises)


def _enter(module: nn.Module, args: Any) -> None:
    _ENTERED.append(NoDropout())
    _ENTERED[-1].__enter__()


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    if _ENTERED:
        _ENTERED.pop().__exit__(None, None, None)
