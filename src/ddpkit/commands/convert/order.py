"""Whether a read of a file runs before a write that rank 0 alone makes, so that no barrier is owed between them:
``main()`` reads ``--resume`` once and then calls ``train()``, which saves every epoch; a trainer's ``__init__``
loads a checkpoint before its ``train()`` method saves one; a read of ``config.json`` is no read of ``eval.txt``.

Example::

    >>> suffix(cst.parse_expression('f"{out}/eval-{step}.txt"')), suffix(cst.parse_expression("args.config"))
    ('txt', None)
"""

from __future__ import annotations

import re
from typing import Any

import libcst as cst

from ddpkit.commands.convert.flow import binding_of, callee
from ddpkit.commands.convert.scan import Facts, Scope, dotted

__all__ = ["read_first", "suffix"]


def read_first(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` runs before ``write`` in every run, or reads another file (a different file name ending)."""
    if read.scope is not write.scope and read.scope.name and \
            (_runs_before(facts, read, write.scope) or _constructs(facts, read, write)):
        return True
    mine, theirs = _path_suffix(facts, read, 0), _path_suffix(facts, write, 1 if write.name == "torch.save" else 0)
    return mine is not None and theirs is not None and mine != theirs


def _runs_before(facts: Facts, read: Any, target: Scope) -> bool:
    """``read``, in no loop of a function called in no loop, is above every call of that function that leads
    to ``target`` (the writing function), and there is one such call."""
    scope = read.scope
    if read.loops or _called_in_loop(facts, scope):
        return False
    leading = [c.line for c in facts.calls if c.scope is scope and _reaches(facts, c, target)]
    return bool(leading) and min(leading) > read.line


def _constructs(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` in a class's ``__init__`` (built in no loop), ``write`` in another method of that class: an object
    is made before its methods run."""
    scope = read.scope
    return scope.name.endswith(".__init__") and bool(scope.cls) and write.scope.cls == scope.cls and \
        write.scope is not scope and not read.loops and not _called_in_loop(facts, scope)


def _called_in_loop(facts: Facts, scope: Scope) -> bool:
    return any(c.loops for c in facts.calls if (callee(facts, c) or (None,))[0] is scope)


def _reaches(facts: Facts, call: Any, target: Scope) -> bool:
    """The call runs ``target``, itself or through the script's functions it calls (four deep at most)."""
    found = callee(facts, call)
    seen, todo = set(), [found[0]] if found else []
    for _ in range(5):
        if any(s is target for s in todo):
            return True
        seen |= {id(s) for s in todo}
        todo = [f[0] for s in todo for c in facts.calls if c.scope is s
                if (f := callee(facts, c)) is not None and id(f[0]) not in seen]
    return False


def _path_suffix(facts: Facts, call: Any, place: int) -> str | None:
    """The file name ending of the path ``call`` takes at ``place`` (through one binding of a name)."""
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    path = positional[place] if place < len(positional) else None
    name = dotted(path) if path is not None else None
    if name is not None:
        bound = binding_of(facts, name, call.scope, call.line)
        path = bound.value if bound is not None and bound.value is not None else path
    return suffix(path) if path is not None else None


def suffix(path: cst.BaseExpression) -> str | None:
    """The ending (``json``) of the last literal piece of a path expression, when it names one."""
    pieces = [n.value for n in _literals(path)]
    found = re.search(r"\.([A-Za-z0-9]{1,8})['\"]*$", pieces[-1]) if pieces else None
    return found.group(1).lower() if found else None


def _literals(node: cst.CSTNode) -> list[Any]:
    found: list[Any] = []

    class Strings(cst.CSTVisitor):
        def visit_SimpleString(self, n: cst.SimpleString) -> None:
            found.append(n)

        def visit_FormattedStringText(self, n: cst.FormattedStringText) -> None:
            found.append(n)

    node.visit(Strings())
    return found
