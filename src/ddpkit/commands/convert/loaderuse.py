"""What a script does with a loader's name, read off the scan: nothing (an unused ``test_loader``), a read,
handing it to another module's function, returning it, building it again on each pass of a loop that reads it.
:mod:`ddpkit.commands.convert.loaders` decides each loader's role and rewrite from these.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from torch.utils.data import DataLoader\\nclass A(DataLoader): pass\\nclass B(A): pass\\n"))
    >>> sorted(loader_classes(facts.module, facts.aliases))
    ['A', 'B']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import flow, trained
from ddpkit.commands.convert.flow import callee, callers, loops_reading
from ddpkit.commands.convert.names import dotted, resolve, unpacked
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop, Scope

_Work = Any  # the plan in the making (plan._Work)

LOADER = "torch.utils.data.DataLoader"


def loader_classes(module: cst.Module, aliases: dict[str, str]) -> set[str]:
    """The script's classes that derive from torch's DataLoader, directly or through each other.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from torch.utils.data import DataLoader\\nclass A(DataLoader): pass\\nclass B(A): pass\\n"))
    >>> sorted(loader_classes(facts.module, facts.aliases))
    ['A', 'B']
    """
    bases: dict[str, set[str]] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            bases[stmt.name.value] = {resolve(dotted(b.value), aliases) or "" for b in stmt.bases}
    found: set[str] = set()
    while True:
        more = {c for c, b in bases.items() if c not in found and (LOADER in b or b & found)}
        if not more:
            return found
        found |= more


def unused(work: _Work, call: Call) -> bool:
    """``test_loader = DataLoader(...)`` whose name nothing reads, as a variable or as an attribute of anything
    (``data.test_loader``): no rank takes a batch from it, so it stays as it is, said as kept (a loader of unknown
    role would otherwise be refused, one named for evaluation left to you)."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    # (a binding in a loop: the loop's next pass reads it above its line)
    if binding is None or read(work.facts, binding.target, binding.scope,
                                binding.line if flow.top_level(binding) else 0):
        return False
    name = binding.target
    # (an attribute another module may read, set 28's ``data.test_loader`` read by the script that builds ``Data()``:
    # left whole, that reader takes every batch on every rank)
    why = f"nothing in this file reads {name}: left whole, a reader in another module takes every batch on every " \
        "rank" if "." in name else f"nothing reads {name}: no rank takes a batch from it"
    work.keep(call.line, f"{name} = DataLoader(...) left as it is", why)
    return True


def read(facts: Facts, name: str, scope: Any, since: int, depth: int = 0) -> bool:
    """Whether anything reads ``name`` (bound in ``scope`` at line ``since``), as a variable or as an attribute
    of anything; handing it to a function of the script whose parameter is read nowhere there is no read
    (``train(model, train_loader, validation_loader)`` where ``train`` never uses ``validation_loader``)."""
    attribute = f".{name.rsplit('.', 1)[-1]}"  # ``self.train_loader`` read as ``data.train_loader``
    if any(read.endswith(attribute) and read != name for read, _where, _line, _node in facts.reads):
        return True
    own = _param_names(scope.node)  # the def's own names are no read
    return any((read == name or read.startswith(f"{name}.")) and flow.visible(facts, name, scope, where) and
               (where is not scope or line >= since) and id(node) not in own and
               not _handed_to_unread(facts, node, depth) for read, where, line, node in facts.reads)


def _param_names(node: Any) -> set[int]:
    if not isinstance(node, cst.FunctionDef):
        return set()
    params = node.params
    return {id(p.name) for p in (*params.posonly_params, *params.params, *params.kwonly_params)}


def _handed_to_unread(facts: Facts, node: Any, depth: int) -> bool:
    """``node`` is a whole argument of a call of the script's own function, landing in a parameter that the
    function reads nowhere (followed :data:`flow.DEPTH` calls deep)."""
    call = next((c for c in facts.calls if any(a.value is node for a in c.node.args)), None)
    target = callee(facts, call) if call is not None and depth < flow.DEPTH else None
    if call is None or target is None:
        return False
    scope, skip = target
    param = next((p for p in scope.params if flow.argument_for(call, p, scope, skip) is node), None)
    return param is not None and not read(facts, param, scope, 0, depth + 1)


