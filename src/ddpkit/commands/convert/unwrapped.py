"""A training loader sharded, a backward and a step taken, and no model prepared: the optimizer is made in a way
convert does not follow (a helper of the project, an object of its own), so nothing would average the gradients.
Listed with the backward's line (left to you), where the converted script would only stop at its first step.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nfrom torch.utils.data import DataLoader\\nfrom mine import make_opt\\n"
    ...         "loader = DataLoader(ds, batch_size=8, shuffle=True)\\nnet = torch.nn.Linear(2, 2)\\n"
    ...         "opt = make_opt(net)\\nfor x in loader:\\n    net(x).sum().backward()\\n    opt.step()\\n")
    >>> plan(text).left[0].what[:60]
    'the training loader is sharded (each rank its part of every '
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.crossing import HANDED, MODEL, key
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.origins import imported_from

_Work = Any  # the plan in the making (plan._Work)


def unwrapped(work: _Work) -> None:
    """List a file that trains on a loader it shards with no model prepared and none asked of another file."""
    calls = work.facts.calls
    backward = [c for c in calls if c.last == "backward"]
    if not work.trains or work.models or not backward or any(a.kind == MODEL for a in work.asks) or \
            any(left.blocks for left in work.left) or \
            any("prepare_model" in e.what for e in work.log) or \
            not any(c.last == "step" for c in calls) or \
            any(resolve(c.name, work.facts.aliases) == "ddpkit.prepare_model" for c in calls) or \
            _handed_optimizer(work) or _imported_optimizer(work):
        return
    work.leave(backward[0].line, "the training loader is sharded (each rank its part of every batch), but no model "
               "that an optimizer here trains was found to prepare: nothing would average the gradients", "wrap "
               "the model where it is built: model = ddpkit.prepare_model(model), then convert again (as it is, the "
               "converted script stops at its first step)")


def _handed_optimizer(work: _Work) -> bool:
    """Every step is of an optimizer its function is handed (Dive-into-DL's ``train_ch5(net, ..., optimizer)``), in
    a project whose callers handed in the loader converted: made, with its model prepared, by the caller."""
    steps = [c for c in work.facts.calls if c.last == "step" and isinstance(c.node.func, cst.Attribute)]
    elsewhere = work.crossing.elsewhere or frozenset()
    # (or a function another file of the project calls, handing it the optimizer it made: ZZy979's ``train_loop(model,
    # optimizer)`` building its own loader; a caller that prepared no model stops at the first step, loudly)
    return bool(steps) and all(dotted(c.node.func.value) in c.scope.params for c in steps) and \
        (bool(work.crossing.provided.get(key("", HANDED))) or
         all(c.scope.name and c.scope.name.rsplit(".", 1)[-1] in elsewhere for c in steps))


def _imported_optimizer(work: _Work) -> bool:
    """Every step is of an optimizer imported from a module of the project converted with this file (a DCGAN's
    ``from config import *`` that builds both models and their optimizers): its model is prepared there."""
    steps = [c for c in work.facts.calls if c.last == "step" and isinstance(c.node.func, cst.Attribute)]
    return bool(steps) and bool(work.crossing.own) and \
        all(imported_from(work.facts, dotted(c.node.func.value) or "") is not None for c in steps)
