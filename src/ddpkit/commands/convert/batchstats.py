"""A BatchNorm of the script's own: a function or method that, when training, takes the mean or the variance over
the batch's dimension (normalizing_flows' ``BatchNorm.forward``: ``if self.training: self.batch_mean = x.mean(0)``;
Dive-into-DL's ``batch_norm(is_training, X, ...)``: ``X.mean(dim=0)``). Sharded, each rank's statistics are over
its part of the global batch, not the whole batch one process saw; ``prepare_model`` synchronizes torch's own
``nn.BatchNorm*`` layers (SyncBatchNorm), not this. Listed (left to you), where verify would FAIL it.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nfrom torch.utils.data import DataLoader\\nclass BN(torch.nn.Module):\\n"
    ...         "    def forward(self, x):\\n        if self.training:\\n            return x - x.mean(0)\\n"
    ...         "        return x\\nm = torch.nn.Sequential(torch.nn.Linear(2, 2), BN())\\n"
    ...         "opt = torch.optim.SGD(m.parameters(), lr=1)\\n"
    ...         "for x in DataLoader(ds, batch_size=8, shuffle=True):\\n    m(x).sum().backward()\\n    opt.step()\\n")
    >>> [x.line for x in plan(text).left if "statistics over the batch" in x.what]
    [6]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work)

STATISTICS = ("mean", "var", "std", "var_mean", "std_mean")
SPREAD = ("var", "std", "var_mean", "std_mean")  # the batch's spread: what a normalisation divides by


def own_batch_norm(work: _Work) -> None:
    """List the first function of the script (no ``__init__``: a dataset's standardization) that takes statistics
    over the batch's dimension under a test of training, when a training loader is sharded."""
    if not work.trains:
        return
    for scope in work.facts.scopes.values():
        if not scope.name or scope.name.endswith("__init__"):
            continue
        over = [c for c in work.facts.calls if c.scope is scope and c.last in STATISTICS and
                isinstance(c.node.func, cst.Attribute) and _over_batch(c.node)]
        # those that centre their tensor (``x - m``): not a mean pool beside dropout's ``training=self.training``
        # (review 40), not statistics pooling over time, ``torch.cat([h.mean(0), h.std(0)], 1)``, nor a parameter's
        # own spread (review 45)
        centred = [c for c in over if _centred(scope, _of_tensor(c.node))]
        # taken under ``if self.training:``, or before the flag picks (Dive-into-DL's homework ``batch_norm(X, ...,
        # is_training)``); or a forward that always normalises by the batch's variance (a homework's ``MyBN``: set 29)
        stat = next((c for c in over if any("training" in t for t in c.tests)), centred[0] if centred else None) \
            if _training(scope) else None
        if stat is None and scope.name.endswith(".forward"):
            stat = next((c for c in centred if c.last in SPREAD), None)
        if stat is None:
            continue
        work.leave(stat.line, f"statistics over the batch ({work.facts.code(stat.node)}) in {scope.name}(), a "
                   "BatchNorm of the script's own: sharded, each rank's are over its part of the global batch, not "
                   "the whole batch one process saw (prepare_model synchronizes torch's nn.BatchNorm layers only)",
                   "use torch's nn.BatchNorm1d / 2d, or average the statistics across ranks yourself "
                   "(ddpkit.reduce(mean, op='mean') and the same of the mean of squares)")
        return


def _training(scope: Any) -> bool:
    """The function reads ``self.training`` or a parameter named for training (``is_training``)."""
    reads = any(isinstance(a, cst.Attribute) and a.attr.value == "training" and isinstance(a.value, cst.Name) and
                a.value.value == "self" for a in m.findall(scope.node, m.Attribute()))
    return reads or bool(TRAINING & set(scope.params))


TRAINING = {"training", "is_training", "is_train", "train_mode"}  # (not ``train_loader``: a training function's)


def _of_tensor(call: cst.Call) -> str | None:
    """What a statistic is taken of: ``x`` of ``x.var(...)`` and of ``torch.var(x, ...)``."""
    func = call.func
    if isinstance(func, cst.Attribute) and dotted(func.value) not in ("torch", "np", "numpy"):
        return dotted(func.value)
    return dotted(call.args[0].value) if call.args else None


def _centred(scope: Any, tensor: str | None) -> bool:
    """``tensor - ...`` somewhere in the function: the tensor normalised by its statistics."""
    return tensor is not None and not tensor.startswith("self.") and any(  # (a parameter's own rows: no batch)
        isinstance(op, cst.BinaryOperation) and dotted(op.left) == tensor
        for op in m.findall(scope.node, m.BinaryOperation(operator=m.Subtract())))


def _over_batch(call: cst.Call) -> bool:
    """``x.mean(0)``, ``x.var(dim=0)``, ``X.mean(dim=(0, 2, 3))``: the batch's dimension among those reduced."""
    positional = [a.value for a in call.args if a.keyword is None]
    dim = next((a.value for a in call.args if a.keyword is not None and a.keyword.value in ("dim", "axis")),
               positional[0] if positional else None)
    items = [e.value for e in dim.elements] if isinstance(dim, (cst.Tuple, cst.List)) else [dim]
    return any(isinstance(item, cst.Integer) and item.value == "0" for item in items)


def _torch_built(work: _Work, call: Call) -> bool:
    """``call`` runs a function of the script that builds a torch optimizer (a runner's ``build_optimizer(net)``
    returning ``torch.optim.SGD(net.parameters(), ...)``): one over the parameters, whatever its name says."""
    target = flow.callee(work.facts, call)
    if target is None:
        return False

    def torch_optimizer(value: Any) -> bool:  # (``torch.optim.SGD(...)``, or a name bound to one there)
        bound = flow.binding_of(work.facts, dotted(value) or "", target[0], 1 << 30) if dotted(value) else None
        made = bound.value if bound is not None else value
        name = resolve(dotted(made.func), work.facts.aliases) or "" if isinstance(made, cst.Call) else ""
        return name.startswith("torch.optim.") and "lr_scheduler" not in name
    returns = [value for scope, value in work.facts.returns if scope is target[0]]
    # (every value it returns: a helper that returns KFACOptimizer(model) for one setting is no torch optimizer)
    return bool(returns) and all(torch_optimizer(v) for v in returns)


PRECONDITIONING = ("kfac", "shampoo", "kron", "natural", "precondition")  # names of optimizers built on the model


def model_optimizer(work: _Work) -> None:
    """An optimizer of the project built on the model itself (KFAC-Pytorch's ``KFACOptimizer(net, ...)``), not on its
    parameters: such an optimizer hooks the layers and preconditions with statistics of this rank's own batches
    (K-FAC, Shampoo), which DDP does not all-reduce, so each replica's update differs (the replica check stops the
    run with it). Listed, when the model is prepared here."""
    models = {b.target for b in work.models}  # (prepared here: its loader may be another module's, KFAC's)
    if not models:
        return
    for call in work.facts.calls:
        name = (call.name or "").lower()
        first = call.node.args[0].value if call.node.args and call.node.args[0].keyword is None else None
        if first is None or dotted(first) not in models or name.startswith("torch.") or \
                not (name.endswith("optimizer") or any(w in name for w in PRECONDITIONING)) or _torch_built(work, call):
            continue
        built = f"{work.facts.code(call.node.func)}({dotted(first)}, ...)"
        work.leave(call.line, f"{built}: an optimizer built on the model itself, which may precondition with "
                   "statistics of this rank's own batches (K-FAC, Shampoo): "
                   "DDP all-reduces the gradients only, so each replica's update would differ",
                   "all-reduce its statistics in its step (ddpkit.reduce(..., op='mean') of each factor), or train "
                   "with an optimizer over model.parameters()")
        return
