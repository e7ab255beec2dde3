"""What a project's training loop reads when it names no loader of its own: the batches another module's generator
yields (``for x in data.batches()``, ``data = Data(32)``: gandalf's), or one of a data object's loaders picked by a
conditional expression (``loader.train_loader if is_train else loader.test_loader``, the object handed in: the
generative-models repository's ``train_validate``). :mod:`.imported` asks each of that module as a loader.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from data import Loader\\ndef run(ld, t):\\n    dl = ld.tr if t else ld.te\\n"
    ...                    "    for x in dl:\\n        if t:\\n            x.backward()\\nrun(Loader(), True)\\n"))
    >>> picked(facts, "dl", facts.loops[0])
    [(('data', 'Loader().tr'), True), (('data', 'Loader().te'), False)]
"""

from __future__ import annotations

import libcst as cst

from ddpkit.commands.convert import bysplit, flagged, flow, handedin
from ddpkit.commands.convert.crossing import returned
from ddpkit.commands.convert.instances import instance_class
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Facts, Loop, Scope


def generated(facts: Facts, loop: Loop) -> tuple[str, tuple[str, str]] | None:
    """(the call as written, (the module, ``Data.batches()``)) of a ``for`` loop over what a generator of another
    module of the project yields, called with no loader of this file (gandalf's ``for x in data.batches()``, where
    ``data = Data(32)`` and ``batches`` yields its DataLoader's batches): asked as that function's value; None
    otherwise.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from data import Data\\nd = Data(8)\\nfor x in enumerate(d.batches()):\\n    pass\\n"))
    >>> generated(facts, facts.loops[0])
    ('d.batches()', ('data', 'Data.batches()'))
    """
    made = loop.node.iter if isinstance(loop.node, cst.For) else None
    while isinstance(made, cst.Call) and dotted(made.func) in WRAPPERS and made.args:
        made = made.args[0].value  # (``enumerate(...)``, ``tqdm(...)``)
    if not isinstance(made, cst.Call) or handedin.iterated(made):
        return None
    func = dotted(made.func)
    origin = imported_from(facts, func) if func else None
    if origin is None and isinstance(made.func, cst.Attribute):  # ``data.batches()`` of ``data = Data(32)``
        held = instance_class(facts, made.func.value, loop.scope, loop.line)
        origin = (held[0], f"{held[1]}.{made.func.attr.value}") if held is not None else None
    return (facts.code(made), (origin[0], returned(origin[1], -1))) if origin is not None else None


WRAPPERS = ("enumerate", "tqdm", "tqdm.tqdm", "iter")


def picked(facts: Facts, name: str, loop: Loop) -> list[tuple[tuple[str, str], bool]]:
    """Each branch of a loader picked by a conditional expression from the attributes of an imported class's
    instance (generative-models' ``data_loader = loader.train_loader if is_train else loader.test_loader``, the
    instance handed in as ``loader``), with whether the loop's step runs for it: every backward under ``if
    is_train:`` trains on the first branch only; else the loop's role holds for both. [] when not such a pick."""
    bound = flow.binding_of(facts, name, loop.scope, loop.line)
    if bound is None or not isinstance(bound.value, cst.IfExp):
        return []
    trains = flow.trains(facts, loop)
    steps = [c for c in loop.calls if c.last == "backward"]
    test = facts.code(bound.value.test)
    # (the step in the body of ``if is_train:`` or the ``else`` of ``if not is_train:`` trains on the first branch;
    # in the body of ``if not is_eval:`` or the ``else`` of ``if is_eval:``, on the second; the tests read per
    # branch, an ``else`` being where its test does not hold)
    sides = [{(t == test) == holds for t, holds in bysplit.branches(c) if t in (test, f"not {test}")} for c in steps]
    body = bool(steps) and all(side == {True} for side in sides)
    orelse = bool(steps) and all(side == {False} for side in sides)
    if trains and not body and not orelse:
        return []  # (which branch the step trains on cannot be told: not followed, as before)
    found = []
    for branch, taken in ((bound.value.body, bool(body)), (bound.value.orelse, bool(orelse))):
        head, _, attr = (dotted(branch) or "").partition(".")
        made = instance(facts, head, bound.scope, bound.line) if attr and "." not in attr else None
        if made is None:
            return []
        found.append(((made[0], f"{made[1]}().{attr}"), taken if trains else False))
    return found


def instance(facts: Facts, head: str, scope: Scope, line: int) -> tuple[str, str] | None:
    """(module, class) of the imported class's instance ``head`` names there: bound to it, or a parameter every
    caller of this file passes one of them as (``train_validate(model, opt, loader, True)``)."""
    held = flow.binding_of(facts, head, scope, line)
    if held is None or held.value is not None or head not in scope.params:
        return instance_class(facts, cst.Name(head), scope, line)
    made = set()
    for site in flow.callers(facts, scope):
        target = flow.callee(facts, site)
        passed = flagged.argument_for(site, head, scope, target[1]) if target else None
        made.add(instance_class(facts, passed, site.scope, site.line) if passed is not None else None)
    return made.pop() if len(made) == 1 else None
