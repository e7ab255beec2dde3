"""A prepared model answers for the user's module: ``model.init_hidden(bsz)``, ``model.decode(z)``,
``model.configure_optimizers()`` and ``model.ntoken`` reach the module inside the DDP / DataParallel / FSDP
wrapper, as Lightning Fabric's wrapped module does, so a converted script keeps its calls.

Example::

    model = ddpkit.prepare_model(RNNModel(ntoken=100))
    hidden = model.init_hidden(20)        # RNNModel.init_hidden, in every mode
    model.ntoken                          # 100
    model.module                          # still the wrapper's own attribute (DDP's module)

The wrapper's own names come first (``module``, ``no_sync``, ``state_dict``, ``parameters``, ...); only a
name the wrapper lacks is looked up on the module. In fsdp mode a method of the user's class runs as an FSDP
forward (its parameters gathered, then resharded), since outside ``forward`` each holds one shard only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ForwardsAttributes:
    """Mixin for ddpkit's wrappers: reads of names the wrapper lacks go to ``self.module``.

    Writes: ``model.x = v`` goes to the user's module when the module has ``x`` and the wrapper does not, so
    that the module's own code (``forward`` reading ``self.temperature``) sees the new value; any other write
    stays on the wrapper, as in torch. Fabric forwarded reads only at first, which let a write land on the
    wrapper where the module never sees it while reads through the wrapper showed it: two values, silently.
    New names stay on the wrapper because DDP itself sets attributes after ``__init__`` (``_authoritative_rank``,
    ``buffer_hook``) that must not land in the user's module; for the same reason nothing is forwarded before
    :meth:`start_forwarding`.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]  # parameters, buffers, submodules
        except AttributeError:
            if name == "module" or name.startswith("__"):  # before __init__ set it; copy/pickle probes
                raise
            inner: nn.Module = nn.Module.__getattr__(self, "module")  # type: ignore[arg-type,assignment]
        try:
            value = getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__}({type(inner).__name__}) has no attribute {name!r}: looked up on ddpkit's "
                f"{type(self).__name__} wrapper, then on your {type(inner).__name__} module; check the name on "
                f"{type(inner).__name__}") from None
        return self._forwarded(inner, name, value)

    def _forwarded(self, inner: nn.Module, name: str, value: Any) -> Any:
        """What a read of ``inner.name`` returns through the wrapper; the mode's wrapper may adapt methods."""
        return value

    def start_forwarding(self) -> None:
        """Called at the end of the wrapper's ``__init__``: until then every write is the wrapper's own."""
        self.__dict__["_forwarding"] = True

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_modules", {}).get("module") if self.__dict__.get("_forwarding") else None
        if inner is not None and not _wrapper_has(self, name) and hasattr(inner, name):
            setattr(inner, name, value)
        else:
            nn.Module.__setattr__(self, name, value)  # type: ignore[arg-type]


def _wrapper_has(wrapper: Any, name: str) -> bool:
    if name in wrapper.__dict__ or hasattr(type(wrapper), name):
        return True
    return any(name in wrapper.__dict__.get(kind, {}) for kind in ("_parameters", "_buffers", "_modules"))


def user_method(inner: nn.Module, name: str, value: Any) -> bool:
    """``value`` is a bound method ``inner.name`` defined by the user's class (not torch's, not FSDP2's).

    >>> class Net(nn.Module):
    ...     def decode(self, z): return z
    >>> net = Net()
    >>> user_method(net, "decode", net.decode), user_method(net, "parameters", net.parameters)
    (True, False)
    """
    if getattr(value, "__self__", None) is not inner:
        return False
    owner = next((cls for cls in type(inner).__mro__ if name in cls.__dict__), None)
    return owner is not None and not owner.__module__.startswith("torch.")


def gathered_in(result: Any, gathered: set[int], depth: int = 3) -> bool:
    """``result`` (a tensor, an optimizer, or lists / tuples / dicts of them) holds a tensor whose id is in
    ``gathered``."""
    if isinstance(result, torch.Tensor):
        return id(result) in gathered
    if isinstance(result, torch.optim.Optimizer):
        return any(id(p) in gathered for group in result.param_groups for p in group["params"])
    if depth == 0:
        return False
    items = result.values() if isinstance(result, dict) else result if isinstance(result, (list, tuple)) else ()
    return any(gathered_in(item, gathered, depth - 1) for item in items)


def fsdp_method(root: nn.Module, name: str, hooked: dict[str, Any]) -> Any:
    """``root.name`` as an FSDP forward: every parameter it touches is whole during the call (a submodule that
    is its own block gathers through its own hooks; the root's group through the forward hooks registered here,
    once per name, kept in ``hooked``), and the root's group is sharded again after it, so that
    ``model.parameters()`` (an optimizer built next) are the shards. A result holding the gathered copies (an
    optimizer built inside, ``configure_optimizers``) would train nothing: that is an error naming
    ``ddpkit.unwrap``.
    """
    import functools

    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor

    if not isinstance(root, FSDPModule):
        return getattr(root, name)
    if name not in hooked:
        had = name in root.__dict__
        before = root.__dict__.get(name)
        register_fsdp_forward_method(root, name)  # sets root.<name> on the instance; taken back off it, so that
        hooked[name] = root.__dict__.pop(name)  # unwrap(model).<name> stays the plain method, on the shards
        if had:
            root.__dict__[name] = before
    method = hooked[name]

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        sharded_before = all(isinstance(p, DTensor) for p in root.parameters())
        result = method(*args, **kwargs)
        gathered = {id(p) for p in root.parameters() if not isinstance(p, DTensor)}
        if sharded_before and gathered:
            root.reshard()
            if gathered_in(result, gathered):
                cls = next(c for c in type(root).__mro__ if not issubclass(c, FSDPModule)).__name__
                raise RuntimeError(
                    f"model.{name}() ran with fsdp's parameters gathered (a method call through the prepared model "
                    f"is an FSDP forward), and it returned those whole copies, which an optimizer would never "
                    f"update; call it on the shards instead: ddpkit.unwrap(model).{name}(...) ({cls}.{name})")
        return result

    return call
