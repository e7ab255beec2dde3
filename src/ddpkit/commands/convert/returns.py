"""What a function of the script returns, as its caller binds it: ``loss = step(...)`` takes the whole value,
``d_loss, g_loss = step(...)`` one element each, and a name returned stands for every value its function binds to
it (``z = torch.randn(n, 100); z = z.to(device); return z``: the draw is what the caller gets).

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("def step(x):\\n    z = torch.randn(4)\\n    return z, x\\n"))
    >>> [dotted(v) for v in at(f, f.scopes["step"], 0)], [dotted(v) for v in at(f, f.scopes["step"], 2)]
    (['z'], [])
    >>> [cst.Module([]).code_for_node(v) for v in through(f, f.scopes["step"], at(f, f.scopes["step"], -1)[0])]
    ['z, x', 'torch.randn(4)']
"""

from __future__ import annotations

import libcst as cst

from ddpkit.commands.convert.names import dotted, unpacked
from ddpkit.commands.convert.scan import Facts, Scope


def at(facts: Facts, scope: Scope, index: int) -> list[cst.BaseExpression]:
    """Element ``index`` of each value ``scope`` returns (a binding's index: below 0, the whole value); none from a
    return with fewer elements."""
    found = []
    for where, value in facts.returns:
        elements = unpacked(value)
        if where is scope and index < len(elements):
            found.append(value if index < 0 else elements[index])
    return found


def through(facts: Facts, scope: Scope, value: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``value`` and, for each name it is or holds (``z`` of ``return z, c``), every value ``scope`` binds to it."""
    names = {dotted(e) for e in unpacked(value)} - {None}
    return [value] + [b.value for b in facts.bindings if b.scope is scope and b.target in names and b.value is not None]
