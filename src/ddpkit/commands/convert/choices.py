"""A save chosen by a rank's own loss: ``if loss < best_loss: torch.save(...)`` in a training loop.

Each rank's loss is a mean over its part of the global batch, so the test passes on each rank by its own numbers;
the save, made rank 0's, keeps the weights rank 0's half-batch loss picked (Jack-Cherish's UNet lesson saves
``best_model.pth`` on every step whose loss beats the best so far), not those one process's loss over the batch
would pick. Listed with the fix: the mean over the ranks, computed on every rank before the test.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\ntorch.manual_seed(0)\\n"
    ...          "m = torch.nn.Linear(2, 1)\\no = torch.optim.SGD(m.parameters(), lr=0.1)\\nbest = 9.0\\n"
    ...          "for x, y in DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), "
    ...          "batch_size=4):\\n    loss = torch.nn.functional.mse_loss(m(x), y)\\n    if loss < best:\\n"
    ...          "        best = loss\\n        torch.save(m.state_dict(), 'best.pth')\\n    o.zero_grad()\\n"
    ...          "    loss.backward()\\n    o.step()\\n")
    >>> [(x.line, x.what[:27]) for x in p.left]
    [(9, 'the test compares this rank')]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.batchmeans import stepped_losses
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work)


def rank_chosen_saves(work: _Work) -> None:
    """List each ``if`` of a training loop whose test reads the loss a backward is called on and whose body saves."""
    facts = work.facts
    said: set[int] = set()
    for loop in facts.loops:
        if not flow.trains(facts, loop):
            continue
        losses = stepped_losses(loop)
        for node in m.findall(loop.node, m.If()):
            if id(node) in said or not isinstance(node, cst.If):
                continue
            tested = {id(n) for n in m.findall(node.test, m.Name() | m.Attribute())}
            line = next((ln for _, _, ln, n in facts.reads if id(n) in tested), 0)
            # (the step's value, bound in the loop that steps: not an epoch mean rebound below it, review)
            stepped = sorted(n for n in _own(node.test) & losses if _step_value(facts, loop, n, line))
            if not stepped:
                continue
            inside = {id(n) for n in m.findall(node.body, m.Call())}
            saves = [c for c in loop.calls if c.name == "torch.save" and id(c.node) in inside]
            if not saves:
                continue
            said.add(id(node))
            line = line or saves[0].line
            loss = stepped[0]
            work.leave(line, f"the test compares this rank's loss ({loss}, a mean over its part of the global batch) "
                       f"and decides the save at line {saves[0].line}: rank 0's half picks the weights saved",
                       f"compare the mean over the ranks: {loss}_all = ddpkit.reduce({loss}.item(), op='mean') on "
                       f"every rank before the test, then test and keep {loss}_all")


def _own(test: cst.BaseExpression) -> set[str]:
    """The names ``test`` reads outside a ``ddpkit.reduce(...)`` (a mean over the ranks is every rank's)."""
    reduced = {id(n) for c in m.findall(test, m.Call()) if isinstance(c, cst.Call) and
               dotted(c.func) == "ddpkit.reduce" for n in m.findall(c, m.Name() | m.Attribute())}
    return {dotted(n) or "" for n in m.findall(test, m.Name() | m.Attribute()) if id(n) not in reduced} - {""}


def _step_value(facts: Any, loop: Any, name: str, line: int) -> bool:
    """``name`` where the test reads it is bound in a loop that calls ``name.backward()`` (the step's loss)."""
    bound = flow.binding_of(facts, name, loop.scope, line) if line else None
    steppers = [c.loops[-1] for c in facts.calls if c.last == "backward" and c.loops and
                isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == name]
    return bound is not None and any(lp.line <= bound.line <= lp.end for lp in steppers)
