"""A training loop's batch itself, by name: its targets and what the loop binds to them moved or cast (``x =
x.to(device)``, ``inputs = Variable(inputs).float()``): what the step feeds, shows or reshapes."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Facts, Loop

MOVES = ("to", "cuda", "cpu", "float", "double")  # a batch moved or cast is still the batch


def batch_names(facts: Facts, loop: Loop) -> set[str]:
    """The loop's batch itself: its targets, and the names bound in it to one of them moved or cast (``x =
    x.to(device)``, ``inputs = inputs.float().cuda()``), what the step feeds, shows or reshapes.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("for x, y in dl:\\n    x = x.float().to(d)\\n    z = x * 2\\n"))
    >>> sorted(batch_names(f, f.loops[0]))
    ['x', 'y']
    """
    inside = {id(n) for n in m.findall(loop.node, m.SimpleStatementLine())}
    found = set(loop.targets)
    for _ in range(2):
        for b in facts.bindings:
            value = b.value
            if id(b.stmt) in inside and value is None and dotted(b.whole) in found:
                found.add(b.target)  # (DCGAN's ``for i, data in enumerate(loader)``, then ``x, _ = data``)
            if id(b.stmt) not in inside or not isinstance(value, cst.Call):
                continue
            while isinstance(value, cst.Call) and (isinstance(value.func, cst.Attribute) and
                                                   value.func.attr.value in MOVES or _variable(value)):
                value = value.func.value if isinstance(value.func, cst.Attribute) else value.args[0].value
            if value is not b.value and dotted(value) in found:
                found.add(b.target)
    return found


def _variable(call: cst.Call) -> bool:
    """``Variable(x)``, the old autograd wrapper (``xin = Variable(x).to(device)``): the batch itself."""
    return (dotted(call.func) or "").split(".")[-1] == "Variable" and len(call.args) == 1
