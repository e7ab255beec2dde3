"""Models built on the meta device (inside :func:`ddpkit.init_empty`): building one (:func:`meta_build`),
checking it fits a budget, and materialising it exactly (:func:`materialize`): on the device, or one shard
per rank, drawing the numbers a normal build draws, so the same seed gives the same weights.

Example::

    >>> with meta_build() as owners:
    ...     net = nn.Linear(3, 2)
    >>> on_meta(net), len(owners)
    (True, 2)
    >>> materialize(net, torch.device("cpu")); on_meta(net)
    False

Also the guard against an optimizer built before ``prepare_model`` replaced the parameters it holds.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.core.process import State

InitFn = Callable[[nn.Module], None]
Ties = dict[int, dict[str, tuple[nn.Module, str]]]  # id(module) -> {name: (creator, its name)}

# Module-level, not run state for core.process to reset: both describe torch objects of this heap and outlive
# a fork with them. The optimizer hook is registered in torch's global state, which a forked worker inherits,
# so its flag and the parameters it checks must be inherited too; and a model built inside init_empty in a
# notebook cell, then prepared in a forked worker, needs its creators there.
# Parameters that were replaced (fully_shard's shards, a meta model's real tensors), by id (a WeakSet would
# compare tensors with ==): an optimizer still holding one was built too early.
_replaced: dict[int, weakref.ref[torch.Tensor]] = {}
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()
_hook_installed = False
# Which module created each parameter built inside init_empty (by id, checked through the weakref): a tied
# weight holds its creator's initial values, whatever the modules that share it later draw.
_creators: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[nn.Module]]] = {}


def on_meta(model: nn.Module) -> bool:
    """True for a model built inside :func:`init_empty` (shapes only)."""
    metas = [t.is_meta for t in [*model.parameters(), *model.buffers()]]
    if any(metas) and not all(metas):
        raise ValueError("the model is partly on the meta device: build all of it inside ddpkit.init_empty() "
                         "or none of it")
    return any(metas)


@contextlib.contextmanager
def meta_build() -> Iterator[dict[nn.Parameter, nn.Module]]:
    """Build modules on the meta device (the body of :func:`ddpkit.init_empty`); yields, filled when the block
    ends, every parameter created in it and the module creating it (a later registration is a tie:
    ``head.weight = emb.weight``)."""
    owners: dict[nn.Parameter, nn.Module] = {}

    def record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param not in owners:
            owners[param] = module
            _creators[id(param)] = (weakref.ref(param), weakref.ref(module))

    handle = nn.modules.module.register_module_parameter_registration_hook(record)
    try:
        with torch.device("meta"):
            yield owners
    finally:
        handle.remove()


def check_budget(owners: dict[nn.Parameter, nn.Module], budget_mb: float, optimizer_slots: int, state: State,
                 shard_size: int | None = None) -> None:
    """Raise MemoryError when the parameters' training state per process exceeds ``budget_mb`` in this mode.

    ``owners``: parameter -> its module; the largest module stands in for the block gathered whole.
    """
    mode = state.strategy
    per_module: dict[int, int] = {}
    for param, module in owners.items():
        per_module[id(module)] = per_module.get(id(module), 0) + param.numel()
    size = max((p.element_size() for p in owners), default=4)
    elements = mode.state_bytes(sum(per_module.values()), max(per_module.values(), default=0),
                                mode.shard_group_size(state, shard_size), optimizer_slots)
    need = elements * size / 2**20
    if need > budget_mb:
        hint = "; use --mode fsdp" if not mode.shards else f"; use more processes than {state.world_size}"
        raise MemoryError(f"does not fit: {need:.0f} MB needed per process ({mode.name}, {state.world_size} "
                          f"process(es)), budget {budget_mb:.0f} MB{hint}")


def find_ties(model: nn.Module) -> Ties:
    """The tied parameters of a meta model, to be found before sharding replaces the recorded ones."""
    return _borrowed(_post_order(model))


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Children before parents: the order in which ``__init__``-time ``reset_parameters`` calls finish, and
    the order of ``model.apply``."""
    return [m for child in module.children() for m in _post_order(child)] + [module]


