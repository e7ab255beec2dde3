"""Layers a model's class builds and no forward reaches (a leftover decoder ``self.spare = nn.Linear(4, 16)``, read
only by a method nothing calls): their parameters get no gradient, and DDP stops at the first backward unless
it is told to look for them. The wrap passes ``find_unused_parameters=True`` and says which layers.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("import torch.nn as nn\\nclass AE(nn.Module):\\n    def __init__(self):\\n"
    ...                    "        super().__init__()\\n        self.enc = nn.Linear(2, 2)\\n"
    ...                    "        self.old = nn.Linear(2, 2)\\n    def old_path(self, x):\\n"
    ...                    "        return self.old(x)\\n"
    ...                    "    def forward(self, x):\\n        return self.enc(x)\\n"))
    >>> unused(facts, cst.parse_expression("AE()"))
    ['self.old']
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Facts


def unused(facts: Facts, value: cst.BaseExpression | None) -> list[str]:
    """The ``self.X`` layers the class ``value`` builds (``AE()``, a class of this file) in ``__init__`` that no
    method reached from ``forward`` (through ``self.method(...)``) reads; [] when unknown."""
    cls = dotted(value.func) if isinstance(value, cst.Call) else None
    init, forward = facts.scopes.get(f"{cls}.__init__"), facts.scopes.get(f"{cls}.forward")
    if init is None or forward is None:
        return []
    layers = [b.target for b in facts.bindings if b.scope is init and b.target.startswith("self.") and
              b.target.count(".") == 1 and isinstance(b.value, cst.Call) and
              (dotted(b.value.func) or "").split(".")[-1][:1].isupper()]
    reached, todo = {forward.name}, [forward]
    while todo:  # (forward and the methods it calls on self, and theirs)
        scope = todo.pop()
        for c in facts.calls:
            name = f"{cls}.{c.last}"
            if c.scope is scope and dotted(c.node.func) == f"self.{c.last}" and name in facts.scopes and \
                    name not in reached:
                reached.add(name)
                todo.append(facts.scopes[name])
    read = {n for n, scope, _line, _node in facts.reads if scope.name in reached}
    # (``for layer in self.layers``, ``getattr(self, name)``, ``self.modules()``: reached in ways not followed)
    loose = any(c.scope.name in reached and c.last in ("getattr", "modules", "children", "named_children",
                                                        "named_modules") for c in facts.calls)
    if loose or any(m.findall(facts.scopes[n].node, m.Call(func=m.Name("getattr"))) for n in reached):
        return []
    return [layer for layer in dict.fromkeys(layers) if not any(r == layer or r.startswith(f"{layer}.") for r in read)]
