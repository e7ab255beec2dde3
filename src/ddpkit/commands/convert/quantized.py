"""Quantization with torch's tools on a model convert prepares. Quantization-aware training (``prepare_qat``)
observes each rank's 1/N of the batch (an activation's min / max) and DDP hands rank 0's buffers on at each step: the
fake-quantised scales follow rank 0's shard, not the whole batch's (``ddpkit verify`` FAILs on them): listed. A
Conv + BatchNorm fused after training (``fuse_modules``) meets ddpkit's SyncBatchNorm, which torch's fuser does not
know ("did not find fuser method", set 26's CIFAR recipe): listed, with the fix.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\n"
    ...          "net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))\\n"
    ...          "opt = torch.optim.SGD(net.parameters(), lr=0.1)\\n"
    ...          "for x, y in DataLoader(ds, batch_size=8):\\n    net(x).mean().backward()\\n    opt.step()\\n"
    ...          "torch.quantization.fuse_modules(net, [['conv', 'bn']], inplace=True)\\n")
    >>> [(x.line, x.what[:50]) for x in p.left]
    [(8, 'fuse_modules: prepare_model made the BatchNorm lay')]
"""

from __future__ import annotations

from typing import Any

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, names_in

_Work = Any  # the plan in the making (plan._Work): facts, models, leave
_TORCH = ("torch.quantization.", "torch.ao.quantization.")


def quantized(work: _Work) -> None:
    """Leave a line at a ``prepare_qat`` of a prepared model, and at a ``fuse_modules`` of one below its training."""
    models = {b.target for b in work.models}
    if not models:
        return
    for call in (c for c in work.facts.calls if (c.name or "").startswith(_TORCH) and c.node.args):
        model = _model(work, call, models)
        if call.last == "prepare_qat" and model.removesuffix(".module") in models:
            work.leave(call.line, f"quantization-aware training of {model}: its observers see this rank's 1/N of "
                       "the batch (an activation's min / max) and DDP hands rank 0's on at each step, so the "
                       "fake-quantised scales follow rank 0's shard, not the whole batch's", "train it as one "
                       "process for the same scales, or take scales from a part of each batch (verify will name "
                       "them as the difference)")
        elif call.last in ("fuse_modules", "fuse_modules_qat") and model.removesuffix(".module") in models and \
                _trained_before(work, call) and any("BatchNorm" in (c.name or "") for c in work.facts.calls):
            work.leave(call.line, "fuse_modules: prepare_model made the BatchNorm layers ddpkit's SyncBatchNorm, "
                       "which torch's fuser does not know (did not find fuser method)", "fuse a fresh copy: build "
                       "the model again, load ddpkit.unwrap(model).state_dict() into it (the keys are BatchNorm's) "
                       "and fuse that one")


def _model(work: _Work, call: Any, models: set[str]) -> str:
    """The prepared model ``call`` is handed, also through a name bound to it (``m = model.module if
    hasattr(model, 'module') else model``); else what it is handed, as written."""
    given = dotted(call.node.args[0].value) or ""
    bound = flow.binding_of(work.facts, given, call.scope, call.line) if given else None
    held = sorted(names_in(bound.value) & models) if bound is not None and bound.value is not None else []
    return held[0] if given not in models and held else given


def _trained_before(work: _Work, call: Any) -> bool:
    """A backward runs in the file above ``call``: the model was prepared, and trained, before it is fused."""
    return any(c.last == "backward" and c.line < call.line for c in work.facts.calls)
