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

from ddpkit.commands.convert import flow

_Work = Any  # the plan in the making (plan._Work): facts, models, leave


def retained_graph(work: _Work) -> None:
    """The first ``backward(retain_graph=True)`` of a training loop that another backward follows, listed once."""
    if not work.models:
        return
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        backwards = [c for c in loop.calls if c.last == "backward"]
        for call in backwards:
            retains = any(a.keyword is not None and a.keyword.value == "retain_graph" and
                          not (isinstance(a.value, cst.Name) and a.value.value in ("False", "None"))
                          for a in call.node.args)
            if retains and any(c.line > call.line for c in backwards):
                work.leave(call.line, "backward(retain_graph=True) keeps the graph for a later backward through "
                           "the same forward: a prepared model's gradients are averaged across ranks once per "
                           "forward, so the second backward's stay each rank's own and the ranks' weights part",
                           "make the second loss from a new forward (run the model again), or keep the first loss "
                           "off that model (fake.detach() in a GAN's discriminator loss), and drop retain_graph")
                return
