"""A lazy layer (``nn.LazyLinear``, ``nn.LazyConv2d``) sizes its weights at the model's first forward; prepare_model
needs them sized (DDP cannot wrap, nor the first step compare across ranks, parameters that do not exist yet) and
refuses such a model in one line. Said where the layer is built, with the two ways out; not rewritten: the sample
batch that would size it is the script's to pick.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> done = plan("import torch\\nfrom torch import nn\\nfrom torch.utils.data import DataLoader\\n"
    ...             "net = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))\\n"
    ...             "opt = torch.optim.SGD(net.parameters(), lr=0.1)\\n"
    ...             "for x, y in DataLoader(ds, batch_size=8):\\n    net(x).sum().backward()\\n    opt.step()\\n")
    >>> [(x.line, x.fix[:40]) for x in done.left if "Lazy" in x.what]
    [(4, 'run one forward on a sample batch before')]
"""

from __future__ import annotations

from typing import Any

from ddpkit.commands.convert.inits import sized_by
from ddpkit.commands.convert.names import dotted

_Work = Any  # the plan in the making (plan._Work): facts, models, leave


def lazy_layers(work: _Work) -> None:
    """Leave a line at the first lazy layer of ``torch.nn`` built in a file that prepares a model, unless a forward
    of a prepared model sizes it before the wrap (``model(sample)`` below the build: :func:`.inits.sized_by` moves
    the wrap below it). A file that only defines the model class says nothing: the script that builds it may size it."""
    # (not one whose class sizes itself: ``self(torch.zeros(1, 3, 32, 32))`` in its own __init__)
    sizing = {c.scope.cls for c in work.facts.calls if dotted(c.node.func) in ("self", "self.forward") and
              c.scope.cls is not None and c.scope.name == f"{c.scope.cls}.__init__"}
    call = next((c for c in work.facts.calls if c.name and c.name.startswith("torch.nn.Lazy") and
                 (c.scope.cls is None or c.scope.cls not in sizing)), None)
    models = {b.target for b in work.models}
    if call is None or not models or any(sized_by(work, c, dotted(c.node.func) or "") and not c.loops
                                         for c in work.facts.calls if dotted(c.node.func) in models):
        return
    layer = call.name.rsplit(".", 1)[-1]
    work.leave(call.line, f"nn.{layer} sizes its weights at the model's first forward, and prepare_model needs them "
               "sized (DDP cannot wrap weights that do not exist yet): it refuses the model as built",
               "run one forward on a sample batch before prepare_model (with torch.no_grad(): model(x)), or build "
               f"nn.{layer[4:]} with its input size")
