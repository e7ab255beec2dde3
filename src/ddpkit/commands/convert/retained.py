"""A second backward through one forward of a prepared model: ``loss_d.backward(retain_graph=True)`` of a GAN
whose discriminator's loss reaches the generator (``disc(fake)``, the fake not detached), then ``loss_g.backward()``
through the same generator forward. DDP averages a model's gradients once per forward: the second backward's are
each rank's own, so the ranks' weights part (ddpkit's replica check stops it a step later, far from the cause).
Listed at the retaining backward, with the fix.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> left = plan("import torch\\nG = torch.nn.Linear(2, 2)\\nopt = torch.optim.Adam(G.parameters())\\n"
    ...             "for (x,) in DataLoader(ds, batch_size=8):\\n    y = G(x)\\n"
    ...             "    y.sum().backward(retain_graph=True)\\n    y.mean().backward()\\n    opt.step()\\n").left
    >>> [x.line for x in left if "retain_graph" in x.what]
    [6]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work): facts, models, leave


def retained_graph(work: _Work) -> None:
    """Each ``backward(retain_graph=True)`` of a training loop that a later backward follows through an output of
    a prepared model both losses read (not detached, not made again between), listed (a two-head model's two
    pairs in a step: both)."""
    if not work.models:
        return
    models = {b.target for b in work.models}
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        backwards = [c for c in loop.calls if c.last == "backward"]
        for call in backwards:
            retains = any(a.keyword is not None and a.keyword.value == "retain_graph" and
                          not (isinstance(a.value, cst.Name) and a.value.value in ("False", "None"))
                          for a in call.node.args)
            if retains and not any(x.line == call.line and "retain_graph" in x.what for x in work.left) and \
                    any(_shared(work, loop, call, c, models) for c in backwards if c.line > call.line):
                work.leave(call.line, "backward(retain_graph=True) keeps the graph for a later backward through "
                           "the same forward: a prepared model's gradients are averaged across ranks once per "
                           "forward, so the second backward's stay each rank's own and the ranks' weights part",
                           "add the losses and call backward once ((loss_a + loss_b).backward(): the same "
                           "gradients, averaged once), or keep the first loss off that model (fake.detach() in a "
                           "GAN's discriminator loss), and drop retain_graph")  # (each pair: extra five of set 28)


def _shared(work: _Work, loop: Any, first: Any, second: Any, models: set[str]) -> bool:
    """Both backwards go through one forward of a prepared model: the same loss, or losses that read one output
    of a model's call (``fake = G(z)``, read as ``D(fake)`` by both; ``D(fake.detach())`` in the first is not)."""
    losses = [c.node.func.value for c in (first, second) if isinstance(c.node.func, cst.Attribute)]
    if len(losses) < 2 or dotted(losses[0]) is not None and dotted(losses[0]) == dotted(losses[1]):
        return True  # (the same loss twice, or what they are made of cannot be told: listed)
    both = _reach(work, loop, losses[0], first.line) & _reach(work, loop, losses[1], second.line)
    return any(_forward(work, loop, name, models) for name in both)


def _reach(work: _Work, loop: Any, loss: cst.BaseExpression, line: int) -> set[str]:
    """The names a loss (a name, or ``bce(D(fake), y)`` written in place) is made of in the loop, three bindings
    deep, those read only detached left out."""
    seen = frontier = _reads(loss)
    for _ in range(3):
        values = [b.value if b.value is not None else b.whole for b in work.facts.bindings
                  if b.target in frontier and b.scope is loop.scope and loop.line <= b.line <= line]
        frontier = {n for v in values if v is not None for n in _reads(v)} - seen
        seen |= frontier
    return seen


def _reads(node: cst.CSTNode) -> set[str]:
    """The names ``node`` reads outside ``x.detach()``."""
    hidden = {id(n) for c in m.findall(node, m.Call(func=m.Attribute(attr=m.Name("detach"))))
              if isinstance(c, cst.Call) and isinstance(c.func, cst.Attribute)
              for n in m.findall(c.func.value, m.Name())}
    return {n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name) and id(n) not in hidden}


def _forward(work: _Work, loop: Any, name: str, models: set[str]) -> bool:
    """``name`` is bound in the loop from a call of a prepared model (``fake = G(z)``, ``out = model.decode(h)``)."""
    return any(b.target == name and b.scope is loop.scope and loop.line <= b.line <= loop.end and
               (value := b.value if b.value is not None else b.whole) is not None and
               any(isinstance(c, cst.Call) and ((dotted(c.func) or "").split(".")[0] in models or
                                                 any(dotted(a.value) in models for a in c.args))  # (``run(model, x)``)
                   for c in m.findall(value, m.Call()))
               for b in work.facts.bindings)
