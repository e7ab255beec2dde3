"""A training step that feeds the model its whole batch as one sample (an LSTM forecaster's ``model(torch.unsqueeze(
inputs, 0))``: the batch's rows are the time axis of one sequence). Sharded, each rank runs its own B/N rows as a
shorter sequence: a different training, which verify shows as a FAIL. Listed, with the ways out; not rewritten.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> done = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(4, 4)\\n"
    ...             "o = torch.optim.SGD(m.parameters(), lr=0.1)\\nfor x, y in DataLoader(ds, batch_size=8):\\n"
    ...             "    out = m(x.unsqueeze(0))\\n    out.sum().backward()\\n    o.step()\\n")
    >>> [x.line for x in done.left if "one sample" in x.what]
    [6]
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import batchnames, flow
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work): facts, models, leave
RNNS = ("LSTM", "GRU", "RNN")


def whole_batch(work: _Work) -> None:
    """Leave a line at the first call of a prepared model on its batch made one sample, in a training loop."""
    models = {b.target for b in work.models}
    if any((c.name or "").rsplit(".", 1)[-1] in RNNS and not any(
            a.keyword is not None and a.keyword.value == "batch_first" and dotted(a.value) == "True"
            for a in c.node.args) for c in work.facts.calls):
        return  # (a sequence-first RNN: ``x.unsqueeze(0)`` is a sequence of length 1 per sample, review 33)
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        batch = batchnames.batch_names(work.facts, loop)  # (``inputs = inputs.to(device)``: still the batch)
        for call in loop.calls:
            first = call.node.args[0].value if call.node.args else None
            if dotted(call.node.func) in models and first is not None and _one_sample(first, batch):
                work.leave(call.line, f"{dotted(call.node.func)} reads the whole batch as one sample ("
                           f"{work.facts.code(first)}: its rows are one sequence): sharded, each rank would run its "
                           "own B/N rows as a shorter sequence, a different training", "keep each sample a sequence "
                           "of its own (batch the sequences, not the rows), or run it as one process")
                return


def _one_sample(node: cst.BaseExpression, batch: set[str]) -> bool:
    """``torch.unsqueeze(x, 0)``, ``x.unsqueeze(0)`` (or ``dim=0``), ``x[None]`` of a batch name ``x``."""
    if isinstance(node, cst.Subscript) and dotted(node.value) in batch and len(node.slice) >= 1:
        index = node.slice[0].slice
        return isinstance(index, cst.Index) and isinstance(index.value, cst.Name) and index.value.value == "None"
    if not isinstance(node, cst.Call) or not node.args:
        return False
    func, args = node.func, [a.value for a in node.args]
    if dotted(func) == "torch.unsqueeze" and len(args) == 2:
        held, dim = args
    elif isinstance(func, cst.Attribute) and func.attr.value == "unsqueeze" and len(args) == 1:
        held, dim = func.value, args[0]
    else:
        return False
    return dotted(held) in batch and isinstance(dim, cst.Integer) and dim.value == "0"
