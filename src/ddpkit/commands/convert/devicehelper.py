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

from ddpkit.commands.convert.devicetext import AVAILABLE, as_string, init_arguments, is_device, kind_of, text_of
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, device_functions


def device_functions(work: _Work) -> None:
    """Rewrite the returns of each function whose every return is a device literal and whose every ``if`` asks
    what is available; said once a function."""
    if work.devices:  # (``device = get_device()`` then ``if args.no_cuda: device = "cpu"``: the switch's init
        return          # must come first, review 33; the helper then stays, its "cuda" the rank's current GPU)
    for scope in work.facts.scopes.values():
        node = scope.node
        returns = [v for s, v in work.facts.returns if s is scope]
        if not isinstance(node, cst.FunctionDef) or not returns or not _picks(node):
            continue
        kinds = {kind_of(text_of(v) or "") for v in returns}
        # (``return torch.device('cuda' if torch.cuda.is_available() else 'cpu')``: the one-line set-up, returned)
        picked = all(is_device(v, "device", work.facts.aliases) and not init_arguments(v) for v in returns)
        if not picked and kinds != {"cpu", "accelerator"}:
            continue
        for value in returns:
            string = isinstance(value, cst.SimpleString) or as_string(value)
            work.edits.expr[id(value)] = lambda _n, s=string: cst.parse_expression(
                "ddpkit.init().device.type" if s else "ddpkit.init().device")
        work.device_functions.append(scope)
        line = min((line for _stmt, where, line in work.facts.statements if where is scope), default=1)
        work.note(f"{scope.name}() returns ddpkit.init().device", "it picked the accelerator when there is one, else "
                  "the CPU, as init() does: now one device per rank, the process group started", line)


def _picks(node: cst.FunctionDef) -> bool:
    """Only ``if``\\ s asking what is available (``torch.cuda.is_available()``, ``torch.backends.mps.is_available()``)
    and returns (a docstring beside them)."""
    for test in (i.test for i in m.findall(node.body, m.If()) if isinstance(i, cst.If)):
        asked = dotted(test.func) if isinstance(test, cst.Call) else dotted(test)  # (``torch.has_mps``: older torch)
        if not (asked or "").endswith((*AVAILABLE, "has_mps", "has_cuda")):
            return False
    lines = [s for s in m.findall(node.body, m.SimpleStatementLine()) if isinstance(s, cst.SimpleStatementLine)]
    return all(isinstance(small, cst.Return) or
               isinstance(small, cst.Expr) and isinstance(small.value, cst.SimpleString)
               for s in lines for small in s.body)

