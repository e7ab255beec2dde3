"""Experiment trackers a script starts itself: ``wandb.init(project=...)`` would open one Weights & Biases run per
rank, each logging its own rank's values. Rank 0's run is the run: the others start theirs with
``mode="disabled"``, which makes their ``wandb.log`` / ``wandb.watch`` / ``wandb.finish`` do nothing, so no other
line changes (set 28: two runs of one name, two loss series). What rank 0 logs is its own values, said.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch, wandb\\nfrom torch.utils.data import DataLoader\\nwandb.init(project='x')\\n"
    ...          "m = torch.nn.Linear(2, 2)\\nopt = torch.optim.SGD(m.parameters(), lr=1)\\n"
    ...          "for (x,) in DataLoader(ds, batch_size=8):\\n    m(x).sum().backward()\\n    opt.step()\\n")
    >>> [line for line in p.text.splitlines() if "wandb.init" in line]
    ["wandb.init(project='x', mode=None if ddpkit.init().is_main else 'disabled')"]
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.waits import main_test

_Work = Any  # the plan in the making (plan._Work): facts, edits, note

STARTS = ("wandb.init",)


def trackers(work: _Work) -> None:
    """Each tracker's run started on rank 0 only (see the module)."""
    for call in work.facts.calls:
        if call.name not in STARTS:
            continue
        given = next((a for a in call.node.args if a.keyword is not None and a.keyword.value == "mode"), None)
        if given is not None and "is_main" in work.facts.code(given.value):  # (a first conversion's: review 44)
            continue
        # (``state.is_main`` below the device set-up; above it, listed: an init there would lose its cpu=)
        test = main_test(work, call.scope, call.line)
        if any(a.star for a in call.node.args):  # (``wandb.init(**cfg)``: a mode may be in it)
            work.leave(call.line, "wandb.init(**...) starts a W&B run on every rank", "pass mode='disabled' on the "
                       "ranks other than 0: wandb.init(..., mode=None if ddpkit.init().is_main else 'disabled')")
            continue
        if given is not None:
            own = work.facts.code(given.value)
            work.edits.expr[id(given.value)] = lambda node, own=own, test=test: cst.parse_expression(
                f"({own}) if {test} else 'disabled'")
        else:
            work.edits.expr[id(call.node)] = lambda node, test=test: add_keyword(
                node, "mode", f"None if {test} else 'disabled'")
        work.note("wandb.init(...) -> a W&B run on rank 0 only (mode='disabled' on the others)", "every rank would "
                  "start a run of its own: one run, whose wandb.log shows rank 0's values (ddpkit.reduce(...) a "
                  "value first to log the whole batch's)", call.line)
