"""Data flow for ``ddpkit convert``: where a name used in one place was bound, and where a bound value is used,
across the script's own functions (a loader handed to ``train(args, model, device, train_loader, ...)`` is
the ``train_loader`` parameter there), methods (``self.model``) and module globals.

The questions it answers are the converter's: which binding is the model an optimizer trains
(:func:`binding_of`), which loops read a loader (:func:`loops_reading`), and whether those loops train or
evaluate (:func:`role`). Each gives up (None, or no loop) rather than guess: the plan then leaves the line to
the user.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("def train(ld):\\n    for b in ld:\\n        b.backward()\\nl = f()\\ntrain(l)\\n"))
    >>> [loop.line for loop in loops_reading(facts, "l", facts.scopes[""])]
    [2]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flagged import argument_for, switched_off
from ddpkit.commands.convert.names import dotted, names_in, resolve, unpacked
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop, Scope

# methods of torch's modules, optimizers and schedulers: called on anything but ``self``, not the script's own
# method of the same name (a Runner.train(), a Trainer.step())
TORCH_METHODS = frozenset({"train", "eval", "to", "cuda", "cpu", "forward", "parameters", "named_parameters",
                           "modules", "children", "apply", "zero_grad", "step", "state_dict", "load_state_dict",
                           "half", "float", "double", "requires_grad_", "backward"})
DEPTH = 4  # calls followed from one binding: deeper than any public training script nests its loops


def visible(facts: Facts, name: str, bound: Scope, used: Scope) -> bool:
    """Whether ``name`` bound in ``bound`` is the one ``used`` reads (Python's rules, for the cases scripts
    have): the same function; a module global not rebound locally; ``self.x`` across one class's methods."""
    if name.startswith("self."):
        return bound.cls is not None and bound.cls == used.cls
    if bound is used:
        return True
    if any(b.target == name and b.scope is used for b in facts.bindings):
        return False  # (bound in ``used`` itself: its own)
    outer = used.outer  # a nested function reads its enclosing functions' names (a lab's ``def train(epoch):``
    while outer is not None:  # in ``main()`` over main's ``trainloader``: set 26's extra five)
        if outer is bound:
            return True
        if any(b.target == name and b.scope is outer for b in facts.bindings):
            return False
        outer = outer.outer
    return bound.name == ""


def callee(facts: Facts, call: Call) -> tuple[Scope, int] | None:
    """The script's own function a call runs, and how many leading parameters the call does not pass
    (``self``): ``train(...)``, ``self.run()``, ``trainer.run()`` (one class has a ``run``), ``Trainer(...)`` (its
    ``__init__``)."""
    if call.name in facts.scopes and "." not in call.name:
        return facts.scopes[call.name], 0
    if call.name and "." not in call.name and f"{call.name}.__init__" in facts.scopes:  # ``Trainer(model, loader)``
        return facts.scopes[f"{call.name}.__init__"], 1
    if isinstance(call.node.func, cst.Attribute):
        methods = [s for s in facts.scopes.values() if s.cls and s.name.endswith(f".{call.last}")]
        owner, cls = dotted(call.node.func.value), _class_of(facts, call.node.func.value)
        head = (owner or "").split(".")[0]
        if head in facts.aliases and not any(b.target == head for b in facts.bindings):
            return None  # (``torch.load(path)`` beside a class's ``load`` method: a module's function, not it)
        if isinstance(call.node.func.value, cst.Call) and dotted(call.node.func.value.func) == "super":
            # (``super(DCGAN, self).__init__()`` runs a base's, never the class's own, nor another class's of the
            # file that is no base of it: a DCGAN project's trainer "called" its own __init__, and the models handed
            # to it were asked of no file; set 26 and its review)
            return None
        if owner == "self" and call.scope.cls:
            methods = [s for s in methods if s.cls == call.scope.cls]
        elif cls is not None:  # ``Runner(...).train()``, ``runner.train()`` with ``runner = Runner(...)``
            methods = [s for s in methods if s.cls == cls]
        elif owner and owner.startswith("self.") and call.scope.cls and call.last in TORCH_METHODS:
            # ``self.model.train()`` in Runner: the model's, not Runner.train (an attribute is not its own class)
            methods = [s for s in methods if s.cls != call.scope.cls]
        if len(methods) == 1:
            return methods[0], 1
    return None


