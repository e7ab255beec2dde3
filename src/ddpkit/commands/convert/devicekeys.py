"""A GPU chosen into a dict entry (``config["device"] = torch.device("cuda:0")``, a homework template's settings
dict): every rank would take that one GPU, while ``prepare_model`` puts rank r's model on its own. The device
set-up convert rewrites is a name or an attribute (``device = ...``, ``args.device = ...``: :mod:`.device`); an
entry is listed, with the line that takes this rank's device.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\ncfg = {}\\nif torch.cuda.is_available():\\n"
    ...          "    cfg['device'] = torch.device('cuda:0')\\nelse:\\n    cfg['device'] = torch.device('cpu')\\n")
    >>> [(x.line, x.fix) for x in p.left]
    [(4, "take this rank's device from ddpkit: cfg['device'] = ddpkit.init().device")]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

_Work = Any  # the plan in the making (plan._Work): facts, leave


def device_keys(work: _Work) -> None:
    """List each dict entry named for a device that a GPU is written into (see the module)."""
    lines = {id(stmt): line for stmt, _scope, line in work.facts.statements}
    for stmt in m.findall(work.facts.module, m.SimpleStatementLine()):
        assert isinstance(stmt, cst.SimpleStatementLine)
        for node in stmt.body:
            if not isinstance(node, cst.Assign) or len(node.targets) != 1:
                continue
            target = node.targets[0].target
            key = target.slice[0].slice if isinstance(target, cst.Subscript) and len(target.slice) == 1 else None
            value = work.facts.code(node.value)
            # (a GPU by its index, ``torch.device("cuda:0")``, ``f"cuda:{gpu}"``: an index-less "cuda" is the one
            # ddpkit sets per rank, and ``device_count()`` no device; review 44)
            indexed = m.matches(node.value, m.Call(func=m.Attribute(attr=m.Name("device")) | m.Name("device"))) and \
                any(s in value for s in ("cuda:", "'cuda', ", '"cuda", ')) or \
                isinstance(node.value, (cst.SimpleString, cst.FormattedString)) and "cuda:" in value
            if isinstance(key, cst.Index) and isinstance(key.value, cst.SimpleString) and \
                    "device" in str(key.value.evaluated_value).lower() and indexed and "ddpkit" not in value:
                entry = work.facts.code(target)
                work.leave(lines.get(id(stmt), 0), f"{entry} = {value[:50]}: every rank would take that GPU, while "
                           "prepare_model puts each rank's model on its own", f"take this rank's device from ddpkit: "
                           f"{entry} = ddpkit.init().device")
