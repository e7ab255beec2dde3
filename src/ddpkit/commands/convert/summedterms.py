"""A term of the training loss summed over the batch beside a mean (a VAE's ``kld = -0.5 * torch.sum(1 + logvar -
mu ** 2 - logvar.exp())`` added to a mean reconstruction loss, or divided by a constant, ``KLD.sum() /
(batch_size * 784)``; a per-sample loss summed, ``per_sample.sum()``). At N processes each rank sums its own B/N
samples and DDP averages the ranks' gradients, so the term weighs 1/N of what it weighs in one process. Nothing
fails; the term is listed with the fix, scaling it by the number of processes in training. A sum over the model's
weights (an L2 penalty) reads no batch: not listed; one divided by the batch's own size (``x.size(0)``) is a mean.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(4, 4)\\n"
    ...          "opt = torch.optim.Adam(m.parameters())\\nfor x in DataLoader(ds, batch_size=8):\\n"
    ...          "    mu = m(x)\\n    kld = 0.5 * torch.sum(mu ** 2)\\n"
    ...          "    loss = torch.nn.functional.mse_loss(mu, x) + kld\\n    loss.backward()\\n    opt.step()\\n")
    >>> [x.line for x in p.left], p.left[0].fix[:55]
    ([7], 'scale it by the number of processes in training: kld = ')
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert import flow
from ddpkit.commands.convert.batchmeans import batch_size, stepped_losses
from ddpkit.commands.convert.counted import divided_by_count
from ddpkit.commands.convert.decay import SCALE_FREE
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Call, Scope
from ddpkit.commands.convert.summedloss import elements_summed, summing

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

WHY = ("a term of the training loss is summed over the batch ({code}): at N processes each rank sums its own B/N "
       "samples and DDP averages the ranks' gradients, so the term weighs 1/N of what it weighs in one process")


def summed_terms(work: _Work) -> None:
    """List each such term (see the module), once; not where the whole loss is listed as a sum already."""
    if any(x.what.startswith("the training loss is a sum over the batch") for x in work.left):
        return
    models = {b.target for b in work.models}
    said: set[int] = set()
    # (a whole loss summed, stepped by Adam's kin: its steps hold at any scale, losses.py's rule; a term beside a
    # mean is weighed against it whatever the optimizer)
    free = {c.last for c in work.facts.calls if c.last in OPTIMIZERS} <= SCALE_FREE
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        stepped = stepped_losses(loop)
        feeds = _feeding(work, loop.scope, stepped, (loop.line, loop.end))
        batchy = _batchy(work, loop.scope, set(loop.targets), models, (loop.line, loop.end))
        made = [b.value for b in work.facts.bindings if b.scope is loop.scope and b.target in stepped and
                b.value is not None and loop.line <= b.line <= loop.end]
        if not (free and _all_sums(work, loop.scope, made)):  # (``loss = bce_sum + kld``: a sum, under Adam)
            _terms(work, [c for c in loop.calls if c.scope is loop.scope], feeds, batchy, said,
                   stepped if free else set())
        for call in loop.calls:  # (a loss helper of the file: ``loss = loss_function(recon, x, mu)``)
            target = flow.callee(work.facts, call)
            bound = {b.target for b in work.facts.bindings if b.value is call.node}
            if target is None or target[0].cls or not bound & feeds:
                continue
            scope, skip = target
            handed = {p for p, a in zip(scope.params[skip:], call.node.args) if a.keyword is None and
                      names_in(a.value) & batchy}
            returned = {n for s, v in work.facts.returns if s is scope for n in names_in(v)}
            whole = (0, 1 << 30)
            alone = all(isinstance(v, cst.Name) for s, v in work.facts.returns if s is scope)  # (``return loss``)
            if free and _all_sums(work, scope, [v for s, v in work.facts.returns if s is scope]):
                continue  # (set 29: ``return BCE + KLD``, BCE of ``reduction='sum'``: the whole loss is a sum)
            _terms(work, [c for c in work.facts.calls if c.scope is scope], _feeding(work, scope, returned, whole),
                   _batchy(work, scope, handed, models, whole), said, returned if free and alone else set())


def _terms(work: _Work, calls: list[Call], feeds: set[str], batchy: set[str], said: set[int],
           whole: set[str]) -> None:
    """``whole``: the names of a loss that, summed and nothing else, is not listed (stepped by Adam's kin)."""
    for call in calls:
        summed = _total(call.node)
        if summed is None or id(call.node) in said or not (names_in(summed) & batchy) or \
                divided_by_count(work, call.line) or not _elementwise(work, call, summed):
            continue
        holders = [b for b in work.facts.bindings if b.scope is call.scope and b.value is not None and
                   any(n is call.node for n in m.findall(b.value, m.Call()))]
        if not any(b.target in feeds for b in holders) or any(_over_batch(work, b.target, call) for b in holders) or \
                any(_divides_by_batch(b.value) for b in holders) or any(_scaled(work, b.target, call) for b in holders):
            continue
        if any(b.target in whole and _only(b.value, call.node) for b in holders):  # the loss is the sum alone
            continue
        if any(_divisor(call, b.target) for b in holders):  # (``n_valid = valid.sum()``, then ``/ n_valid``: a count)
            continue
        said.add(id(call.node))
        name = holders[0].target
        work.leave(call.line, WHY.format(code=work.facts.code(call.node)[:60]), f"scale it by the number of processes "
                   f"in training: {name} = {name} * ddpkit.init().world_size (or average it over the batch, "
                   "x.size(0), and set its weight again)")


def _total(node: cst.Call) -> cst.BaseExpression | None:
    """What ``x.sum()`` / ``torch.sum(x)`` sums over every element (no ``dim``); None for any other call."""
    if isinstance(node.func, cst.Attribute) and node.func.attr.value == "sum" and not node.args:
        return node.func.value
    if dotted(node.func) == "torch.sum" and len(node.args) == 1 and node.args[0].keyword is None:
        return node.args[0].value
    return None


def _feeding(work: _Work, scope: Scope, names: set[str], lines: tuple[int, int]) -> set[str]:
    """``names`` and the names bound (between ``lines``, in ``scope``) that they are made from."""
    feeds = set(names)
    bound = [b for b in work.facts.bindings if b.scope is scope and b.value is not None and
             lines[0] <= b.line <= lines[1]]
    for _ in range(4):
        feeds |= {n for b in bound if b.target in feeds for n in names_in(b.value)}
    return feeds


def _batchy(work: _Work, scope: Scope, names: set[str], models: set[str], lines: tuple[int, int]) -> set[str]:
    """``names`` (the batch) and what is made of them, or of a model's output, between ``lines`` in ``scope``."""
    batchy = set(names)
    bound = [b for b in work.facts.bindings if b.scope is scope and lines[0] <= b.line <= lines[1]]
    for _ in range(4):
        batchy |= {b.target for b in bound if b.value is not None and (names_in(b.value) & batchy or any(
            isinstance(c, cst.Call) and dotted(c.func) in models for c in m.findall(b.value, m.Call())))}
        batchy |= {b.target for b in bound if b.value is None and isinstance(b.whole, cst.Call) and (
            names_in(b.whole) & batchy or dotted(b.whole.func) in models)}
        # (``recon, mu, log_var = out`` of a handed model output: the after-fix re-run's loss helper)
        batchy |= {b.target for b in bound if b.value is None and isinstance(b.whole, cst.Name) and
                   b.whole.value in batchy}
    return batchy


def _divides_by_batch(value: cst.BaseExpression) -> bool:
    """``torch.sum(...) / x.size(0)``: a mean over this rank's batch."""
    return any(isinstance(d, cst.BinaryOperation) and isinstance(d.operator, cst.Divide) and _sized(d.right, set())
               for d in m.findall(value, m.BinaryOperation()))


def _over_batch(work: _Work, name: str, call: Call) -> bool:
    """``kld /= x.size(0)``, ``kld = kld / x.size(0)``, ``loss = bce + kld / bs`` (``bs = len(x)``) in its function:
    a mean over this rank's batch then (review 44: the line's fix would have scaled a mean by N)."""
    sizes = {b.target for b in work.facts.bindings if b.scope is call.scope and b.value is not None and
             _sized(b.value, set())}
    if any(isinstance(a, cst.AugAssign) and isinstance(a.operator, cst.DivideAssign) and dotted(a.target) == name
           and _sized(a.value, sizes) for a in m.findall(call.scope.node, m.AugAssign())):
        return True
    return any(isinstance(d, cst.BinaryOperation) and isinstance(d.operator, cst.Divide) and
               name in names_in(d.left) and _sized(d.right, sizes) for d in m.findall(call.scope.node,
                                                                                        m.BinaryOperation()))


def _sized(node: cst.BaseExpression, sizes: set[str]) -> bool:
    """``x.size(0)``, ``len(x)``, ``x.shape[0]``, or a name bound to one (``bs``), in ``node``."""
    return batch_size(node) or dotted(node) in sizes or any(
        batch_size(n) for n in m.findall(node, m.Call() | m.Subscript())) or bool(names_in(node) & sizes)


def _only(value: cst.BaseExpression, summed: cst.Call) -> bool:
    """``value`` is the sum, scaled by numbers at most (``-0.5 * torch.sum(...)``)."""
    while isinstance(value, (cst.BinaryOperation, cst.UnaryOperation)):
        if isinstance(value, cst.UnaryOperation):
            value = value.expression
        elif isinstance(value.left, (cst.Integer, cst.Float)):
            value = value.right
        elif isinstance(value.right, (cst.Integer, cst.Float)):
            value = value.left
        else:
            return False
    return value is summed


def _scaled(work: _Work, name: str, call: Call) -> bool:
    """``kld = kld * ddpkit.init().world_size`` (the fix named, written in), or the loss scaled so in the backward."""
    return any("world_size" in work.facts.code(b.value) and name in names_in(b.value) for b in work.facts.bindings
               if b.scope is call.scope and b.value is not None) or any(
        c.last == "backward" and "world_size" in work.facts.code(c.node) for c in work.facts.calls
        if c.scope is call.scope)


def _elementwise(work: _Work, call: Call, summed: cst.BaseExpression) -> bool:
    """What is summed holds the batch's elements: not losses that are means already (``torch.stack([mse,
    l1]).sum()``: review 42); a name, by what its function binds it to."""
    if not isinstance(summed, cst.Name):
        return elements_summed(call.node, work.facts)
    bound = [b.value for b in work.facts.bindings if b.scope is call.scope and b.target == summed.value and
             b.value is not None and b.line <= call.line]
    return bool(bound) and all(not isinstance(v, cst.Call) or elements_summed(
        cst.Call(func=cst.Attribute(value=v, attr=cst.Name("sum"))), work.facts) for v in bound)


def _divisor(call: Call, name: str) -> bool:
    """``name`` divides something in the function: a count, not a term."""
    return any(isinstance(d, cst.BinaryOperation) and isinstance(d.operator, cst.Divide) and name in names_in(d.right)
               for d in m.findall(call.scope.node, m.BinaryOperation()))



def _all_sums(work: _Work, scope: Scope, values: list[cst.BaseExpression]) -> bool:
    """Every term added up in ``values`` (the loss, or what a loss helper returns) is a sum over the batch: a
    ``torch.sum`` / ``.sum()`` of it, or a criterion told ``reduction='sum'`` (``size_average=False``), named or
    written in, scaled by numbers at most: the whole loss is a sum, which Adam's kin step alike at any scale."""
    terms: list[cst.BaseExpression] = []
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Add, cst.Subtract)):
            pending += [value.left, value.right]
        else:
            terms.append(value)
    for term in terms:
        if isinstance(term, cst.Name):
            bound = [b.value for b in work.facts.bindings if b.scope is scope and b.target == term.value]
            term = bound[-1] if len(bound) == 1 and bound[-1] is not None else term
        if _divides_by_batch(term):  # (``F.bce(..., reduction='sum') / x.size(0)``: a mean; review 45)
            return False
        calls = [c for c in m.findall(term, m.Call()) if isinstance(c, cst.Call)]
        if not any(_total(c) is not None or summing(c) or _summing_criterion(work, c) for c in calls):
            return False
    return bool(terms)


def _summing_criterion(work: _Work, call: cst.Call) -> bool:
    """``crit(recon, x)`` of a ``crit = nn.BCELoss(reduction='sum')`` (review 45: a criterion named, not written in)."""
    name = dotted(call.func)
    made = [b.value for b in work.facts.bindings if name and b.target == name]
    return len(made) == 1 and summing(made[0])
