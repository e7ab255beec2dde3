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

Also what every ddpkit wrapper shares: :class:`PlainStateDict` (no ``module.`` prefix) and :func:`unwrap`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DataParallel, DistributedDataParallel

# names one wrapper has and another lacks (DDP's no_sync in fsdp): the helper that works in every mode
_OTHER_MODES = {
    "no_sync": "use ddpkit.no_sync(model) or ddpkit.accumulate(model, i, steps=k), which work in every mode",
    "require_backward_grad_sync": "use ddpkit.no_sync(model) or ddpkit.accumulate(...), which work in every mode",
}


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

    def __getitem__(self, index: Any) -> Any:
        """``model[-1]`` of a prepared ``nn.Sequential`` (a head to fine-tune, ``head = model[-1]``): the module's
        item. The wrapper has no items of its own; writes (``model[0] = layer``) stay refused, as torch's."""
        inner: Any = nn.Module.__getattr__(self, "module")  # type: ignore[arg-type]
        return inner[index]

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
            found = inspect.getattr_static(type(inner), name, None)
            if hasattr(found, "__get__"):  # a property whose body raised: torch's __getattr__ then says the
                value = found.__get__(inner, type(inner))  # property is missing; run it for its own error
                return self._forwarded(inner, name, value)
            if _module_has(inner, name):
                raise
            fix = _OTHER_MODES.get(name, f"check the name on {type(inner).__name__}")
            raise AttributeError(
                f"{type(self).__name__}({type(inner).__name__}) has no attribute {name!r}: looked up on ddpkit's "
                f"{type(self).__name__} wrapper, then on your {type(inner).__name__} module; {fix}") from None
        return self._forwarded(inner, name, value)

    def _forwarded(self, inner: nn.Module, name: str, value: Any) -> Any:
        """What a read of ``inner.name`` returns through the wrapper; the mode's wrapper may adapt methods."""
        return value

    def start_forwarding(self) -> None:
        """Called at the end of the wrapper's ``__init__``: until then every write is the wrapper's own.

        Warns once per name the wrapper's own attributes take from the module (DDP's ``dim``, ``logger``,
        ``device_ids``): a read of ``model.dim`` is the wrapper's, silently, where the script means its own.
        """
        self.__dict__["_forwarding"] = True
        inner = self.__dict__["_modules"]["module"]
        torch_own = set(nn.Module().__dict__)
        for name, value in self.__dict__.items():
            if name in inner.__dict__ and not name.startswith("_") and name not in torch_own and not callable(value) \
                    and not _same(value, inner.__dict__[name]):  # DDP's device is the module's: nothing to tell
                warnings.warn(f"model.{name} is {type(self).__name__}'s own attribute, not your "
                              f"{type(inner).__name__}'s: read yours as ddpkit.unwrap(model).{name}", stacklevel=3)

    #: DDP's reducer and FSDP's sharding are built from the module's parameters at wrap time: a layer or
    #: parameter written through the wrapper later would be trained on one rank's terms only (DataParallel
    #: replicates the module at each forward, so there it is fine)
    refuses_layer_writes = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:  # the wrapper's own attribute set again (DDP's forward does, every step):
            nn.Module.__setattr__(self, name, value)  # type: ignore[arg-type]  # no lookups, nothing for a
            return  # torch.compile around the wrapper to trace as frames of their own
        inner = self.__dict__.get("_modules", {}).get("module") if self.__dict__.get("_forwarding") else None
        if inner is not None and self.refuses_layer_writes and _holds_state(value):
            raise AttributeError(
                f"model.{name} = {type(value).__name__}(...) after ddpkit.prepare_model: the {type(self).__name__} "
                f"wrapper was built from the layers the model had then and would not train the new one in step "
                f"on every rank; replace layers before ddpkit.prepare_model(model)")
        if inner is not None and not _wrapper_has(self, name) and _module_has(inner, name):
            setattr(inner, name, value)
        else:
            nn.Module.__setattr__(self, name, value)  # type: ignore[arg-type]


def _wrapper_has(wrapper: Any, name: str) -> bool:
    if name in wrapper.__dict__ or _static(type(wrapper), name):
        return True
    return any(name in wrapper.__dict__.get(kind, {}) for kind in ("_parameters", "_buffers", "_modules"))


def _module_has(module: nn.Module, name: str) -> bool:
    """``module`` has ``name`` (its own, a parameter / buffer / submodule, or its class's), found without
    running a property's getter: ``hasattr`` would run it, and call a getter that raises a missing name."""
    return _wrapper_has(module, name)


def _static(cls: type, name: str) -> bool:
    missing = object()
    return inspect.getattr_static(cls, name, missing) is not missing


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


def _storages(result: Any, depth: int = 3) -> Iterator[int]:
    """Storage addresses of the tensors in ``result`` (a tensor, an optimizer's parameters, or lists / tuples
    / dicts of them): a view (``w.detach()``, ``w.data``, ``w[0]``, ``w.T``) shares its base's storage."""
    if isinstance(result, torch.Tensor):
        # sparse results have no storage of their own to share with a parameter: new tensors
        if result.layout == torch.strided and not _is_dtensor(result) and result.untyped_storage().nbytes():
            yield result.untyped_storage().data_ptr()
    elif isinstance(result, torch.optim.Optimizer):
        for group in result.param_groups:
            yield from _storages(group["params"], depth)
    elif depth and isinstance(result, (dict, list, tuple)):
        for item in result.values() if isinstance(result, dict) else result:
            yield from _storages(item, depth - 1)


