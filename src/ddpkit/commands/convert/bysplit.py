"""One DataLoader line for every split: a factory of another module that builds the loader the caller names by a
string (``data_provider(args, 'train')``, ``self._get_data(flag='val')`` which passes its ``flag`` on: the
experiment classes of the time-series forecasting repositories, ``get_loader(split='test')``). What one call
trains on and another evaluates comes from the same ``DataLoader(...)``, so the split's string decides it.

The asking side names the string with the returned value (:func:`qualified`: ``data_provider()[1]@#1='train'``,
``#1`` the position it is passed at, or the keyword). The factory's side (:func:`decide`) reads every such ask of
one function: when the training ones pass one string and the evaluation ones others at the same place, the
loader becomes ``ddpkit.data_loader(...) if flag == 'train' else DataLoader(...)`` (each rank evaluates every
batch of the others, which is right); asks that pass no telling string are one role, as before.

Example::

    >>> decide(["get()[0]@#1='train'", "get()[0]@#1='val'"], {"get()[0]@#1='train'": "training loader",
    ...         "get()[0]@#1='val'": "evaluation loader"}, ["args", "flag"])
    ('flag', 'train')
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.crossing import EVAL, TRAIN, returned
from ddpkit.commands.convert.scan import Call, Loop, dotted

_Work = Any  # the plan in the making (plan._Work)

MARK = "@"  # between what a function returns and the strings its call passes


def literals(call: cst.Call, passed: Callable[[str], cst.BaseExpression | None]) -> str:
    """The plain strings ``call`` passes, as a qualifier (``@#1='train'``, ``@split='val'``; "" when none): written
    there, or a parameter of the enclosing function that its caller passes one for (``passed(name)``: what the
    caller passes as that parameter, None when not one)."""
    found = []
    position = 0
    for arg in call.args:
        if arg.star:
            return ""  # positions after ``*args`` cannot be told
        where = arg.keyword.value if arg.keyword is not None else f"#{position}"
        position += arg.keyword is None
        value = arg.value
        if isinstance(value, cst.Name):
            value = passed(value.value) or value
        if isinstance(value, cst.SimpleString) and isinstance(value.evaluated_value, str):
            found.append(f"{where}={value.evaluated_value!r}")
    return MARK + ",".join(found) if found else ""


def base(name: str) -> str:
    """The returned value a qualified ask names: ``get()[0]`` of ``get()[0]@#1='train'``."""
    return name.split(MARK, 1)[0]


def _strings(name: str) -> dict[str, str]:
    """``{'#1': 'train'}`` of ``get()[0]@#1='train'``."""
    found = {}
    for part in name.partition(MARK)[2].split(",") if MARK in name else ():
        where, _, value = part.partition("=")
        found[where] = ast.literal_eval(value)
    return found


def decide(names: list[str], kinds: dict[str, str], params: list[str]) -> tuple[str, str] | None:
    """(the parameter, the training string) when the asks ``names`` of one returned value (with their ``kinds``)
    split by one string passed at one place, the training asks all passing the same one and the evaluation asks
    others; None when they do not (one role, or no string tells them apart). ``params``: the factory's parameters,
    ``self`` left out."""
    train = [_strings(n) for n in names if kinds[n] == TRAIN]
    evaluate = [_strings(n) for n in names if kinds[n] == EVAL]
    if not train or not evaluate:
        return None
    for where in train[0]:
        told = {t.get(where) for t in train}
        if len(told) != 1 or None in told or any(e.get(where) in told | {None} for e in evaluate):
            continue
        value = told.pop()
        param = params[int(where[1:])] if where.startswith("#") and int(where[1:]) < len(params) else \
            where if where in params else None
        if param is not None and value is not None:
            return param, value
    return None


def asked(work: _Work, call: Call) -> list[str]:
    """Every ask of another module that names ``call``'s loader: by the module-level name it is bound to, what a
    function returns it as (``get_loaders()[0]``, each split's ``get()[0]@#1='train'`` included) or the attribute
    of its class's instance (``Cifar().train``: ``self.train = DataLoader(...)``)."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    names = [binding.target] if binding is not None and binding.scope.name == "" else []
    if binding is not None and binding.scope.cls and binding.target.startswith("self."):  # ``Cifar().train``
        names.append(f"{binding.scope.cls}().{binding.target[5:]}")
    for scope, value in work.facts.returns:
        elements = [e.value for e in value.elements] if isinstance(value, (cst.Tuple, cst.List)) else [value]
        for i, element in enumerate(elements):
            if element is call.node or binding is not None and binding.scope is scope and \
                    dotted(element) == binding.target:
                names.append(returned(scope.name, i if len(elements) > 1 else -1))
    return [n for n in work.crossing.wants if base(n) in names and work.crossing.wants[n] in (TRAIN, EVAL)]


def split(work: _Work, call: Call) -> tuple[str, str] | None:
    """(the parameter, the training string) when the asks of ``call``'s loader split by a string its function is
    passed (:func:`.bysplit.decide`)."""
    params = [p for p in call.scope.params if p not in ("self", "cls")]
    return decide(asked(work, call), work.crossing.wants, params)


def by_split(work: _Work, call: Call, param: str, value: str, load: Callable[[_Work, Call, str], bool]) -> bool:
    """``ddpkit.data_loader(...) if flag == 'train' else DataLoader(...)``: sharded for the split another module
    trains on, whole for those it evaluates."""
    training = load(work, call, "train")
    work.done.extend(n for n in asked(work, call) if work.crossing.wants[n] == TRAIN)
    work.log = [e for e in work.log if not (e.line == call.line and e.what.startswith("DataLoader -> "))]
    whole_otherwise(work, call, param, value, "another module of the project")
    return training


def whole_otherwise(work: _Work, call: Call, param: str, value: str, where: str) -> None:
    """The loader's rewrite made ``ddpkit.data_loader(...) if flag == 'train' else DataLoader(...)``, and said."""
    sharded = work.edits.expr[id(call.node)]
    work.edits.expr[id(call.node)] = lambda node: cst.IfExp(test=condition(param, value), body=sharded(node),
                                                            orelse=node)
    work.note(f"DataLoader -> ddpkit.data_loader if {param} == {value!r}", f"{where} trains on the {value!r} split "
              "and evaluates the others: those stay whole DataLoaders (each rank evaluates every batch, which is "
              "right)", call.line)


def own(work: _Work, call: Call) -> tuple[str, str, list[Loop]] | None:
    """(the parameter, the training string, the training loops) for a DataLoader that a function of this file
    returns, called here once per split by a string (``_, train_loader = data_provider(args, 'train')``, ``...
    'val')``): the calls whose loops train pass one string, the others other strings at the same place."""
    scope = call.scope
    index = _position(work, call)
    if index is None or not scope.params:
        return None
    kinds: dict[str, str] = {}
    loops: dict[str, list[Loop]] = {}
    for n, site in enumerate(c for c in work.facts.calls if (t := flow.callee(work.facts, c)) and t[0] is scope):
        bound = [b for b in work.facts.bindings if b.index == index and
                 (b.whole is site.node if index >= 0 else b.value is site.node)]
        read = [lp for b in bound for lp in flow.loops_reading(work.facts, b.target, b.scope, since=b)]
        name = f"{n}(){literals(site.node, lambda _: None)}"
        kinds[name] = TRAIN if any(flow.trains(work.facts, lp) for lp in read) else EVAL
        loops[name] = read
    decided = decide(list(kinds), kinds, [p for p in scope.params if p not in ("self", "cls")])
    if decided is None:
        return None
    return (*decided, [lp for name, read in loops.items() if kinds[name] == TRAIN for lp in read])


def _position(work: _Work, call: Call) -> int | None:
    """Where its function returns ``call``'s loader: its index in a returned tuple, -1 as the whole value; None
    when it does not return it."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    for where, value in work.facts.returns:
        elements = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        for i, element in enumerate(elements if where is call.scope else []):
            if element is call.node or binding is not None and dotted(element) == binding.target:
                return i if isinstance(value, cst.Tuple) else -1
    return None


def condition(param: str, value: str) -> cst.BaseExpression:
    """``flag == 'train'``."""
    return cst.parse_expression(f"{param} == {value!r}")
