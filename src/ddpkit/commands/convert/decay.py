"""The weight decay of the optimizer that steps a summed loss: Adam's kin normalise a gradient by its own size, so
a sum's 1/N scale at N processes leaves their steps as they were, unless a decay is added to the gradient
(``Adam(..., weight_decay=1e-4)``, not AdamW's decoupled one), which then weighs N times more against the loss
(set 26's homework VAE: summed BCE, ``Adam(weight_decay=...)``; verify FAILed it, convert said nothing).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> src = ("import torch\\nfrom torch.utils.data import DataLoader\\nnet = torch.nn.Linear(2, 1)\\n"
    ...        "opt = torch.optim.Adam(net.parameters(), weight_decay=0.1)\\n"
    ...        "for x, y in DataLoader(ds, batch_size=8):\\n"
    ...        "    torch.nn.functional.mse_loss(net(x), y, reduction='sum').backward()\\n    opt.step()\\n")
    >>> [x.what[:60] for x in plan(src).left]
    ['the training loss is a sum over the batch, not a mean, stepp']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work)
# optimizers whose step is normalised by the gradient's own size: a sum's 1/N scale leaves it as it was (the
# pytorch/examples VAE sums its loss and trains with Adam)
SCALE_FREE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam"}


def coupled(work: _Work, call: Call) -> str | None:
    """The optimizer stepping the summed loss ``call`` makes, of Adam's kin and given a weight decay added to the
    gradient (``Adam(..., weight_decay=1e-4)``, not AdamW's decoupled one): its step follows the loss's gradient
    against the decay's, so a sum's 1/N scale moves it (set 26's homework VAE). Its name, or None. The optimizer
    is the file's only one, or one whose ``step()`` the loop of the loss calls (review 40: a classifier's decay
    beside a VAE's plain Adam)."""
    made = [c for c in work.facts.calls if c.last in OPTIMIZERS]
    if len(made) > 1:
        names = {b.target: b.value for b in work.facts.bindings if any(b.value is c.node for c in made)}
        criteria = {b.target for b in work.facts.bindings if b.value is call.node}
        loops = {id(lp) for c in work.facts.calls if c is call or dotted(c.node.func) in criteria for lp in c.loops}
        stepped = {dotted(c.node.func.value) for c in work.facts.calls if c.last == "step" and
                   isinstance(c.node.func, cst.Attribute) and any(id(lp) in loops for lp in c.loops)}
        made = [c for c in made if any(names.get(n) is c.node for n in stepped)]
        # (and of those, the one over the model the loss is made of: ``recon(vae(x), x)`` and ``Adam(vae...)``)
        fed = {n.split(".")[0] for c in work.facts.calls if c is call or dotted(c.node.func) in criteria
               for a in c.node.args for n in names_in(a.value)}
        made = [c for c in made if c.node.args and {n.split(".")[0] for n in names_in(c.node.args[0].value)} & fed
                ] or made
    for c in made:
        if c.last not in SCALE_FREE or c.last == "AdamW":
            continue
        given = {a.keyword.value: a.value for a in c.node.args if a.keyword is not None}
        decay, decoupled = given.get("weight_decay"), given.get("decoupled_weight_decay")
        if isinstance(decay, cst.Name):  # (``weight_decay=WEIGHT_DECAY`` of ``WEIGHT_DECAY = 0.0``: yolo_v1's, none;
            # the binding the call sees, not one of another scope: a parameter stays unknown, review 41)
            bound = binding_of(work.facts, decay.value, c.scope, c.line)
            decay = bound.value if bound is not None and isinstance(bound.value, (cst.Integer, cst.Float)) else decay
        if decay is not None and not (isinstance(decay, (cst.Integer, cst.Float)) and
                                      float(decay.evaluated_value) == 0.0) and \
                not (isinstance(decoupled, cst.Name) and decoupled.value == "True"):
            return c.last
    return None
