"""A model whose output a training step differentiates twice: a WGAN-GP's gradient penalty, ``torch.autograd
.grad(outputs=D(interp), inputs=interp, create_graph=True)`` then a backward through those gradients. SyncBatchNorm
(what ``prepare_model`` makes of BatchNorm) has no double backward: torch warns that the result may be silently
incorrect. So that model is prepared with ``sync_batchnorm=False``: its BatchNorm layers, if it has any, keep their
statistics over each rank's part of the batch (said).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\nD = Critic()\\n"
    ...             "opt = torch.optim.Adam(D.parameters())\\nfor x in DataLoader(ds, batch_size=8):\\n"
    ...             "    x.requires_grad_(True)\\n    out = D(x)\\n"
    ...             "    g, = torch.autograd.grad(out.sum(), x, create_graph=True)\\n"
    ...             "    (out.mean() + g.norm()).backward()\\n    opt.step()\\n").text
    >>> text.splitlines()[3]
    'D = ddpkit.prepare_model(Critic(), sync_batchnorm=False)'
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.apply import keyword_on_wraps
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.origins import imported_from

_Work = Any  # the plan in the making (plan._Work): facts, models, keep


def differentiated_twice(work: _Work) -> set[str]:
    """The prepared models whose output is differentiated with ``create_graph=True``: those a training loop's
    ``torch.autograd.grad`` reaches; every prepared model of the file where the grad is taken elsewhere (a helper
    handed the critic, a trainer class of another module of the project: ``crossing.twice``). Said once each."""
    models = {b.target for b in work.models}
    grads = double_grads(work.facts)
    found: dict[str, int] = {}
    for call in grads:
        loop = next((lp for lp in reversed(call.loops) if flow.trains(work.facts, lp)), None)
        outputs = next((a.value for a in call.node.args if a.keyword is None or a.keyword.value == "outputs"), None)
        reached = _models_under(work, loop, outputs, models) if loop is not None and outputs is not None else set()
        # (a helper of the file's, ``gradient_penalty(D, real, fake)``: the models its callers hand it)
        handed = _handed(work, lambda c, scope=call.scope: (flow.callee(work.facts, c) or (None,))[0] is scope,
                         models) if loop is None and call.scope.name else set()
        for model in reached or handed or models:  # (not told apart: every model of the file)
            found.setdefault(model, call.line)
    if not grads and work.crossing.twice:
        module = work.crossing.twice[:-3].replace("/", ".")
        handed = _handed(work, lambda c: (imported_from(work.facts, dotted(c.node.func) or "") or ("",))[0] == module,
                         models)  # (the critic handed to the penalty of another module: b/s01's ``calc_gp(D, ...)``)
        found = {model: next(b.line for b in work.models if b.target == model) for model in handed or models}
    for model, line in sorted(found.items()):
        where = "here" if grads else f"in {work.crossing.twice}"
        work.keep(line, f"{model} is prepared with sync_batchnorm=False: a model's output is differentiated twice "
                  f"{where} (create_graph=True), which SyncBatchNorm does not support", "its BatchNorm layers, if "
                  "any, keep statistics over each rank's part of the batch (B/N), not the global batch's")
    return set(found)


def double_grads(facts: Any) -> list[Any]:
    """The ``torch.autograd.grad(..., create_graph=True)`` calls (not ``create_graph=False``): a gradient that a
    backward goes through again (a gradient penalty)."""
    return [c for c in facts.calls if resolve(dotted(c.node.func), facts.aliases) == "torch.autograd.grad"
            and any(a.keyword is not None and a.keyword.value == "create_graph" and
                    not (isinstance(a.value, cst.Name) and a.value.value == "False") for a in c.node.args)]


def _handed(work: _Work, picks: Any, models: set[str]) -> set[str]:
    """The models the calls ``picks`` accepts pass as an argument (by name)."""
    return {n for c in work.facts.calls if picks(c) for a in c.node.args if (n := dotted(a.value)) in models}


def _models_under(work: _Work, loop: Any, node: cst.BaseExpression, models: set[str]) -> set[str]:
    """The models called in ``node``, or in what the names it reads are bound to in the loop (three deep)."""
    found: set[str] = set()
    frontier = [node]
    for _ in range(3):
        found |= {head for value in frontier for c in m.findall(value, m.Call()) if isinstance(c, cst.Call)
                  for head in [(dotted(c.func) or "").split(".")[0]] if head in models}
        names = {n for value in frontier for n in names_in(value)}
        frontier = [b.value for b in work.facts.bindings if b.target in names and b.scope is loop.scope and
                    loop.line <= b.line <= loop.end and b.value is not None]
    return found


def keep_batchnorm(text: str, models: set[str]) -> str:
    """``model = ddpkit.prepare_model(...)`` in the converted ``text`` gets ``sync_batchnorm=False``."""
    return keyword_on_wraps(text, "sync_batchnorm", dict.fromkeys(models, "False"))