def runs(facts: Facts, call: Call, module: str, function: str) -> bool:
    """``call`` runs ``function`` of the project's ``module``: ``train_step(...)``, ``Solver(...)`` for
    ``Solver.__init__``, ``solver.train(...)``, ``self.solver.train(...)`` or ``Solver(...).train(...)`` for
    ``Solver.train``, ``trainer(...)`` for ``Trainer.__call__`` (``solver``, ``trainer``: bound to that class's call).

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("from engine import Engine\\neng = Engine(2)\\neng.train(x)\\n"))
    >>> runs(f, f.calls[-1], "engine", "Engine.train"), runs(f, f.calls[-1], "engine", "Engine.eval")
    (True, False)
    """
    cls, _, method = function.rpartition(".")
    func = call.node.func
    if not cls or method == "__init__":
        return _names(facts, dotted(func), f"{module}.{cls or method}")
    if method == "__call__":
        held: cst.BaseExpression | None = func
    elif isinstance(func, cst.Attribute) and func.attr.value == method:
        held = func.value
    else:
        return False
    name = dotted(held) if isinstance(held, (cst.Name, cst.Attribute)) else None
    if name:  # ``eng.train(...)``, ``self.engine.train(...)``: what the name was bound to
        bound = binding_of(facts, name, call.scope, call.line)
        held = bound.value if bound is not None else None
    return isinstance(held, cst.Call) and _names(facts, dotted(held.func), f"{module}.{cls}")


def _names(facts: Facts, written: str | None, wanted: str) -> bool:
    full = resolve(written, facts.aliases)
    full = facts.exported.get(full, full) if full is not None else None
    starred = imported_from(facts, written) if written and full == written and "." not in written else None
    if starred is not None:  # (``from pkg.trainer import *``, then ``train(...)``: a CIFAR project's main.py)
        full = f"{starred[0]}.{starred[1]}"
    return full is not None and (full == wanted or full.endswith("." + wanted))


def callers(facts: Facts, scope: Scope) -> list[Call]:
    """The calls of this file that run ``scope`` (:func:`callee`); none: another module calls it, or nothing.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("def fit(m):\\n    pass\\nfit(net)\\nfit(net)\\n"))
    >>> [c.line for c in callers(f, f.scopes["fit"])]
    [3, 4]
    """
    return [c for c in facts.calls if (callee(facts, c) or (None,))[0] is scope]


def _class_of(facts: Facts, node: cst.BaseExpression) -> str | None:
    """The script's class an object is made from: ``Runner(...)``, or a name bound to it."""
    if isinstance(node, (cst.Name, cst.Attribute)):
        bound = [b.value for b in facts.bindings if b.target == dotted(node) and b.value is not None]
        node = bound[-1] if len(bound) == 1 else node
    name = dotted(node.func) if isinstance(node, cst.Call) else None
    return name if name and any(s.cls == name for s in facts.scopes.values()) else None


def binding_of(facts: Facts, name: str, scope: Scope, line: int, depth: int = 0) -> Binding | None:
    """The binding ``name`` has when ``scope`` reads it at ``line``: the last before it in the same function,
    else the class's (``__init__`` first) or the module's; a parameter is followed to the one call site that
    passes it (several that pass different things: None)."""
    same = [b for b in facts.bindings if b.target == name and b.scope is scope and b.line <= line]
    found: Binding | None
    if same:
        found = same[-1]
    else:
        other = [b for b in facts.bindings if b.target == name and b.scope is not scope
                 and visible(facts, name, b.scope, scope)]
        other.sort(key=lambda b: (not b.scope.name.endswith(".__init__"), b.line))
        found = other[-1] if other and not name.startswith("self.") else other[0] if other else None
        if name.startswith("self.") and other:  # the class's: the last one written in __init__, if any
            init = [b for b in other if b.scope.name.endswith(".__init__")]
            found = init[-1] if init else other[-1]
    if found is None or found.value is not None or depth >= DEPTH or found.scope.name == "":
        return found
    if name not in found.scope.params:  # a loop variable, ``with ... as``: not followed
        return found
    sites = []
    for call in facts.calls:
        target = callee(facts, call)
        if target is None or target[0] is not found.scope:
            continue
        arg = argument_for(call, name, found.scope, target[1])
        arg_name = dotted(arg) if arg is not None else None
        sites.append(binding_of(facts, arg_name, call.scope, call.line, depth + 1) if arg_name else None)
    distinct = {id(s) for s in sites}
    return sites[0] if len(distinct) == 1 and sites[0] is not None else found


