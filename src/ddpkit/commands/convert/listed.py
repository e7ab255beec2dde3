"""Models kept in a list (an ensemble: ``models = [Net() for _ in range(k)]``, or ``models.append(Net())`` in a
loop), each trained through a loop's or a comprehension's variable (``opts = [SGD(m.parameters()) for m in
models]``): ``ddpkit convert`` wraps each model where it is made, since the variable has no line of its own to wrap.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch import nn\\nmodels = [nn.Linear(4, 1) for _ in range(3)]\\n"
    ...             "opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]\\n").text
    >>> text.splitlines()[3]
    'models = [ddpkit.prepare_model(nn.Linear(4, 1)) for _ in range(3)]'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Call, dotted, resolve

_Work = Any  # the plan in the making (plan._Work)


def listed(work: _Work, target: str, call: Call) -> bool:
    """Wrap every model of the list that ``target`` (a loop's or comprehension's variable, read by the optimizer
    ``call``) takes its items from, where each is made: a list comprehension's element, each ``.append(...)``'s
    argument. False, with nothing done, where the list or its elements are made otherwise."""
    source = _iterated_by(work.facts.module, target)
    binding = binding_of(work.facts, source, call.scope, call.line) if source else None
    if source is None or binding is None:
        return False
    made = [binding.value.elt] if isinstance(binding.value, cst.ListComp) else []
    made += [c.node.args[0].value for c in work.facts.calls if c.last == "append" and c.node.args
             and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == source]
    if not made or not all(isinstance(e, cst.Call) for e in made):
        return False
    for element in made:
        if resolve(dotted(element.func), work.facts.aliases) == "ddpkit.prepare_model":  # type: ignore[attr-defined]
            continue  # converted already
        work.edits.expr[id(element)] = lambda node: cst.parse_expression(
            f"ddpkit.prepare_model({work.facts.module.code_for_node(without_moves(node))})")
        work.note(f"each model of {source} -> ddpkit.prepare_model(...)", f"the optimizer at line {call.line} "
                  f"trains {target}, one model of {source}: prepare_model moves each to this rank's device, "
                  "converts BatchNorm and wraps it in DDP", binding.line)
    return True


def _iterated_by(module: cst.Module, target: str) -> str | None:
    """The list a ``for`` or a comprehension takes ``target`` from: ``for m in models``, ``for m, opt in
    zip(models, opts)``, ``for i, m in enumerate(models)``; None when no such loop is found or they disagree."""
    found: set[str] = set()

    class Loops(cst.CSTVisitor):
        def visit_For(self, node: cst.For) -> None:
            found.update(_source(node.target, node.iter, target))

        def visit_CompFor(self, node: cst.CompFor) -> None:
            found.update(_source(node.target, node.iter, target))

    module.visit(Loops())
    return found.pop() if len(found) == 1 else None


def _source(bound: cst.BaseExpression, iterable: cst.BaseExpression, target: str) -> list[str]:
    if isinstance(bound, cst.Name):
        name = dotted(iterable)
        return [name] if bound.value == target and name else []
    if not isinstance(bound, (cst.Tuple, cst.List)) or not isinstance(iterable, cst.Call):
        return []
    names = [e.value.value if isinstance(e.value, cst.Name) else None for e in bound.elements]
    if target not in names:
        return []
    at, func = names.index(target), dotted(iterable.func)
    args = [a.value for a in iterable.args if a.keyword is None and not a.star]
    if func == "zip" and at < len(args):
        return [n for n in [dotted(args[at])] if n]
    if func == "enumerate" and at == 1 and args:
        return [n for n in [dotted(args[0])] if n]
    return []

