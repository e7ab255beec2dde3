"""A model that follows a trained one without an optimizer: a BYOL or mean-teacher target network, built on its
own and moved towards the online network by a moving average (``for po, pt in zip(online.parameters(),
target.parameters()): pt.mul_(0.99).add_(po, alpha=0.01)``) or loaded from it (``target.load_state_dict(
online.state_dict())``). Left plain, each rank's target runs its BatchNorm over that rank's share of the batch
(in train mode), so the targets, and every step, differ from one process's. It is prepared frozen where it is
built: ``ddpkit.prepare_model(Net().requires_grad_(False))`` (no optimizer trains it: nothing changes for the
script) gives it BatchNorm over the global batch and rank 0's weights, without DDP (:mod:`ddpkit.strategies.frozen`).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> source = ("import torch\\nfrom torch import nn\\nonline = nn.BatchNorm1d(4)\\ntarget = nn.BatchNorm1d(4)\\n"
    ...           "opt = torch.optim.SGD(online.parameters(), lr=1)\\n"
    ...           "loader = torch.utils.data.DataLoader(ds, batch_size=4)\\nfor x in loader:\\n"
    ...           "    (online(x) - target(x)).pow(2).mean().backward()\\n"
    ...           "    for po, pt in zip(online.parameters(), target.parameters()):\\n"
    ...           "        pt.data.copy_(po.data)\\n")
    >>> [line for line in plan(source).text.splitlines() if line.startswith("target")][0]
    'target = ddpkit.prepare_model(nn.BatchNorm1d(4).requires_grad_(False))'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Call
from ddpkit.commands.convert.trained import trained

_Work = Any  # the plan in the making (plan._Work)
OWNS = ("parameters", "named_parameters", "state_dict", "buffers")


def partners(work: _Work) -> None:
    """Prepare frozen each model paired with a prepared one by ``zip(a.parameters(), b.parameters())`` or
    ``b.load_state_dict(a.state_dict())``, where no optimizer trains it."""
    prepared = {b.target for b in work.models}
    for call in work.facts.calls:
        for ahead, behind in _pairs(call):
            if ahead in prepared and behind not in prepared and behind:
                binding = work._model_binding(behind, call)
                if binding is not None and _frozen(work, binding, ahead):
                    prepared.add(behind)


def _pairs(call: Call) -> list[tuple[str, str]]:
    """``(a, b)`` and ``(b, a)`` of ``zip(a.parameters(), b.parameters())``; ``(a, b)`` of
    ``b.load_state_dict(a.state_dict())``."""
    if call.name == "zip" and len(call.node.args) == 2:
        a, b = (_owner(arg.value) for arg in call.node.args)
        return [(a, b), (b, a)] if a and b else []
    func = call.node.func
    if call.last == "load_state_dict" and isinstance(func, cst.Attribute) and call.node.args:
        a, b = _owner(call.node.args[0].value), dotted(func.value)
        return [(a, b)] if a and b else []
    return []


def _owner(node: cst.BaseExpression) -> str | None:
    """``m`` of ``m.parameters()``, ``m.state_dict()``, ``m.state_dict().values()``."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        if node.func.attr.value in OWNS:
            return dotted(node.func.value)
        node = node.func.value
    return None


def _frozen(work: _Work, binding: Any, partner: str) -> bool:
    """Wrap ``binding``'s build frozen: an unconditional build of its own (not a copy of the partner), run in a
    training loop (a copy made for an export after training is no target), whose parameters nothing else takes
    (an ``add_param_group``, a hand-written update)."""
    value = binding.value
    if not isinstance(value, cst.Call) or partner in names_in(value) or work._guard(binding.stmt) is not None \
            or id(value) in work.edits.expr or any(binding is b for b in work.models):
        return False
    facts, name = work.facts, binding.target
    def training(loop: Any) -> bool:
        return flow.trains(facts, loop)

    # run where the model trains: in a training loop, or in a function one calls (a loss helper)
    if not any(dotted(c.node.func) == name and (any(map(training, c.loops)) or
                                               flow.called_from_loop(facts, c.scope, training)) for c in facts.calls):
        return False
    if any(name in trained(c) for c in facts.calls):  # (an ``add_param_group``: trained after all)
        return False
    code = work.facts.module.code_for_node
    work.edits.expr[id(value)] = lambda node: cst.parse_expression(
        f"ddpkit.prepare_model({code(without_moves(node))}.requires_grad_(False))")
    work.models.append(binding)
    work.note(f"{binding.target} = ddpkit.prepare_model(....requires_grad_(False))", f"it follows {partner} "
              "without an optimizer (a moving-average target): prepared frozen, its BatchNorm runs over the global "
              "batch and its weights are rank 0's on every rank, without DDP (no gradient to average)", binding.line)
    return True