def loops_reading(facts: Facts, name: str, scope: Scope, depth: int = 0, since: Binding | None = None) -> list[Loop]:
    """Every loop that takes its items from ``name`` (bound in ``scope``): ``for b in name``, ``for i, b in
    enumerate(tqdm(name))``, ``it = iter(name)`` then ``next(it)`` in a loop, through assignments
    (``self.loader = name``), calls of the script's functions that pass it on, and for an attribute
    (``self.train_loader``) every read of that attribute on another object (``data.train_loader``). With
    ``since``, one binding of ``name``: only the reads in ``scope`` it reaches (a script that rebinds
    ``train_loader`` to an unshuffled one to plot its predictions has two loaders of two roles)."""
    return reading(facts, name, scope, _loops, depth, since)


Pick = Callable[[Facts, str, Scope, Callable[[Scope, int], bool]], list[Any]]


def _loops(facts: Facts, name: str, scope: Scope, reached: Callable[[Scope, int], bool]) -> list[Any]:
    found = [loop for loop in facts.loops if name in loop.iter_names and visible(facts, name, scope, loop.scope)
             and reached(loop.scope, loop.line)]
    return found + [call.loops[-1] for call in facts.calls if call.name == "next" and call.loops and call.node.args
                    and dotted(call.node.args[0].value) == name and visible(facts, name, scope, call.scope)
                    and reached(call.scope, call.line)]


def reading(facts: Facts, name: str, scope: Scope, pick: Pick, depth: int = 0, since: Binding | None = None) -> \
        list[Any]:
    """What ``pick`` finds reading ``name`` (bound in ``scope``) where the value goes (:func:`loops_reading`'s
    ways); ``pick(facts, name, scope, reached)`` gives the readers of one name, ``reached(scope, line)`` saying
    whether ``since`` reaches a line."""
    if depth >= DEPTH:
        return []
    window = _reach(facts, since) if since is not None else None

    def reached(where: Scope, line: int) -> bool:
        return window is None or where is not scope or window[0] <= line < window[1]
    found = pick(facts, name, scope, reached)
    for other, where in attribute_reads(facts, name, scope) if depth == 0 else ():
        found += reading(facts, other, where, pick, depth + 1)
    for call in facts.calls:
        target = callee(facts, call) if visible(facts, name, scope, call.scope) and reached(call.scope, call.line) \
            else None
        for param in target[0].params if target is not None else ():
            arg = argument_for(call, param, target[0], target[1])  # type: ignore[index]
            if arg is not None and name in names_in(arg):
                found += reading(facts, param, target[0], pick, depth + 1)  # type: ignore[index]
    for returned_by, value in facts.returns:  # ``return train_dl, test_dl``: where the caller binds them
        if returned_by is scope:
            found += _returned(facts, name, scope, value, depth, pick)
    for b in facts.bindings:  # ``self.loader = loader``, ``it = iter(loader)``, ``bar = tqdm(loader)``
        if b.value is not None and b.target != name and visible(facts, name, scope, b.scope) \
                and name in names_in(b.value) and _passes_items(b.value) and reached(b.scope, b.line) \
                and not _returns_other(facts, b.value):
            found += reading(facts, b.target, b.scope, pick, depth + 1)
    unique: dict[int, Any] = {id(item): item for item in found}
    return list(unique.values())