def materialize(model: nn.Module, device: torch.device, init_fn: InitFn | None = None,
                ties: Ties | None = None) -> None:
    """Allocate each rank's shard of a (sharded) meta model and initialise it exactly.

    Replays what building the model normally, then ``model.apply(init_fn)``, would draw: first every
    module's ``reset_parameters`` (construction), then ``init_fn`` on each module. Each module in turn is
    built whole on a throwaway copy (its own tensors only, never the whole model), initialised, and this
    rank's slice copied into its shard. ``init_fn`` sees the values ``reset_parameters`` gave (it may scale
    them in place, as GPT-2's residual scaling does; in fsdp they are gathered, one module at a time), or
    leave a module's tensors alone. A tensor nothing wrote is an error, whether or not its module has
    ``reset_parameters``.
    """
    modules, done = _post_order(model), set[int]()
    before = list(model.parameters())
    borrowed = _borrowed(modules) if ties is None else ties  # ties: found before sharding replaced them
    model.to_empty(device=device)
    _retie(modules, borrowed)  # to_empty gives each module its own new tensor: a tie would become two weights
    watch_optimizers([p for p in before if id(p) not in {id(q) for q in model.parameters()}])
    for module in modules:
        if hasattr(module, "reset_parameters"):
            _init_module(module, _reset, done, skip=borrowed.get(id(module), {}))
    if init_fn is not None:  # model.apply(init_fn) writes a tied tensor in place: the last module's values win
        for module in modules:
            _init_module(module, init_fn, done)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
               if id(t) not in done and t.numel()]
    if missing:
        raise ValueError(f"no initialisation for {missing[:5]} after init_empty(): neither their modules' "
                         "reset_parameters nor an init_fn wrote them; pass prepare_model(model, init_fn=fn) with "
                         "fn(module) initialising the tensors a module owns")


