"""A method of the user's module named in ``prepare_model(..., forward_methods=...)`` runs as DDP's forward.

pytorch-flows trains with ``loss = -model.log_probs(x).mean()``, a VAE with ``model.elbo(x)``: the layers run
in a method, not in ``forward``. Called on the local module, that method's graph has no DDP forward behind it:
DDP prepares no reduction, the gradients are never averaged, and each rank trains its own model (ddpkit's
first-step check stops it). So, as Lightning Fabric does for the methods a user marks (and torch's FSDP2 with
``register_fsdp_forward_method``), the call goes through the wrapper's forward with the module's ``forward``
pointed at the method for that one call: DDP prepares the reduction over that graph, as for ``model(x)``.

Only the methods named, as Fabric does: every method would make a DDP forward of calls that run no layers or run
on one rank only (``if rank == 0: model.num_params()``, a collective the others never meet), and would hand the
module's forward hooks a method's arguments. With gradients enabled and the module in training mode only: under
``torch.no_grad()`` or ``model.eval()`` (sampling) there is nothing to reduce, and the plain method runs.

Example::

    model = ddpkit.prepare_model(Flow(), forward_methods=("log_probs",))
    loss = -model.log_probs(x).mean()     # Flow.log_probs, run as DDP's forward: its gradients are averaged
    loss.backward()
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

_UNSET = object()


def validate(model: nn.Module, names: Sequence[str]) -> frozenset[str]:
    """The names of ``forward_methods``, each a method of the model's own class; one line for any other."""
    if isinstance(names, str):
        names = (names,)
    for name in names:
        found = getattr(type(model), name, None)
        if not callable(found) or name in nn.Module.__dict__ or name.startswith("_") or name == "forward":
            raise ValueError(f"prepare_model(forward_methods=...): {name!r} is not a method of your "
                             f"{type(model).__name__} class; expected the names of its methods that run the "
                             "layers in a training step (forward_methods=('log_probs',))")
    return frozenset(names)


def through_forward(wrapper: nn.Module, inner: nn.Module, method: Any) -> Any:
    """``method`` (bound to ``inner``) as a callable that runs as ``wrapper``'s forward in a training step."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and inner.training):
            return method(*args, **kwargs)
        own = inner.__dict__.get("forward", _UNSET)  # (a forward the user set on the instance: put back)

        def once(*inner_args: Any, **inner_kwargs: Any) -> Any:
            _restore(inner, own)  # the method itself may call self(x): the real forward again
            return method(*inner_args, **inner_kwargs)

        inner.__dict__["forward"] = once
        try:
            return wrapper(*args, **kwargs)
        finally:
            _restore(inner, own)

    return call


def _restore(inner: nn.Module, own: Any) -> None:
    if own is _UNSET:
        inner.__dict__.pop("forward", None)
    else:
        inner.__dict__["forward"] = own
