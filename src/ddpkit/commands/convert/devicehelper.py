"""A function of the script that returns the device as literals, picked by what is available (WeatherProphet's
``def get_device(): if torch.cuda.is_available(): return "cuda"`` ... ``return "cpu"``): ddpkit.init() picks the same
way, one accelerator per rank, so each return becomes ddpkit's device (``.type`` where the function returned a
string, which the script may test as one). The model's ``.to(device)`` with what it returns is then ddpkit's device
(:func:`.models._returns_device`), and another module's call of it too (:func:`.device.returning`).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\ndef get_device():\\n    if torch.cuda.is_available():\\n        return 'cuda'\\n"
    ...             "    return 'cpu'\\n").text
    >>> [line.strip() for line in text.splitlines() if "return" in line]
    ['return ddpkit.init().device.type', 'return ddpkit.init().device.type']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.device import AVAILABLE, text_of
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, device_functions


def device_functions(work: _Work) -> None:
    """Rewrite the returns of each function whose every return is a device literal and whose every ``if`` asks
    what is available; said once a function."""
    for scope in work.facts.scopes.values():
        node = scope.node
        returns = [v for s, v in work.facts.returns if s is scope]
        if not isinstance(node, cst.FunctionDef) or not returns or not _picks(node):
            continue
        kinds = {_kind(v) for v in returns}
        if None in kinds or kinds != {"cpu", "accelerator"}:
            continue
        for value in returns:
            string = isinstance(value, cst.SimpleString)
            work.edits.expr[id(value)] = lambda _n, s=string: cst.parse_expression(
                "ddpkit.init().device.type" if s else "ddpkit.init().device")
        work.device_functions.append(scope)
        line = next((line for stmt, _scope, line in work.facts.statements if stmt is node), 1)
        work.note(f"{scope.name}() returns ddpkit.init().device", "it picked the accelerator when there is one, else "
                  "the CPU, as init() does: now one device per rank, the process group started", line)


def _kind(value: cst.BaseExpression) -> str | None:
    text = text_of(value) if isinstance(value, (cst.SimpleString, cst.Call)) else None
    if text is None:
        return None
    return "cpu" if text.startswith("cpu") else "accelerator" if text.startswith(("cuda", "mps", "xpu")) else None


def _picks(node: cst.FunctionDef) -> bool:
    """Only ``if``\\ s asking what is available (``torch.cuda.is_available()``, ``torch.backends.mps.is_available()``)
    and returns (a docstring beside them)."""
    for test in (i.test for i in m.findall(node.body, m.If()) if isinstance(i, cst.If)):
        if not (isinstance(test, cst.Call) and (dotted(test.func) or "").endswith(AVAILABLE)):
            return False
    lines = [s for s in m.findall(node.body, m.SimpleStatementLine()) if isinstance(s, cst.SimpleStatementLine)]
    return all(isinstance(small, cst.Return) or
               isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString)
               for s in lines for small in s.body)

