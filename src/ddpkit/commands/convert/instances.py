"""The class an instance is of, where the project's module that defines it is known: ``ld.get()`` of ``ld =
Loaders(32)``, ``from data import Loaders`` (a method a module's class holds, asked of that module)."""

from __future__ import annotations

import libcst as cst

from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Facts, Scope


def instance_class(facts: Facts, held: cst.BaseExpression, scope: Scope, line: int) -> tuple[str, str] | None:
    """(module, class) of the instance ``held`` names: ``Class(...)`` written there, or a name bound to it above
    ``line`` in ``scope`` (``model = Model(...)``), a class imported from a module of the project; else None.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("from data import Loaders\\nld = Loaders(32)\\nld.get()\\n"))
    >>> instance_class(f, cst.Name("ld"), f.scopes[""], 3), instance_class(f, cst.Name("x"), f.scopes[""], 3)
    (('data', 'Loaders'), None)
    """
    made: cst.BaseExpression | None = held
    if not isinstance(held, cst.Call):
        name = dotted(held)
        bound = binding_of(facts, name, scope, line) if name else None
        made = bound.value if bound is not None else None
    return imported_from(facts, dotted(made.func) or "") if isinstance(made, cst.Call) else None
