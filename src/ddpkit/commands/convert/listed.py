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
import libcst.matchers as m

from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Binding, Call

_Work = Any  # the plan in the making (plan._Work)


def listed(work: _Work, target: str, call: Call) -> bool | Binding:
    """Wrap every model of the list that ``target`` (a loop's or comprehension's variable, read by the optimizer
    ``call``) takes its items from, where each is made: a list comprehension's element, each ``.append(...)``'s
    argument. A Binding instead where the list builds one model (``model = nn.Sequential(*blocks)``, an optimizer
    per block): that model is the one to wrap. True when done or refused here (an init of each model after it is
    made; models picked per batch); False, with nothing done, where the list is made otherwise."""
    source = _iterated_by(work.facts.module, target)
    binding = binding_of(work.facts, source, call.scope, call.line) if source else None
    if source is None or binding is None:
        return False
    holder = _holder(work, source, binding)
    if holder is not None:
        return holder
    if isinstance(binding.value, cst.ListComp):
        made = [binding.value.elt]
    elif isinstance(binding.value, cst.List) and not binding.value.elements:  # ``models = []`` then appends
        made = [c.node.args[0].value for c in work.facts.calls if c.last == "append" and c.node.args and c.line >
                binding.line and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == source]
    else:
        return False
    if not made or not all(isinstance(e, cst.Call) for e in made):
        return False
    if (why := _unsafe(work, source, binding.line, call.line)) is not None:
        work.leave(why[1], why[0], why[2], blocks=True)
        return True
    work.lists.add(source)
    for element in made:
        if resolve(dotted(element.func), work.facts.aliases) == "ddpkit.prepare_model":  # type: ignore[attr-defined]
            continue  # converted already
        work.edits.expr[id(element)] = lambda node: cst.parse_expression(
            f"ddpkit.prepare_model({work.facts.module.code_for_node(without_moves(node))})")
        work.note(f"each model of {source} -> ddpkit.prepare_model(...)", f"the optimizer at line {call.line} "
                  f"trains {target}, one model of {source}: prepare_model moves each to this rank's device, "
                  "converts BatchNorm and wraps it in DDP", binding.line)
    return True


def _holder(work: _Work, source: str, binding: Binding) -> Binding | None:
    """The model the list is built into (``model = nn.Sequential(*blocks, head)``): its blocks are parts of it."""
    for b in work.facts.bindings:  # (``ddpkit.prepare_model(nn.Sequential(*blocks))``: converted already)
        calls = m.findall(b.value, m.Call()) if b.line > binding.line and isinstance(b.value, cst.Call) else []
        for built in calls:
            if any(dotted(a.value) == source for a in built.args):  # type: ignore[attr-defined]
                called = resolve(dotted(built.func), work.facts.aliases) or ""  # type: ignore[attr-defined]
                return None if called.endswith(("ModuleList", "ModuleDict", "zip", "enumerate", "list")) else b
    return None


def _unsafe(work: _Work, source: str, made: int, optimizer: int) -> tuple[str, int, str] | None:
    """(what, line, fix) where wrapping each model where it is made would be wrong: an init of each after it is
    made (a loop over the list that applies one: the ranks would start different), or a model picked by a value
    of the batch (``models[k](x)``: the ranks would train different models in one step, and wait for ever)."""
    for loop in work.facts.loops:
        inits = [c for c in loop.calls if c.last in ("apply", "load_state_dict", "reset_parameters")]
        if made < loop.line < optimizer and source in loop.iter_names and inits:
            return (f"each model of {source} is initialised after it is made ({inits[0].last} at line "
                    f"{inits[0].line}): wrapped where it is made, the ranks would start different",
                    inits[0].line, f"wrap each after: {source} = [ddpkit.prepare_model(m) for m in {source}] "
                    "below that loop, then convert again")
    picked = _picked(work, source)
    if picked is not None:
        return (f"a model of {source} is picked by a value ({picked[0]}): if it comes from the batch, each rank "
                "would train another model in one step, and their DDP wraps would wait for ever", picked[1],
                "train every model of the list in every step (for m in models), or write the data-parallel "
                "part yourself (docs/guide.md)")
    return None


def _picked(work: _Work, source: str) -> tuple[str, int] | None:
    """(the code, its line) of a ``source[i]`` whose index is neither a number nor a counter of a ``for`` over
    ``range`` / ``enumerate`` / ``zip``."""
    counters: set[str] = set()
    subscripts: list[cst.Subscript] = []

    class Reads(cst.CSTVisitor):
        def visit_For(self, node: cst.For) -> None:
            counted(node.target, node.iter)

        def visit_CompFor(self, node: cst.CompFor) -> None:
            counted(node.target, node.iter)

        def visit_Subscript(self, node: cst.Subscript) -> None:
            if dotted(node.value) == source:
                subscripts.append(node)

    def counted(bound: cst.BaseExpression, iterable: cst.BaseExpression) -> None:
        if isinstance(iterable, cst.Call) and dotted(iterable.func) in ("range", "enumerate", "zip"):
            counters.update(n.value for n in m.findall(bound, m.Name()))  # type: ignore[attr-defined]

    work.facts.module.visit(Reads())
    lines = {id(node): line for _, _, line, node in work.facts.reads}
    for sub in subscripts:
        index = sub.slice[0].slice if len(sub.slice) == 1 else None
        value = index.value if isinstance(index, cst.Index) else None
        if isinstance(value, cst.UnaryOperation):
            value = value.expression
        if isinstance(value, cst.Integer) or isinstance(value, cst.Name) and value.value in counters:
            continue
        return work.facts.code(sub), lines.get(id(sub.value), 0)
    return None


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

