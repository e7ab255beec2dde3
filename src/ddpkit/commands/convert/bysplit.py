"""One DataLoader line for every split: a factory that builds the loader its caller names by a string
(``data_provider(args, 'train')``, or ``self._get_data(flag='val')`` which passes its ``flag`` on: the experiment
classes of the time-series forecasting repositories; ``get_loader(split='test')``). What one call trains on and
another evaluates comes from the same ``DataLoader(...)``, so the split's string decides it.

An ask from another module names the strings its call passes with the returned value (:func:`literals`:
``data_provider()[1]@[["#1", "train"]]``, ``#1`` the position, or the keyword). The factory's side (:func:`split`)
reads every such ask of one function and every call of it in its own file: when the calls that train pass one
string (or a few) and those that evaluate others, at the same parameter, the loader becomes
``ddpkit.data_loader(...) if flag == 'train' else DataLoader(...)`` (each rank evaluates every batch of the others,
which is right). Calls no string tells apart, or a parameter the factory rebinds before the loader
(``flag = flag.lower()``), keep one role, as before.

Example::

    >>> asks = {'get()[0]@[["#1", "train"]]': TRAIN, 'get()[0]@[["flag", "val"]]': EVAL}
    >>> decide(list(asks), asks, ["args", "flag"])
    ('flag', ('train',))
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import bykey, flow, loaderuse, roles
from ddpkit.commands.convert.crossing import EVAL, TRAIN, returned
from ddpkit.commands.convert.names import dotted, unpacked
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop, Scope

_Work = Any  # the plan in the making (plan._Work)

MARK = "@"  # between what a function returns and the strings its call passes (JSON: any string survives)


@dataclasses.dataclass(frozen=True)
class Split:
    """The factory's ``param``, the strings of the splits trained on, and this file's loops that train on them."""
    param: str
    values: tuple[str | bool, ...]  # (``train=True``: a flag)
    loops: tuple[Loop, ...] = ()
    picker: str = ""  # the variable of a loop over every split around ``loops``: their sums are reduced for the
    # trained splits only (``loss_sum = ddpkit.reduce(loss_sum) if phase == 'train' else loss_sum``)


def literals(call: cst.Call, passed: Callable[[str], cst.BaseExpression | None]) -> str:
    """The plain strings (and True / False) ``call`` passes, as a qualifier (``@[["#1", "train"]]``; "" when none):
    written there, or a parameter of the enclosing function that its caller passes one for (``passed(name)``: what
    the caller passes as that parameter, None when not one or when the function rebinds it)."""
    found = []
    position = 0
    for arg in call.args:
        if arg.star:
            return ""  # positions after ``*args`` cannot be told
        where = arg.keyword.value if arg.keyword is not None else f"#{position}"
        position += arg.keyword is None
        value = arg.value
        if isinstance(value, cst.Name) and value.value in ("True", "False"):  # ``get_dataloader(ds, bs, train=False)``
            found.append([where, value.value == "True"])
            continue
        if isinstance(value, cst.Name):
            value = passed(value.value) or value
        if isinstance(value, cst.SimpleString) and isinstance(value.evaluated_value, str):
            found.append([where, value.evaluated_value])
        else:  # passed, not as a literal (``shuffle=SHUFFLE``): not the parameter's default (review 29)
            found.append([where, None])
    return MARK + json.dumps(found) if found else ""


def told(name: str) -> bool:
    """A qualified ask names at least one string (or True / False) its call passes.

    >>> told('get()[0]@[["#0", null], ["#1", "train"]]'), told('get()[0]@[["#0", null]]'), told("get()[0]")
    (True, False, False)
    """
    return MARK in name and any(value is not None for _, value in json.loads(name.split(MARK, 1)[1]))


def base(name: str) -> str:
    """The returned value a qualified ask names: ``get()[0]`` of ``get()[0]@[["#1", "train"]]``."""
    return name.split(MARK, 1)[0]


def _strings(name: str, params: list[str],
             defaults: dict[str, str | bool] | None = None) -> dict[str, str | bool | None]:
    """``{'flag': 'train'}`` of ``get()[0]@[["#1", "train"]]`` for a factory ``get(args, flag)``: each string by
    the parameter it lands in (``self`` left out of ``params``); a parameter the call leaves out holds its
    literal default (``make_loader(16)`` of ``make_loader(batch_size, is_training=True)``)."""
    found: dict[str, str | bool | None] = {}
    for where, value in json.loads(name.split(MARK, 1)[1]) if MARK in name else ():
        index = int(where[1:]) if where.startswith("#") else -1
        param = params[index] if 0 <= index < len(params) else where if where in params else None
        if param is not None:  # (None: passed as something else than a literal, which cannot be told)
            found[param] = value
    for param, value in (defaults or {}).items():  # (after those passed: a string passed decides first)
        found.setdefault(param, value)
    return found


def decide(names: list[str], kinds: dict[str, str], params: list[str],
           defaults: dict[str, str | bool] | None = None) -> tuple[str, tuple[str | bool, ...]] | None:
    """(the parameter, the training strings) when the asks ``names`` of one returned value (with their ``kinds``)
    split by the string passed as one parameter (or its literal default, ``defaults``): every training ask passes
    one, every evaluation ask one of others; None when they do not (one role, or no string tells them apart).

    >>> decide(["get()@[]", 'get()@[["#1", false]]'], {"get()@[]": TRAIN, 'get()@[["#1", false]]': EVAL},
    ...        ["bs", "is_training"], {"is_training": True})
    ('is_training', (True,))
    """
    train = [_strings(n, params, defaults) for n in names if kinds[n] == TRAIN]
    evaluate = [_strings(n, params, defaults) for n in names if kinds[n] == EVAL]
    if not train or not evaluate:
        return None
    for param in train[0]:
        told = {t.get(param) for t in train}
        if None in told or any(e.get(param) in told | {None} for e in evaluate):
            continue
        return param, tuple(sorted((v for v in told if v is not None), key=repr))
    return None


def rebound(facts: Facts, scope: Scope, param: str, before: int = 1 << 30) -> bool:
    """``param`` of ``scope`` is bound again in it before line ``before`` (``flag = flag.lower()``,
    ``path = os.path.join(root, path)``): the string its caller passes is no longer what it holds. (The parameter's
    own binding has no statement.)"""
    return any(b.target == param and b.scope is scope and b.line < before and
               (b.stmt is not None or b.value is not None or b.whole is not None) for b in facts.bindings)


def asked(work: _Work, call: Call) -> list[str]:
    """Every ask of another module that names ``call``'s loader: by the module-level name it is bound to, what a
    function returns it as (``get_loaders()[0]``, each split's ``get()[0]@#1='train'`` included) or the attribute
    of its class's instance (``Cifar().train``: ``self.train = DataLoader(...)``)."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    names = [binding.target] if binding is not None and binding.scope.name == "" else []
    if binding is not None and binding.scope.cls and binding.target.startswith("self."):  # ``Cifar().train``
        names.append(f"{binding.scope.cls}().{binding.target[5:]}")
        names += [f"{scope.name}().{binding.target[5:]}" for scope, value in work.facts.returns  # ``create()``
                  if not scope.cls and isinstance(value, cst.Call) and dotted(value.func) == binding.scope.cls]
    # (a helper's ``return DataLoader(...)`` that a method binds and returns in turn: ``train_loader =
    # self._make(ds, shuffle=True)``, ``return train_loader`` in ``Loaders.get``, asked as ``Loaders.get()``)
    holders = [binding] if binding is not None else loaderuse.returned(work.facts, call) or []
    for holder in holders:
        copies = {holder.target}
        for _ in range(3):  # (FactorVAE's ``data_loader = train_loader`` before ``return data_loader``)
            copies |= {b.target for b in work.facts.bindings if b.scope is holder.scope and
                       b.value is not None and dotted(b.value) in copies}
        # (an attribute set in one method and returned by another of its class: ``self.train_loader`` of
        # ``data_loaders()``, returned by ``load()`` as ``return self.train_loader, self.val_loader``)
        kept = holder.target.startswith("self.") and holder.scope.cls is not None
        for scope, value in work.facts.returns:
            elements = unpacked(value)
            mine = holder.scope is scope or kept and scope.cls == holder.scope.cls
            names += [returned(scope.name, i if len(elements) > 1 else -1) for i, element in enumerate(elements)
                      if mine and dotted(element) in copies]
    # (``return self._make(train, True), self._make(test, False)``: each call of the helper that returns it,
    # returned in turn as one of a tuple, is asked by its index)
    sites = {id(c.node) for c in flow.callers(work.facts, call.scope)} if _position(work, call) == -1 else set()
    for scope, value in work.facts.returns:
        elements = unpacked(value)
        names += [returned(scope.name, i if len(elements) > 1 else -1) for i, element in enumerate(elements)
                  if element is call.node or id(element) in sites and len(elements) > 1]
    names += [returned(lp.scope.name, -1) for lp in _generators(work.facts, binding)]
    names += loaderuse.passed_up(work.facts, names)  # (returned by another function of the file in turn)
    return [n for n in work.crossing.wants if base(n) in names and work.crossing.wants[n] in (TRAIN, EVAL) and
            not _contradicted(call, n)]


def _contradicted(call: Call, name: str) -> bool:
    """The strings an ask passes never reach ``call``: it sits under ``if phase == 'test':`` and the ask passes
    ``phase='train'`` (yakunpku's ``create_dataloader``, one DataLoader a branch, each returned)."""
    params = [p for p in call.scope.params if p not in ("self", "cls")]
    passed = _strings(name, params, _defaults(call.scope.node))
    for test, holds in branches(call):
        for param, value in passed.items():
            compared = bykey.equals(test, param)
            # (in the ``if``'s body the test holds: the string must be one it compares to; in its ``else`` or
            # a later ``elif``, it does not: the string must be none of them)
            if compared and isinstance(value, str) and (value not in compared if holds else value in compared):
                return True
    return False


def branches(call: Call) -> list[tuple[str, bool]]:
    """Each ``if`` of ``call``'s function around it: (its test, whether ``call`` is in its body, where the test
    holds, rather than its ``else`` / ``elif``)."""
    code = cst.Module(body=[]).code_for_node
    found = []
    for node in m.findall(call.scope.node, m.If()):
        assert isinstance(node, cst.If)
        if any(n is call.node for n in m.findall(node.body, m.Call())):
            found.append((code(node.test), True))
        elif node.orelse is not None and any(n is call.node for n in m.findall(node.orelse, m.Call())):
            found.append((code(node.test), False))
    return found


def _generators(facts: Facts, binding: Binding | None) -> list[Loop]:
    """The loops of generators that yield the batches of the loader ``binding`` holds, one by one (gandalf's
    ``def batches(self): for img, _ in self.dataloader: yield img.view(...)``): another module's loop over
    ``data.batches()`` trains on that loader."""
    if binding is None or binding.scope.name and not binding.target.startswith("self."):
        return []  # (a function's local loader: no generator of another function reads it)
    mine = binding.target.startswith("self.")
    return [lp for lp in facts.loops if isinstance(lp.node, cst.For) and lp.scope.name and roles.passes_on(lp) and
            dotted(lp.node.iter) == binding.target and (not mine or lp.scope.cls == binding.scope.cls)]


def split(work: _Work, call: Call) -> Split | None:
    """How ``call``'s loader splits (:class:`Split`), from the asks of other modules (:func:`asked`) and the calls
    of its function in this file (:func:`_sites`); None when it does not."""
    params = [p for p in call.scope.params if p not in ("self", "cls")]
    sites = _sites(work, call)
    tupled = {_tuple_element(work, site)[0] for site in flow.callers(work.facts, call.scope)} - {None}
    kinds = {n: work.crossing.wants[n] for n in asked(work, call) if base(n) not in tupled}  # (told by sites)
    kinds.update({n: kind for n, (kind, _) in sites.items()})
    decided = decide(list(kinds), kinds, params, _defaults(call.scope.node)) if call.scope.name else None
    if decided is None:
        return _looped(work, call)
    if rebound(work.facts, call.scope, decided[0], call.line):
        return None
    values = decided[1]
    mine = [lp for n, (kind, read) in sites.items() if kind == TRAIN for lp in read]
    return Split(decided[0], values, tuple(mine))


def _defaults(function: cst.CSTNode) -> dict[str, str | bool]:
    """A function's parameters whose default is a plain string or True / False (``is_training=True``)."""
    found: dict[str, str | bool] = {}
    params = function.params if isinstance(function, cst.FunctionDef) else None
    for param in [*params.params, *params.kwonly_params] if params is not None else []:
        value = param.default
        if isinstance(value, cst.Name) and value.value in ("True", "False"):
            found[param.name.value] = value.value == "True"
        elif isinstance(value, cst.SimpleString) and isinstance(value.evaluated_value, str):
            found[param.name.value] = value.evaluated_value
    return found


def _looped(work: _Work, call: Call) -> Split | None:
    """The loader built in a loop over the splits' strings, whose step runs for some only (Sentence-VAE: ``for
    split in ['train', 'valid']: data_loader = DataLoader(datasets[split], ...)``, then ``if split == 'train':
    loss.backward()``): split by that loop's variable.

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = Net()\\n"
    ...             "opt = torch.optim.SGD(m.parameters(), lr=1)\\nfor split in ['train', 'valid']:\\n"
    ...             "    dl = DataLoader(ds[split], batch_size=4)\\n    for x in dl:\\n"
    ...             "        if split == 'train':\\n            m(x).backward()\\n            opt.step()\\n").text
    >>> next(line for line in text.splitlines() if line.startswith("    dl = ")).split(" if ")[1]
    "split == 'train' else DataLoader(ds[split], batch_size=4)"
    """
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    over = next((lp for lp in reversed(call.loops) if len(lp.targets) == 1 and _strings_of(lp)), None)
    if binding is None or over is None:
        return None
    param, splits = next(iter(over.targets)), _strings_of(over)
    read = flow.loops_reading(work.facts, binding.target, binding.scope, since=binding)
    steps = [c for lp in read for c in lp.calls if c.last == "backward"]
    values = {v for c in steps for v in _tested(c, param)} & splits  # ``if split == 'train':`` around the step
    if not steps or not values or values == splits or any(not (_tested(c, param) & values) for c in steps):
        return None
    return Split(param, tuple(sorted(values)), tuple(lp for lp in read if flow.trains(work.facts, lp)), param)


def _tested(call: Call, param: str) -> set[Any]:
    """The strings the ``if`` tests around ``call`` compare ``param`` to."""
    return {v for test in call.tests for v in bykey.equals(test, param)}


def _strings_of(loop: Loop) -> frozenset[str]:
    """The strings a ``for`` loop goes over, written as a list or tuple of them (empty: anything else)."""
    return bykey.over_strings(getattr(loop.node, "iter", None))


def _sites(work: _Work, call: Call) -> dict[str, tuple[str, list[Loop]]]:
    """Each call of ``call``'s function in this file that binds the loader it returns: (a name with the strings it
    passes, (its kind: whether a loop over what it binds trains, those loops))."""
    index = _position(work, call)
    found: dict[str, tuple[str, list[Loop]]] = {}
    if index is None:
        return found
    for n, site in enumerate(flow.callers(work.facts, call.scope)):
        bound = [b for b in work.facts.bindings if (b.index == index and b.whole is site.node if index >= 0 else
                                                    b.value is site.node)]  # (``a, b = f(x), f(y)``: each)
        # (``return self._make(a), self._make(b)``, or each bound to a name first: other modules' asks)
        name, asked = _tuple_element(work, site) if index == -1 else (None, [])
        if name is not None and not asked and not bound and not loaderuse.returned(work.facts, site):
            continue  # (an element nothing reads, here or elsewhere)
        bound = bound or loaderuse.returned(work.facts, site) or []
        read = [lp for b in bound for lp in flow.loops_reading(work.facts, b.target, b.scope, since=b)]
        kind = TRAIN if TRAIN in asked or any(flow.trains(work.facts, lp) for lp in read) else EVAL
        found[f"{n}(){literals(site.node, lambda _: None)}"] = (kind, read)
    return found


def both_roles(work: _Work, call: Call) -> bool:
    """``call``'s function is returned as elements of a tuple, one trained on and one evaluated (``return
    self._make(train), self._make(test)``), with no argument that tells them apart (:func:`split` found none)."""
    tupled = any(_tuple_element(work, site)[0] is not None for site in flow.callers(work.facts, call.scope))
    return tupled and {TRAIN, EVAL} <= {kind for kind, _ in _sites(work, call).values()}


def _tuple_element(work: _Work, site: Call) -> tuple[str | None, list[str]]:
    """What ``site`` (a call of the loader's function) is returned as, one of a tuple (``return self._make(train,
    True), self._make(test, False)``: ``Loaders.get()[0]``), and the kinds other modules ask of it; (None, [])
    when it is no element of a returned tuple. Also through a name bound to it first (``train_loader =
    self._make(train)``, then ``return train_loader, test_loader``)."""
    bound = {b.target for b in work.facts.bindings if b.value is site.node and b.scope is site.scope}

    def mine(element: cst.BaseExpression) -> bool:
        return element is site.node or dotted(element) in bound
    for scope, value in work.facts.returns:
        elements = unpacked(value)
        if len(elements) > 1 and any(mine(e) for e in elements) and \
                (scope is site.scope or any(e is site.node for e in elements)):
            name = returned(scope.name, next(i for i, e in enumerate(elements) if mine(e)))
            return name, [kind for n, kind in work.crossing.wants.items() if base(n) == name]
    return None, []


def _position(work: _Work, call: Call) -> int | None:
    """Where its function returns ``call``'s loader: its index in a returned tuple, -1 as the whole value; None
    when it does not return it."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    for where, value in work.facts.returns:
        elements = unpacked(value)
        for i, element in enumerate(elements if where is call.scope else []):
            if element is call.node or binding is not None and dotted(element) == binding.target:
                return i if isinstance(value, cst.Tuple) else -1
    return None


def by_split(work: _Work, call: Call, split: Split, load: Callable[..., bool]) -> bool:
    """``ddpkit.data_loader(...) if flag == 'train' else DataLoader(...)``: sharded for the splits trained on,
    whole for those only evaluated; this file's loops over the training splits are the loader's."""
    when = (split.picker, _code(condition(split.picker, split.values))) if split.picker else None
    training = load(work, call, "train", list(split.loops), when)
    work.done.extend(n for n in asked(work, call) if work.crossing.wants[n] == TRAIN)
    if id(call.node) not in work.edits.expr:  # refused or left as it is (what its loops keep, said there)
        return training
    work.log = [e for e in work.log if not (e.line == call.line and e.what.startswith("DataLoader -> "))]
    sharded = work.edits.expr[id(call.node)]
    work.edits.expr[id(call.node)] = lambda node: cst.IfExp(test=condition(split.param, split.values),
                                                            body=sharded(node), orelse=node)
    shown, test = " or ".join(map(repr, split.values)), _code(condition(split.param, split.values))
    what = f"the loader made with {split.param}={split.values[0]}" if isinstance(split.values[0], bool) else \
        f"the {shown} split"
    work.note(f"DataLoader -> ddpkit.data_loader if {test}",
              f"{what} is trained on, the others only evaluated: those stay whole DataLoaders (each rank "
              "evaluates every batch, which is right)", call.line)
    return training


def by_key(work: _Work, call: Call, load: Callable[..., bool]) -> bool | None:
    """A loader held in a dict by its split's string (:mod:`.bykey`): the comprehension split by its variable, a
    literal's trained keys sharded and the others kept whole; whether it trains. None: not held so, or which keys
    are trained on cannot be told (refused as any loader inside an expression)."""
    held = bykey.holder(work.facts, call.node)
    found = bykey.trained(work.facts, held) if held is not None else None
    if held is None or found is None or not found[0]:
        return None
    keys, loops, picker = found
    if held.evaluated and held.key in keys:  # (trained on, and evaluated by its own name: the loops say apart)
        return None
    values = tuple(sorted(keys))
    if held.key is None and keys != held.strings:
        return by_split(work, call, Split(str(held.param), values, tuple(lp for lp, _ in loops), picker or ""), load)
    if held.key is not None and held.key not in keys:
        work.keep(call.line, f"the DataLoader {held.name}[{held.key!r}] left as it is", "no loop trains on it: each "
                  "rank evaluates all of it, which is right")
        return False
    when = (picker, _code(condition(picker, values))) if picker and keys != held.strings else None
    return load(work, call, "train", [lp for lp, key in loops if held.key is None or key in (held.key, None)], when)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def converted(node: cst.Call, module: cst.Module) -> bool:
    """``node`` is the whole-loader side of a split written already (``ddpkit.data_loader(...) if flag == 'train'
    else DataLoader(...)``): a second convert leaves it."""
    for found in m.findall(module, m.IfExp(orelse=m.Call())):
        if isinstance(found, cst.IfExp) and found.orelse is node and isinstance(found.body, cst.Call) and \
                (dotted(found.body.func) or "").endswith("data_loader"):
            return True
    return False


def condition(param: str, values: tuple[str | bool, ...]) -> cst.BaseExpression:
    """``flag == 'train'``, or ``flag in ('TRAIN', 'train')``; ``train`` for a flag the training calls pass True
    (``not train``: False)."""
    if values in ((True,), (False,)):
        return cst.parse_expression(param if values[0] else f"not {param}")
    if len(values) == 1:
        return cst.parse_expression(f"{param} == {values[0]!r}")
    return cst.parse_expression(f"{param} in ({', '.join(map(repr, values))})")