def _reach(facts: Facts, binding: Binding) -> tuple[int, int]:
    """The lines of its scope that ``binding`` reaches: from it to the next binding of the same name that every
    path runs (a statement of the scope's own body, not under an ``if``) and that makes a new loader or does not
    read the name (``loader = tqdm(loader)`` passes the same loader on; ``DataLoader(loader.dataset, ...)`` is a
    new one). A binding inside a loop reaches the whole scope: the loop's next pass reads it above its line."""
    if not top_level(binding):
        return 0, 1 << 30
    later = [b.line for b in facts.bindings if b.target == binding.target and b.scope is binding.scope
             and b.line > binding.line and top_level(b) and b.value is not None
             and (binding.target not in names_in(b.value) or _new_loader(facts, b.value))]
    return binding.line, min(later, default=1 << 30)


def part_of(node: cst.BaseExpression | None) -> str | None:
    """The dotted name a value reads a model by: ``model`` of ``model[-1]`` and of ``ddpkit.unwrap(model)[-1]``
    (converted already), ``model.fc`` of ``model.fc``; None for an entry of a dict (``checkpoint["encoder"]``:
    the entry is a model of its own, not a part of the checkpoint).

    >>> part_of(cst.parse_expression("ddpkit.unwrap(net)[-1]")), part_of(cst.parse_expression("net.fc"))
    ('net', 'net.fc')
    >>> part_of(cst.parse_expression("checkpoint['encoder']")) is None
    True
    """
    if isinstance(node, cst.Subscript) and any(isinstance(e.slice, cst.Index) and isinstance(
            e.slice.value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)) for e in node.slice):
        return None
    inner = node.value if isinstance(node, cst.Subscript) else node
    if isinstance(inner, cst.Call) and inner.args and dotted(inner.func) == "ddpkit.unwrap":
        inner = inner.args[0].value
    return dotted(inner)


def top_level(binding: Binding) -> bool:
    """The binding is a statement of its scope's own body (every path through the scope runs it, once)."""
    return in_body(binding.stmt, binding.scope)


def in_body(stmt: cst.CSTNode | None, scope: Scope) -> bool:
    """``stmt`` is a statement of the scope's own body: not inside an ``if``, a loop or a ``with`` of it."""
    node = scope.node
    body = node.body if isinstance(node, cst.Module) else getattr(getattr(node, "body", None), "body", ())
    return stmt is not None and any(found is stmt for found in body)


def _new_loader(facts: Facts, value: cst.BaseExpression) -> bool:
    return isinstance(value, cst.Call) and resolve(dotted(value.func), facts.aliases) in (
        "torch.utils.data.DataLoader", "ddpkit.data_loader")


def attribute_reads(facts: Facts, name: str, scope: Scope) -> list[tuple[str, Scope]]:
    """For an attribute ``name`` (``self.train_loader``): the other names that read it through another object
    (``data.train_loader`` where ``data = Data()``), each once with the function it is read in; [] for a plain
    name.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("class D:\\n    def __init__(self):\\n        self.ld = f()\\nd = D()\\nfor b in d.ld:\\n"
    ...                    "    pass\\n"))
    >>> [n for n, _ in attribute_reads(facts, "self.ld", facts.scopes["D.__init__"])]
    ['d.ld']
    """
    if "." not in name:
        return []
    attribute = name.rsplit(".", 1)[1]
    found: dict[tuple[str, int], tuple[str, Scope]] = {}
    for read, where, _line, _node in facts.reads:
        if read.endswith(f".{attribute}") and not (read == name and visible(facts, name, scope, where)):
            found.setdefault((read, id(where)), (read, where))
    return list(found.values())


def _returned(facts: Facts, name: str, scope: Scope, value: cst.BaseExpression, depth: int, pick: Pick) -> list[Any]:
    elements = unpacked(value)
    indexes = [i for i, e in enumerate(elements) if dotted(e) == name]
    if not indexes:
        return []
    index = indexes[0] if len(elements) > 1 else -1
    return [r for b in _bound_from(facts, scope, index) for r in reading(facts, b.target, b.scope, pick, depth + 1)]


def _bound_from(facts: Facts, scope: Scope, index: int, depth: int = 0) -> list[Binding]:
    """The bindings of element ``index`` of what the calls of ``scope`` return, also through a function that
    returns such a call as it is (``return loaders(tr, te, bs)`` in ``get_dataset``, set 27's layer-wise trainer)."""
    found = []
    for call in facts.calls:
        target = callee(facts, call)
        if target is None or target[0] is not scope:
            continue
        found += [b for b in facts.bindings if b.whole is call.node and b.index == index]
        found += [b for outer, value in facts.returns if value is call.node and depth < 3
                  for b in _bound_from(facts, outer, index, depth + 1)]
    return found