def _holds_state(value: Any) -> bool:
    """A parameter, or a module with parameters or buffers: what DDP's reducer / broadcast and FSDP's shards
    are built from. A loss or an activation module (``model.criterion = nn.CrossEntropyLoss()``) holds none."""
    if isinstance(value, nn.Parameter):
        return True
    return isinstance(value, nn.Module) and any(True for _ in (*value.parameters(), *value.buffers()))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value without a plain ==, e.g. a tensor of several elements: not the same to tell
        return False


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def gathered_in(result: Any, gathered: set[int]) -> bool:
    """``result`` holds a tensor (or a view of one) whose storage address is in ``gathered``, or an optimizer
    over tensors that are not DTensors (an fsdp model's trained parameters all are).

    >>> w = torch.ones(2, 2)
    >>> gathered_in({"rows": [w[0]]}, {w.untyped_storage().data_ptr()}), gathered_in(w.clone(), set())
    (True, False)
    """
    if isinstance(result, torch.optim.Optimizer):
        if any(not _is_dtensor(p) for group in result.param_groups for p in group["params"]):
            return True
    return any(ptr in gathered for ptr in _storages(result))


def fsdp_method(root: nn.Module, name: str, hooked: dict[str, Any]) -> Any:
    """``root.name`` as an FSDP forward: every parameter it touches is whole during the call (a submodule that
    is its own block gathers through its own hooks; the root's group through the forward hooks registered here,
    once per name, kept in ``hooked``), and the root's group is sharded again after it (also when it raised,
    and when an earlier forward left it gathered), so that ``model.parameters()`` (an optimizer built next) are
    the shards. The gathered storage is freed then: a result that holds it (the parameter itself, a view such
    as ``w.detach()`` or ``w[0]``, an optimizer built inside, ``configure_optimizers``) would dangle or train
    nothing, and a generator would run after the reshard: each is an error naming ``ddpkit.unwrap``.
    """
    import functools

    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

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
    cls = next(c for c in type(root).__mro__ if not issubclass(c, FSDPModule)).__name__

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        holds = False
        try:
            result = method(*args, **kwargs)
        except BaseException:
            # FSDP2's recovery after a forward that raised: its state stays "in forward" otherwise, where the
            # root's reshard below is a no-op (the root keeps its gathered copies for a backward)
            root.reset_iter_state()
            raise
        try:
            if inspect.isgenerator(result):
                result.close()
                raise TypeError(
                    f"model.{name}() is a generator: it would run after fsdp shards the parameters again (a method "
                    f"call through the prepared model is an FSDP forward); return a list from {cls}.{name}, or "
                    f"use it inside forward")
            gathered = {p.untyped_storage().data_ptr() for p in root.parameters() if not _is_dtensor(p)}
            holds = gathered_in(result, gathered)
        finally:
            if any(not _is_dtensor(p) for p in root.parameters()):
                root.reshard()
        if holds:
            raise RuntimeError(
                f"model.{name}() ran with fsdp's parameters gathered (a method call through the prepared model "
                f"is an FSDP forward) and returned tensors or an optimizer on that gathered storage, which is "
                f"freed now (an optimizer would never update the shards); return a copy (.clone()) or call it on "
                f"the shards: ddpkit.unwrap(model).{name}(...) ({cls}.{name})")
        return result

    return call


class PlainStateDict(ForwardsAttributes):
    """Mixin: the wrapper saves and loads the wrapped module's state dict, with no ``module.`` prefix (DDP's
    and DataParallel's wrappers).

    ``load_state_dict`` also takes a dict saved from a wrapper by plain torch (keys ``module.*``). Names the
    wrapper lacks are the module's (:class:`ForwardsAttributes`): ``model.init_hidden(4)``.
    """

    module: nn.Module  # set by the torch wrapper this is mixed into

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        state_dict = dict(state_dict)
        consume_prefix_in_state_dict_if_present(state_dict, "module.")
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def accept_plain_keys(self) -> None:
        """As a part of a container (``gan.generator = ddpkit.prepare_model(gan.generator)``), the container's
        ``load_state_dict`` reaches this wrapper through its children, under ``prefix``: its plain keys
        (``generator.0.weight``, what its ``state_dict`` wrote) are the module's (``generator.module.0.weight``)."""
        def plain(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
            inner = prefix + "module."
            for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
                state_dict[inner + key[len(prefix):]] = state_dict.pop(key)

        self._register_load_state_dict_pre_hook(plain)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module under ``torch.compile``'s handles: the DDP / FSDP wrapper inside decides what a context such
    as ``no_sync`` does, and the compiled handle is neither.

    >>> lin = nn.Linear(2, 2)
    >>> uncompiled(lin) is lin
    True
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod  # type: ignore[assignment]
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under any DDP / DataParallel / FSDP / ``torch.compile`` wrappers (torch's own, or
    ddpkit's: every ddpkit wrapper forwards to its ``module``).

    In fsdp mode that module holds this rank's shards (DTensor parameters).

    >>> lin = nn.Linear(2, 2)
    >>> unwrap(DataParallel(lin)) is lin
    True
    """
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel, ForwardsAttributes)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model
