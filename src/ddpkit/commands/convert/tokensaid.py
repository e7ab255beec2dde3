"""What ``ddpkit convert`` says of a token-mean loss it cannot rewrite (:mod:`.tokens`): the loss listed with its
fix, ``batch_count=`` on the training loader for a mean over a step's tokens, the whole batch's count of each time
step's tokens for means added up over time steps (the chatbot tutorial's ``loss += criterion(out[:, t], y[:, t])``),
the sum of the batch's weights for a class-weighed mean.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(2, 3)\\n"
    ...          "o = torch.optim.SGD(m.parameters(), lr=0.1)\\nc = torch.nn.CrossEntropyLoss(ignore_index=0)\\n"
    ...          "for x, y in DataLoader(ds, batch_size=4):\\n    loss = 0\\n    for t in range(3):\\n"
    ...          "        loss += c(m(x[:, t]), y[:, t])\\n    o.zero_grad()\\n    loss.backward()\\n    o.step()\\n")
    >>> [x.line for x in p.left if "added up over the time steps" in x.what]
    [5]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Call, Loop

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any


def listed(work: _Work, call: Call, value: str = "-100") -> None:
    """``call`` (a token-mean criterion a training loop calls) listed, with the fix that fits: ``batch_count=`` for
    one mean a step, the per-step counts for means added up over time steps, a word where one criterion serves
    several losses of one step."""
    names = {b.target for b in work.facts.bindings if b.value is call.node}
    by_loop: dict[int, list[int]] = {}  # (one training loop's calls of it: two losses of one step)
    for c in work.facts.calls:
        if dotted(c.node.func) in names and c.loops and flow.trains(work.facts, c.loops[-1]):
            by_loop.setdefault(id(c.loops[-1]), []).append(c.line)
    uses = max(by_loop.values(), key=len, default=[])
    # (BERT-pytorch's one NLLLoss(ignore_index=0) for the masked tokens and the next-sentence labels)
    shared = f"; the same criterion serves {len(uses)} losses of one step (line" \
        f"{'s' if len(set(uses)) > 1 else ''} {', '.join(map(str, sorted(set(uses))))}), each a mean over its own " \
        "count: one batch_count weighs one of them, so give the others a criterion that ignores nothing (or weigh " \
        "each yourself)" if len(uses) > 1 else ""
    stepped = next((c for c in work.facts.calls if dotted(c.node.func) in names and c.loops and
                    _over_range(c.loops[-1]) and _added_up(c) and _in_training(work, c)), None)
    if stepped is not None:  # (the chatbot tutorial's ``loss += criterion(out[:, t], y[:, t])`` per time step)
        work.leave(call.line, f"{call.last}: a mean over the tokens it does not ignore, added up over the time steps "
                   f"of the loop at line {stepped.loops[-1].line}, each step's over its own tokens: at N processes "
                   "each rank's step means are over its own tokens, and no one count weighs a sum of per-step means "
                   "(ddpkit verify FAILs it)", "weigh each step by the whole batch's count of its tokens: once a "
                   f"batch counts = ddpkit.reduce((labels != {value}).sum(0)), then each step adds {call.last}(..., "
                   "reduction='sum') * state.world_size / counts[t] (DDP averages the ranks' gradients: the sum "
                   "over ranks is one process's step mean); or keep it if the difference is acceptable")
        return
    work.leave(call.line, f"{call.last}: a mean over the tokens it does not ignore (ignore_index, labels of -100, a "
               "boolean mask): "
               "at N processes each rank's mean is over its own tokens and DDP weighs the ranks alike, another "
               f"loss than one process's mean over the step's tokens (ddpkit verify FAILs it){shared}",
               "tell the training loader what the loss averages over: ddpkit.data_loader(..., batch_count=lambda "
               f"batch: (labels != {value}).sum()), labels as the batch holds them (docs/global-batch.md, "
               "token-weighted losses); or keep it if the difference is acceptable")


def _in_training(work: _Work, call: Call) -> bool:
    """The loop over positions around ``call`` runs in a training loop: nested in one, or in a function a training
    loop calls (ChatBotCHS's ``train_decode_step``, its ``for t in range(max_len)`` adding up each step's loss)."""
    if len(call.loops) > 1:
        return flow.trains(work.facts, call.loops[-2])
    return any(site.loops and flow.trains(work.facts, site.loops[-1]) for site in flow.callers(work.facts, call.scope))


def _added_up(call: Call) -> bool:
    """``loss += criterion(...)`` in a loop over positions with no backward of its own: the steps' means are added
    up into one loss (not truncated BPTT, each chunk stepping on its own)."""
    inner = call.loops[-1]
    adds = [a for a in m.findall(inner.node, m.AugAssign(operator=m.AddAssign()))
            if any(n is call.node for n in m.findall(a, m.Call()))]
    return bool(adds) and not any(c.last == "backward" for c in inner.calls)


def _over_range(loop: Loop) -> bool:
    """``for t in range(...)``: a loop over positions (time steps), not over data."""
    made = loop.node.iter if isinstance(loop.node, cst.For) else None
    return isinstance(made, cst.Call) and dotted(made.func) == "range"


def weighed(work: _Work, call: Call, weight: str) -> None:
    """piwise's ``NLLLoss2d(weight)`` (the background class weighed 0): a mean divided by the sum of the batch's
    weights, each rank's by its own part's."""
    work.leave(call.line, f"{call.last}(weight={weight}): a mean weighed by class, divided by the sum of the batch's "
               "weights: at N processes each rank divides by its own part's sum and DDP weighs the ranks alike, "
               "another loss than one process's (ddpkit verify FAILs it)", "tell the training loader what the loss "
               f"divides by: ddpkit.data_loader(..., batch_count=lambda batch: {weight}[batch[1]].sum()), the "
               "targets as the batch holds them (docs/global-batch.md); or keep it if the difference is acceptable")
