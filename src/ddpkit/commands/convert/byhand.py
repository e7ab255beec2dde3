"""A ``ddpkit.data_loader`` written by hand, the named fix of a loader line, in a script convert has not run on (no
model prepared, no sum reduced: the rest as it was): a training one's loops' sums and per-step lists are this
rank's, reduced or said as a converted loader's are; an evaluation one (``train=False``) whose loop keeps
per-sample rows is listed. A script written with ddpkit is left to its author.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch, ddpkit\\nerrs = []\\n"
    ...          "for x in ddpkit.data_loader(ds, batch_size=4, train=False):\\n    errs.append(x.sum().item())\\n")
    >>> [x.what[:47] for x in p.left]
    ['the evaluation over the ddpkit.data_loader(...,']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.flow import loops_reading
from ddpkit.commands.convert.reductions import reductions
from ddpkit.commands.convert.scan import Call, Loop

_Work = Any  # the plan in the making (plan._Work)


def trained(work: _Work, call: Call) -> None:
    """A training ``ddpkit.data_loader`` written by hand: its loops' sums reduced as a converted loader's are."""
    if any(c.name in ("ddpkit.prepare_model", "ddpkit.reduce") for c in work.facts.calls):
        return
    loops = _loops(work, call)
    if any(flow.trains(work.facts, loop) for loop in loops):
        reductions(work, loops, call, True)


def rows(work: _Work, call: Call) -> None:
    """An evaluation ``ddpkit.data_loader(..., train=False)`` written by hand whose loop keeps per-sample results
    (``errs.append(...)``, ``errs += [...]``): each rank holds its shard's rows only, and what is made of them after
    the loop is rank 0's part; listed (set 26's extra five: an autoencoder's anomaly count, 501 of 1001 images)."""
    if any(c.name in ("ddpkit.prepare_model", "ddpkit.gather") for c in work.facts.calls):
        return  # (a script written with ddpkit: its author's)
    kept = next(((n, line) for lp in _loops(work, call) if not flow.trains(work.facts, lp) for n, line in lp.stored),
                None)
    if kept is not None:
        work.leave(kept[1], f"the evaluation over the ddpkit.data_loader(..., train=False) at line {call.line} keeps "
                   f"per-sample results in {kept[0]}: each rank holds its shard's only, and what is made of them "
                   "after the loop is rank 0's part", "evaluate on a plain DataLoader(dataset, batch_size) (convert "
                   f"leaves it whole, every rank evaluating the whole set), or ddpkit.gather({kept[0]}) after the "
                   "loop")


def _loops(work: _Work, call: Call) -> list[Loop]:
    """The loops over the loader ``call`` makes: through its name, or written in the ``for`` itself."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    loops = loops_reading(work.facts, binding.target, binding.scope, since=binding) if binding is not None else []
    return loops + [lp for lp in work.facts.loops if isinstance(lp.node, cst.For)
                    and any(n is call.node for n in m.findall(lp.node.iter, m.Call()))]