def built_each_pass(work: _Work, call: Call, loops: list[Loop]) -> bool:
    """The loader is built again on each pass of a loop that also reads it: the loop holds the DataLoader call (not
    in its own header, ``for x in DataLoader(...)``: built once) and a loop over it, or a ``next()`` of it (glow's
    endless ``sample_data``); or a function builds it and a caller's loop binds it and reads it each pass (``loader =
    make_loader()`` in the epoch loop). A loop over the splits that builds each split's loader once is no such loop."""
    def inside(outer: Loop, line: int) -> bool:
        return outer.line < line <= outer.end

    for outer in call.loops:
        if any(n is call.node for n in m.findall(getattr(outer.node, "iter", cst.Name("_")), m.Call())):
            continue  # (``for x, y in DataLoader(...)``: built once, for that loop)
        nexts = [c for c in work.facts.calls if c.name == "next" and c.scope is call.scope and inside(outer, c.line)]
        if any(lp is not outer and inside(outer, lp.line) for lp in loops) or nexts:
            return True
    for site in callers(work.facts, call.scope) if call.scope.name else []:
        bound = next((b for b in work.facts.bindings if b.value is site.node), None)
        for outer in site.loops:
            reading = loops_reading(work.facts, bound.target, bound.scope, since=bound) if bound is not None else []
            if any(inside(outer, lp.line) for lp in reading):
                return True
    return False


def uncalled(work: _Work, call: Call) -> bool:
    """``call`` is in a function of a project module that no file of the project names, nor this one calls."""
    elsewhere = work.crossing.elsewhere if work.crossing is not None else None
    scope = call.scope
    return elsewhere is not None and bool(scope.name) and scope.name.rsplit(".", 1)[-1] not in elsewhere and \
        not callers(work.facts, scope) and not called(work.facts, call)


def comprehended(work: _Work, call: Call) -> bool:
    """``call`` is what a list / generator / set comprehension iterates (``[d[0] for d in DataLoader(raw)]``)."""
    for node in m.findall(call.scope.node, m.ListComp() | m.GeneratorExp() | m.SetComp()):
        comp: Any = node.for_in  # type: ignore[attr-defined]
        while comp is not None:
            if comp.iter is call.node:
                return True
            comp = comp.inner_for_in
    return False