def _returns_other(facts: Facts, value: cst.BaseExpression) -> bool:
    """``value`` calls a function of the script's own that yields nothing (VQ-VAE's ``train_losses =
    train(model, train_loader, opt)``, a dict of losses): what it returns is not the loader's items; the loops in
    it are found through its parameter."""
    call = next((c for c in facts.calls if c.node is value), None)
    target = callee(facts, call) if call is not None else None
    if target is None or m.findall(target[0].node, m.Yield()):
        return False
    # (``return iter(dl)``, ``return tqdm(dl)``: what it returns is built from a parameter: the items, passed on)
    return not any(scope is target[0] and names_in(returned) & set(scope.params) for scope, returned in facts.returns)


def _passes_items(value: cst.BaseExpression) -> bool:
    """A value that hands on the loader's items: the name itself, a split's entry of a dict of loaders, or a call
    such as ``iter``, ``tqdm``, ``enumerate`` over it (not ``len(loader)``, not ``loader.dataset``)."""
    if isinstance(value, (cst.Name, cst.Attribute)):
        return True
    if isinstance(value, cst.Subscript):  # ``train_loader = self.loaders['train']``: a dict's loader by its split
        index = value.slice[0].slice if len(value.slice) == 1 else None
        return isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString)
    # (``batch = next(iter(loader))``: one batch, whose ``batch["x"]`` a loop may split by hand: no loader)
    return isinstance(value, cst.Call) and \
        (dotted(value.func) or "").split(".")[-1] not in ("len", "list", "sum", "next")


def trains(facts: Facts, loop: Loop, depth: int = 0) -> bool:
    """A loop that runs a backward pass: ``loss.backward()`` in it, or in a function of the script it calls."""
    for call in loop.calls:
        if call.last == "backward" or id(call.node) in facts.steps:  # (another module's step: stepped.py)
            return True
        target = callee(facts, call) if depth < DEPTH else None
        # (not a helper whose step this call switches off: ``network_pass(..., train=False)``, a/s06)
        if target is not None and scope_trains(facts, target[0], depth + 1) and not step_off(facts, call, depth):
            return True
    return False


def step_off(facts: Facts, call: Call, depth: int = 0) -> bool:
    """``call`` runs a helper of the script with its every backward switched off (:func:`.flagged.switched_off`)
    and no function it calls training (review 30: ``d_step(real)`` beside ``if update_g: loss.backward()``)."""
    target = callee(facts, call)
    if target is None or not switched_off(facts, call, target[0], target[1]):
        return False
    inner = [c for c in facts.calls if c.scope is target[0]]
    return not any((t := callee(facts, c)) is not None and t[0] is not target[0] and
                   scope_trains(facts, t[0], depth + 1) for c in inner if depth < DEPTH)


def called_from_loop(facts: Facts, scope: Scope, accept: Callable[[Loop], bool] = lambda loop: True,
                     depth: int = 0) -> bool:
    """``scope`` is a function called from a loop ``accept`` takes (any loop: a draw made every step; a training
    loop: a loss helper that runs a teacher), or from a function so called."""
    if scope is facts.scopes[""] or depth >= DEPTH:
        return False
    sites = callers(facts, scope)
    return any(any(accept(loop) for loop in site.loops) or called_from_loop(facts, site.scope, accept, depth + 1)
               for site in sites)


def scope_trains(facts: Facts, scope: Scope, depth: int = 0) -> bool:
    """The function runs a backward pass, itself, in a function defined inside it (an LBFGS ``closure``) or
    through a function of the script it calls."""
    inner = {id(n) for n in m.findall(scope.node, m.FunctionDef())} if scope.name else set()
    for call in facts.calls:
        if call.scope is not scope and id(call.scope.node) not in inner:
            continue
        if call.last == "backward" or id(call.node) in facts.steps:
            return True
        target = callee(facts, call) if depth < DEPTH else None
        if target is not None and target[0] is not scope and scope_trains(facts, target[0], depth + 1):
            return True
    return False
