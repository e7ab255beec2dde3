"""Training losses over the batch as a whole: a contrastive loss whose negatives are the other samples of the batch
(SimCLR's NT-Xent), a loss over the whole batch at once (Dice, IoU). At N processes each rank's is over its share
only, another objective: listed once with the fix; lightly's gathering losses told to gather
(``gather_distributed=True``).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch, torch.nn.functional as F\\nmodel = Net()\\n"
    ...          "opt = torch.optim.SGD(model.parameters(), lr=1)\\n"
    ...          "def nt_xent(a, b):\\n    s = torch.cat([a, b]) @ torch.cat([a, b]).t()\\n"
    ...          "    return F.cross_entropy(s, torch.arange(len(s)))\\n"
    ...          "for x in ddpkit.data_loader(ds, global_batch_size=4):\\n"
    ...          "    nt_xent(model(x), model(x)).backward()\\n")
    >>> [x.what[:40] for x in p.left]
    ['nt_xent: a contrastive loss over the bat']
"""
from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, names_in

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, leave, models

# lightly's losses that take their negatives (or statistics) from the batch, and gather them across ranks when told
GATHERING = ("NTXentLoss", "DCLLoss", "DCLWLoss", "BarlowTwinsLoss", "VICRegLoss", "TiCoLoss")
# (not a Siamese network's ``ContrastiveLoss``: a margin loss over given pairs, no negatives from the batch)
CONTRASTIVE = ("ntxent", "nt_xent", "infonce", "info_nce", "supcon", "simclr", "barlow", "vicreg")


def contrastive_loss(work: _Work) -> None:
    """A loss whose negatives are the other samples of the batch (SimCLR's NT-Xent): at N processes each rank
    contrasts its share only, another objective. lightly's losses gather the batch across ranks when told
    (``gather_distributed=True``, added); another such loss is listed (lightly's SimCLR example ran on, silently),
    and so is a loss function of the script's own that contrasts the batch's samples (:func:`_in_batch`)."""
    own = _in_batch(work)
    if own is not None:
        work.leave(own[1], f"{own[0]}(): a contrastive loss over the batch's samples (joined on the batch axis, "
                   "compared with each other, a softmax over them): at N processes each rank's negatives are its "
                   "share of the batch only, another objective than one process's", "gather the embeddings across "
                   "ranks before comparing them (torch.distributed.nn.functional.all_gather keeps the gradient), or "
                   "keep it if that is acceptable")
    if not work.models:
        return
    for call in work.facts.calls:
        keywords = {a.keyword.value for a in call.node.args if a.keyword is not None}
        if (call.name or "").startswith("lightly.loss") and call.last in GATHERING:
            positional = any(a.keyword is None for a in call.node.args)  # (its place differs by class: named)
            if positional and "gather_distributed" not in keywords:
                work.leave(call.line, f"{call.last}: its negatives are this rank's share of the batch at N "
                           "processes", f"pass gather_distributed=True to {call.last}(...) (its arguments by name), "
                           "then convert again")
            elif "gather_distributed" not in keywords:
                work.edits.expr[id(call.node)] = lambda node: node.with_changes(args=[
                    *node.args, cst.Arg(keyword=cst.Name("gather_distributed"), value=cst.Name("True"),
                                        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                              whitespace_after=cst.SimpleWhitespace("")))])
                work.note(f"{call.last}(...) -> {call.last}(..., gather_distributed=True)", "its negatives are "
                          "the whole global batch, as one process's were, not this rank's share", call.line)
            continue
        word = call.last.lower()  # a loss by its name (SupConLoss, info_nce_loss), not SimCLRProjectionHead
        if any(w in word for w in CONTRASTIVE) and "loss" in word or word in ("ntxent", "nt_xent", "infonce"):
            work.leave(call.line, f"{call.last}: a contrastive loss over the batch: at N processes each rank's "
                       "negatives are its share of the batch only, another objective than one process's",
                       "gather the embeddings across ranks before the loss (ddpkit.gather keeps no gradient: use "
                       "torch.distributed.nn.functional.all_gather), or keep it if that is acceptable")
            return