def beside_asked(work: _Work, call: Call) -> bool:
    """``call``'s loader is returned by a function another module asks one of its other values of (``get_data()[0]``
    asked, this one ``get_data()[1]``, an unread ``val_iter``): its role is not guessed from its shuffle."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    for scope, value in work.facts.returns:
        elements = unpacked(value)
        mine = any(e is call.node or binding is not None and binding.scope is scope and dotted(e) == binding.target
                   for e in elements)
        if mine and any(w.startswith(f"{scope.name}()") for w in work.crossing.wants):
            return True
    return False


def handed_away(work: _Work, binding: Binding) -> str | None:
    """The function of another module of the project that a call of this file hands ``binding``'s loader to
    (clovaai's ``validation(model, valid_loader)``, imported from ``evaluate``), or None; not a call that hands it
    an optimizer too (``fit_epoch(model, loader, opt)`` trains: the loader's shuffle=True is believed)."""
    stepped = {dotted(c.node.func.value) for c in work.facts.calls
               if c.last in ("step", "zero_grad") and isinstance(c.node.func, cst.Attribute)}
    made = {id(c.node) for c in work.facts.calls if trained.optimizer(c)}
    stepped |= {b.target for b in work.facts.bindings if id(b.value) in made}  # (``opt = SGD(...)``)
    for call in work.facts.calls:
        func = dotted(call.node.func)
        if func is None or imported_from(work.facts, func) is None or \
                any(dotted(a.value) in stepped for a in call.node.args):
            continue
        for arg in call.node.args:
            name = dotted(arg.value)
            if name == binding.target and flow.binding_of(work.facts, name, call.scope, call.line) is binding:
                return func
    return None


def called(facts: Facts, call: Call) -> bool:
    """The function whose ``return`` holds ``call`` is called somewhere in this file, other than by a function
    that only hands its loader on, returned, and is called here by nothing in turn (``get_loaders()`` returning
    ``get_test_loader()``'s with the others, for another module: set 27's extra five)."""
    return _called(facts, call.scope, 0)


def _called(facts: Facts, scope: Any, depth: int) -> bool:
    name = scope.name.rsplit(".", 1)[-1]
    if any((read == name or read.endswith(f".{name}")) and node is not getattr(scope.node, "name", None) and
           not any(c.node.func is node for c in callers(facts, scope))
           for read, _, _, node in facts.reads):  # a dict of factories, partial(f): a use that is no call
        return True
    for site in callers(facts, scope):
        outer = site.scope
        handed = any(s is outer and any(e is site.node for e in unpacked(v)) for s, v in facts.returns) or any(
            b.value is site.node and b.scope is outer and returns(facts, b) for b in facts.bindings)
        if not (handed and outer.name and depth < 3) or _called(facts, outer, depth + 1):
            return True
    return False


def returns(facts: Facts, binding: Binding) -> bool:
    """The function that binds ``binding`` returns it (``loader = DataLoader(...)`` then ``return loader``)."""
    return any(scope is binding.scope and any(dotted(e) == binding.target for e in unpacked(value))
               for scope, value in facts.returns if scope.name)


WRAPS = ("enumerate", "tqdm", "iter")  # what a loop iterates through to its iterable
UNHANDED = ("len", "print", "str", "repr", "type")  # calls that read a loader without taking it on


def unwrapped(node: Any) -> Any:
    """``enumerate(tqdm(make(dev)))`` -> ``make(dev)``: the iterable a loop takes its items from."""
    while isinstance(node, cst.Call) and (dotted(node.func) or "").split(".")[-1] in WRAPS and node.args:
        node = node.args[0].value
    return node


def iterated_ids(facts: Facts, statements: bool = True) -> set[int]:
    """The nodes comprehensions iterate (``for x, y in make(dev)`` of a generator), and with ``statements`` for
    statements too, through enumerate / tqdm / iter."""
    kinds = m.For() | m.CompFor() if statements else m.CompFor()
    return {id(unwrapped(n.iter)) for n in m.findall(facts.module, kinds) if isinstance(n, (cst.For, cst.CompFor))}


def handed_on(facts: Facts) -> set[int]:
    """The nodes handed to a call as an argument (``evaluate(model, make_loader(128, 64))``), not to one that only
    reads them (``len(make_loader(...))``)."""
    return {id(a.value) for c in facts.calls if c.last not in UNHANDED for a in c.node.args}


def iterated_call(facts: Facts, loop: Loop, own: frozenset[str], bound: bool = False) -> str | None:
    """The function of another module of the project (``own``: its modules) whose call a for loop iterates, itself
    or through ``enumerate`` / ``tqdm`` (an LSTM project's ``for x, y in utils.create_dataset(train, bs):``); with
    ``bound``, also through a name bound to that call above the loop (``train_loader = utils.create_dataset(...)``).
    """
    node = unwrapped(loop.node.iter) if isinstance(loop.node, cst.For) else None
    if bound and not isinstance(node, cst.Call) and dotted(node):
        held = flow.binding_of(facts, str(dotted(node)), loop.scope, loop.line)
        node = held.value if held is not None else None
    name = dotted(node.func) if isinstance(node, cst.Call) else None
    origin = imported_from(facts, name) if name else None
    return name if origin is not None and origin[0].split(".")[0] in own else None


def iterated_in_place(facts: Facts, call: Call) -> list[Call]:
    """The calls of the function that returns ``call``'s loader whose value no name holds, iterated in place (``for
    x, y in create_dataset(dev, batch_size=1)``, in a generator or a for statement) or handed on to a function;
    none where it is not returned."""
    returning = [scope for scope, value in facts.returns if any(e is call.node for e in unpacked(value))]
    unbound = iterated_ids(facts) | handed_on(facts)
    return [c for scope in returning[:1] for c in callers(facts, scope) if id(c.node) in unbound]


def returned(facts: Facts, call: Call) -> list[Binding] | None:
    """``return DataLoader(...)`` (or one of a returned tuple): what the function's callers bind it to
    (``train_loader = get_loader(args)``); None when the call is not returned."""
    return _returned(facts, call.node)


def _returned(facts: Facts, node: cst.CSTNode, depth: int = 0) -> list[Binding] | None:
    """:func:`returned` of a returned call, followed through functions that return their call of it in turn
    (bert-classification-tutorial's ``load_dataset`` returning ``self.create_loader(...)``, three deep)."""
    for scope, value in facts.returns:
        elements = unpacked(value)
        if any(e is node for e in elements):
            index = next(i for i, e in enumerate(elements) if e is node) if len(elements) > 1 else -1
            sites = callers(facts, scope)
            found = [b for b in facts.bindings if any(b.whole is c.node for c in sites) and b.index == index or
                     index == -1 and b.index >= 0 and any(b.value is c.node for c in sites)]  # ``a, b = f(x), f(y)``
            for site in sites if index == -1 and depth < 3 else ():
                found += _returned(facts, site.node, depth + 1) or []
            return found
    return None


def comprehensions_reading(facts: Facts, bindings: list[Binding]) -> list[tuple[int, bool]]:
    """(line, it trains) of each comprehension that iterates the loader these bind, where its value goes (the ways
    of :func:`~ddpkit.commands.convert.flow.loops_reading`): an evaluation written ``sum(f(x) for x, y in
    test_loader)`` has no loop, yet reads the loader whole; one whose element runs a backward (itself or through
    a helper of the script whose step it leaves on) trains.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("ld = f()\\ndef ev(d):\\n    return sum(g(x) for x in d)\\nprint(ev(ld))\\n"))
    >>> comprehensions_reading(facts, [facts.bindings[0]])
    [(3, False)]
    """
    # (not one whose list a loop then trains on, ``batches = [b for b in loader]``: its loops decide)
    looped = {id(b.value) for b in facts.bindings if b.value is not None and loops_reading(facts, b.target, b.scope)}
    comps = [c for c in m.findall(facts.module, m.ListComp() | m.GeneratorExp() | m.SetComp() | m.DictComp())
             if id(c) not in looped]
    held = {id(node): comp for comp in comps for clause in m.findall(comp, m.CompFor())
            for node in _items(clause.iter)}  # type: ignore[attr-defined]

    def pick(facts: Facts, name: str, scope: Scope, reached: Any) -> list[Any]:
        if any(b.target == name and b.scope is scope and isinstance(b.value, cst.Call) and dotted(b.value.func) ==
               "next" for b in facts.bindings):  # (``batch = next(it)``: one batch, its tensors comprehended)
            return []
        return [read for read in facts.reads if read[0] == name and id(read[3]) in held and
                flow.visible(facts, name, scope, read[1]) and reached(read[1], read[2])]
    found = [read for b in bindings for read in flow.reading(facts, b.target, b.scope, pick, since=b)]
    return sorted({(read[2], _comprehension_trains(facts, held[id(read[3])])) for read in found})


def _items(node: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The names a comprehension's ``in`` takes items from: ``loader`` of ``enumerate(tqdm(loader))``, not of
    ``range(epochs * len(loader))`` (a table of numbers)."""
    if isinstance(node, (cst.Name, cst.Attribute)):
        return [node]
    if isinstance(node, cst.Call) and (dotted(node.func) or "").rsplit(".", 1)[-1] not in ("len", "range", "int"):
        return [n for a in node.args for n in _items(a.value)]
    return []


def _comprehension_trains(facts: Facts, comp: cst.CSTNode) -> bool:
    inside = {id(node) for node in m.findall(comp, m.Call())}
    for call in (c for c in facts.calls if id(c.node) in inside):
        target = callee(facts, call)
        if call.last == "backward" or id(call.node) in facts.steps or target is not None and \
                flow.scope_trains(facts, target[0]) and not flow.step_off(facts, call):
            return True
    return False


def comprehended_only(work: _Work, call: Call, comprehended: list[tuple[int, bool]]) -> bool:
    """A loader read only by comprehensions: one that trains is refused (no loop to shard and reduce in); an
    evaluation stays whole, each rank reading every batch (its sum is then the whole set's on every rank)."""
    where = ", ".join(str(line) for line, _ in comprehended)
    if any(trains for _, trains in comprehended):
        work.leave(call.line, f"a DataLoader read by a comprehension that trains (line {where}): its batches "
                   "cannot be shared out there", "write the training as a for loop over the loader, then convert "
                   "again", blocks=True)
        return True
    work.keep(call.line, f"a DataLoader read only by a comprehension (line {where}) that does not train, left as "
              "it is", "an evaluation (sum(f(x) for x in loader)): every rank evaluates the whole set, which is "
              "right (to share the work: write it as a for loop, and convert again)")
    return False


def passed_up(facts: Facts, names: list[str]) -> list[str]:
    """What the file's other functions return the loaders ``names`` name as (``get_train_val_loaders()[0]``, bound
    by ``get_loaders`` as ``train_loader, val_loader = get_train_val_loaders(bs)`` and returned first in turn:
    ``get_loaders()[0]``, the name another module asks by; set 27's extra five), three functions deep.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("def a():\\n    return x, y\\ndef b():\\n    p, q = a()\\n    return q, p, 3\\n"))
    >>> passed_up(f, ["a()[0]", "a()[1]"])
    ['b()[1]', 'b()[0]']
    """
    found: list[str] = []
    frontier = list(names)
    for _ in range(3):
        ahead = []
        for name in frontier:
            function, _, rest = name.partition("()")
            index = int(rest[1:-1]) if rest.startswith("[") and rest[1:-1].lstrip("-").isdigit() else -1
            scope = facts.scopes.get(function)
            for site in callers(facts, scope) if scope is not None and not rest[len(f"[{index}]"):] else []:
                held = {b.target for b in facts.bindings if b.whole is site.node and b.index == index or
                        index == -1 and b.value is site.node}
                for outer, value in facts.returns:
                    elements = unpacked(value)
                    ahead += [f"{outer.name}()" + (f"[{i}]" if len(elements) > 1 else "")
                              for i, e in enumerate(elements) if outer is site.scope and outer.name and
                              dotted(e) in held]
                    # (``return loaders(tr, te, bs)``: the call returned as it is, its elements the same)
                    ahead += [f"{outer.name}(){rest}"] if value is site.node and outer.name else []
        found += [n for n in ahead if n not in found and n not in names]
        frontier = ahead
    return found