def _borrowed(modules: list[nn.Module]) -> Ties:
    """id(module) -> {name: (creator, its name)} for each parameter a module shares but did not create (a tie).

    The creator is the module that registered the parameter first inside :func:`init_empty`; for a tie made
    elsewhere, the first module in construction order holding it."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    borrowed: Ties = {}
    for pid, found in holders.items():
        if len(found) < 2:
            continue
        ref = _creators.get(pid)
        made_by = ref[1]() if ref is not None and ref[0]() is found[0][0]._parameters[found[0][1]] else None
        creator = next((h for h in found if h[0] is made_by), found[0])
        for module, name in found:
            if (module, name) != creator:
                borrowed.setdefault(id(module), {})[name] = creator
    return borrowed


def _retie(modules: list[nn.Module], borrowed: Ties) -> None:
    for module in modules:
        for name, (creator, creator_name) in borrowed.get(id(module), {}).items():
            module._parameters[name] = creator._parameters[creator_name]


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _init_module(module: nn.Module, init: InitFn, done: set[int], skip: Mapping[str, Any] | None = None) -> None:
    """Run ``init`` on a full-size scratch copy of ``module``'s own tensors, each holding its value so far
    (a sentinel if nothing wrote it yet); copy this rank's slices of the written ones back, except ``skip``'s
    (tied weights another module created: the draws happen, as in a normal build, and go)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}
    if not own:
        return
    # the same tensors on every rank are in `done` (the same draws everywhere): the gathers of fsdp line up
    scratch = _scratch_copy(module, {name: _whole(t) for name, t in own.items() if id(t) in done})
    filled = {name: (getattr(scratch, name), getattr(scratch, name)._version) for name in own}
    init(scratch)
    with torch.no_grad():
        for name, target in own.items():
            full = getattr(scratch, name)
            if name in (skip or {}) or (id(target) not in done and _untouched(full, *filled[name])):
                continue
            if id(target) not in done and _holds_sentinel(full):  # never a sentinel into a real tensor
                what = "reset_parameters" if init is _reset else "init_fn"
                raise ValueError(f"{type(module).__name__}.{name}: {what} changed part of it, or changed it in "
                                 "place, before anything had set it (after init_empty() a tensor holds no value "
                                 "until reset_parameters or init_fn writes all of it); write every element in "
                                 "init_fn (nn.init.*, copy_, fill_)")
            full = full.to(target.device)
            if isinstance(target, DTensor):  # this rank's slice of the full tensor, no communication
                full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.copy_(full)
            done.add(id(target))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole of ``tensor`` (a DTensor's shards gathered: collective)."""
    from torch.distributed.tensor import DTensor

    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", copy=True)


def _holds_sentinel(tensor: torch.Tensor) -> bool:
    """Some element still NaN (a float fill nothing replaced; an integer minimum or False may be a value)."""
    return (tensor.dtype.is_floating_point or tensor.dtype.is_complex) and bool(torch.isnan(tensor).any())


def _sentinel(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _untouched(tensor: torch.Tensor, scratch: torch.Tensor, version: int) -> bool:
    """``init_fn`` did not write ``tensor``: it is still the ``scratch`` fill, at the same ``version``, and
    holds the sentinel (NaN, the integer minimum).

    The version counter sees in-place writes (``copy_``, ``nn.init``), identity sees a replaced tensor
    (``module.mask = torch.tril(...)``), and the sentinel sees writes through ``.data`` (which bump no
    version). A bool (a causal mask) has no value to serve as sentinel: only the first two can tell.

    >>> t = _filled(torch.empty(2, dtype=torch.bool)); v = t._version
    >>> _untouched(t, t, v), _untouched(t.copy_(torch.tensor([True, False])), t, v)
    (True, False)
    """
    if tensor is not scratch or tensor._version != version:
        return False
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return bool(torch.isnan(tensor).all())
    return tensor.dtype == torch.bool or bool((tensor == _sentinel(tensor.dtype)).all())


def _scratch_copy(module: nn.Module, start: Mapping[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` with full-size, unsharded tensors of its own (children shared, unused),
    on the CPU: a model built normally is initialised there, with the CPU generator, before it moves. Each
    holds ``start``'s value, or the sentinel of its dtype.

    Built from the module's own class, not FSDP2's subclass of it (whose ``__new__`` re-runs ``__init__``).
    """
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if issubclass(cls, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    scratch = object.__new__(cls)
    scratch.__dict__.update(module.__dict__)

    def fresh(name: str, like: torch.Tensor) -> torch.Tensor:
        return start[name] if name in start else _filled(like)

    scratch._parameters = {n: None if p is None else nn.Parameter(fresh(n, p), requires_grad=p.requires_grad)
                           for n, p in module._parameters.items()}
    scratch._buffers = {n: None if b is None else fresh(n, b) for n, b in module._buffers.items()}
    return scratch


def _filled(like: torch.Tensor) -> torch.Tensor:
    """A full-size CPU tensor (a DTensor's global shape) holding the sentinel of its dtype."""
    return torch.full(tuple(like.size()), _sentinel(like.dtype), dtype=like.dtype)


def watch_optimizers(old: list[torch.Tensor]) -> None:
    """Remember the replaced parameters; an optimizer stepping over one of them raises."""
    global _hook_installed
    _replaced.update({id(p): weakref.ref(p) for p in old})
    if not _hook_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_stale)
        _hook_installed = True


def _refuse_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    def stale(p: torch.Tensor) -> bool:
        ref = _replaced.get(id(p))
        return ref is not None and ref() is p

    # checked once per optimizer (and again when its groups or the replaced set change): steps stay cheap
    key = (sum(len(group["params"]) for group in optimizer.param_groups), len(_replaced))
    if not _replaced or _checked.get(optimizer) == key:
        return
    if any(stale(p) for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            f"{type(optimizer).__name__} was built before prepare_model, whose parameters it holds were replaced "
            "(fsdp's shards, or an init_empty() model's real tensors), so its steps would train nothing; build it "
            "after: model = ddpkit.prepare_model(model); optimizer = torch.optim.X(model.parameters(), ...)")
    _checked[optimizer] = key