# losses of the whole batch at once (an overlap ratio): not a mean of per-sample terms
WHOLE = ("dice", "iou", "jaccard", "tversky", "lovasz")
METRICS = ("metric", "score", "coef", "acc", "eval")  # a measure logged beside the loss, not what trains


def whole_batch_loss(work: _Work) -> None:
    """A training loss over the whole batch at once (``DiceLoss()``, ``dice_loss(pred, y)``, a Tversky or Lovasz
    loss): at N processes each rank's is over its share, and DDP averages the ranks' gradients, which is not the
    one-process loss of the global batch. Listed once (``ddpkit verify`` FAILs it; converting it said nothing)."""
    if not work.models:
        return
    facts = work.facts
    called = {dotted(c.node.func) for c in facts.calls if any(flow.trains(facts, loop) for loop in c.loops)}
    for c in facts.calls:
        word = c.last.lower()
        if not any(w in word for w in WHOLE) or any(w in word for w in METRICS):
            continue
        bound = [b.target for b in facts.bindings if b.value is c.node]
        if dotted(c.node.func) in called or any(name in called for name in bound):
            work.leave(c.line, f"{c.last}: a loss over the whole batch at once, not a mean over its samples: at N "
                       "processes each rank's is over its share of the batch, and DDP averages the ranks' "
                       "gradients, which is not the one-process loss of the global batch (ddpkit verify FAILs it)",
                       "keep it if that is acceptable (the usual DDP behaviour of such losses), or compute it on "
                       "every rank's predictions and targets gathered with ddpkit.gather(...)")
            return



_COMPARED = ("matmul", "mm", "bmm", "einsum", "cosine_similarity")
_SOFTMAX = ("log_softmax", "cross_entropy", "logsumexp", "softmax", "nll_loss")


def _in_batch(work: _Work) -> tuple[str, int] | None:
    """A loss function of this file (``loss`` in its name) that joins two views on the batch axis (``z =
    torch.cat([z1, z2], dim=0)``), compares that with itself (``z @ z.T``, ``torch.matmul(z, z.transpose(1, 2))``)
    and takes a softmax: an InfoNCE over the batch (ts2vec's ``instance_contrastive_loss``); its name and line."""
    lines = work.facts.module.code.splitlines()
    for scope in work.facts.scopes.values():
        name = scope.name.rsplit(".", 1)[-1]
        if "loss" not in name.lower() or not isinstance(scope.node, cst.FunctionDef):
            continue
        calls = [c for c in work.facts.calls if c.scope is scope]
        joined = {b.target for b in work.facts.bindings if b.scope is scope and isinstance(b.value, cst.Call) and
                  any(c.node is b.value and c.last in ("cat", "concat") and _on_batch_axis(c.node) for c in calls)}
        pairs = [(c.node.args[0].value, c.node.args[1].value) for c in calls if c.last in _COMPARED and
                 len(c.node.args) >= 2] + [(o.left, o.right) for o in m.findall(
                     scope.node, m.BinaryOperation(operator=m.MatrixMultiply())) if isinstance(o, cst.BinaryOperation)]
        itself = any(names_in(a) & joined and names_in(b) & joined for a, b in pairs)
        if itself and any(c.last in _SOFTMAX for c in calls):
            at = next((n for n, text in enumerate(lines, 1) if text.lstrip().startswith(f"def {name}(")), 1)
            return name, at
    return None


def _on_batch_axis(call: cst.Call) -> bool:
    """``torch.cat([a, b])``, ``torch.cat([a, b], dim=0)``, ``torch.cat([a, b], 0)``."""
    rest = call.args[1:]
    return all(isinstance(a.value, cst.Integer) and a.value.value == "0" and (a.keyword is None or
                                                                            a.keyword.value in ("dim", "axis"))
               for a in rest)
