"""A training loss summed over the batch, as a running total sees it: ``reduction='sum'`` (or the old
``size_average=False``), a criterion built so, ``((out - y) ** 2).sum()``, or a function of the file that returns one
(a VAE's ``BCE + KLD``): each rank's sums B/N samples, so its running total is 1/N of one process's and the ranks'
add up to it (:mod:`.sums`).

Example::

    >>> summing(cst.parse_expression("nn.MSELoss(reduction='sum')"))
    True
    >>> [elements_summed(cst.parse_expression(e)) for e in ("((o - y) ** 2).sum()", "torch.stack(ls).sum()")]
    [True, False]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Facts, Scope


def summed_value(facts: Facts, scope: Scope, value: Any, line: int) -> bool:
    """``value`` (``loss.item()``, ``loss`` bound above ``line``) is a loss summed over the batch
    (:func:`_summed_call`): mnist-vae's ``tr_loss += loss.item()`` of ``loss = loss_fn(out, x)``, ``loss_fn =
    nn.BCELoss(reduction="sum")``."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and not value.args and \
            value.func.attr.value in ("item", "detach", "cpu", "numpy", "float", "double"):
        value = value.func.value
    if isinstance(value, cst.Name):
        bound = binding_of(facts, value.value, scope, line)
        value = bound.value if bound is not None and bound.line < line else None
    return isinstance(value, cst.Call) and _summed_call(facts, scope, value, line)


def _returns_sum(facts: Facts, value: cst.Call) -> bool:
    """``value`` calls a function of the file every return of which is a summed loss (``def vae_loss(...): return
    ((y - x) ** 2).sum()``, or ``BCE + KLD`` of two summed terms bound in it: set 27's VAE tests, whose running
    total was averaged across ranks, half the original's)."""
    scope = facts.scopes.get(dotted(value.func) or "")
    if scope is None or scope.cls:
        return False
    returned = [v for s, v in facts.returns if s is scope]
    return bool(returned) and all(_summed_expr(facts, scope, v, 0) for v in returned)


def _summed_expr(facts: Facts, scope: Scope, node: cst.BaseExpression, depth: int) -> bool:
    """A summed call, a sum or difference of such, one scaled by a number (``-0.5 * torch.sum(...)``), or a name the
    function binds to one."""
    if depth > 4:
        return False
    if isinstance(node, cst.Call):
        return summing(node) or elements_summed(node, facts)
    if isinstance(node, cst.Name):
        bound = binding_of(facts, node.value, scope, 1 << 30)
        return bound is not None and bound.scope is scope and bound.value is not None and \
            _summed_expr(facts, scope, bound.value, depth + 1)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Subtract)):
        return _summed_expr(facts, scope, node.left, depth + 1) and _summed_expr(facts, scope, node.right, depth + 1)
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
        number = (cst.Integer, cst.Float, cst.UnaryOperation)
        return isinstance(node.left, number) and _summed_expr(facts, scope, node.right, depth + 1) or \
            isinstance(node.right, number) and _summed_expr(facts, scope, node.left, depth + 1)
    return False


def elements_summed(value: cst.Call, facts: Facts | None = None) -> bool:
    """``((model(x) - y) ** 2).sum()``, ``torch.sum(err ** 2)``: every element summed, the batch's too (set 27's
    VAE); not a sum of losses that are means already (``torch.stack([mse, l1]).sum()``: review 42), nor of a name
    (what it holds is unseen here)."""
    summed = value.func.value if isinstance(value.func, cst.Attribute) and value.func.attr.value == "sum" and \
        not value.args else value.args[0].value if dotted(value.func) == "torch.sum" and len(value.args) == 1 else None
    if summed is None or isinstance(summed, cst.Name):
        return False
    # (a loss with ``reduction='none'`` inside is elementwise: ``F.mse_loss(o, y, reduction='none').sum()``, or a
    # criterion so built, ``mse_loss = nn.MSELoss(reduction='none')``: review 43)
    inner = [c for c in m.findall(summed, m.Call()) if isinstance(c, cst.Call) and not _none(c) and
             not (facts is not None and isinstance(c.func, cst.Name) and _none_criterion(facts, c.func.value))]
    return not any((dotted(c.func) or "").rsplit(".", 1)[-1] in ("mean", "stack", "cat", "tensor") or
                   (dotted(c.func) or "").lower().endswith(("loss", "entropy")) for c in inner)


def _none(call: cst.Call) -> bool:
    return any(a.keyword is not None and a.keyword.value == "reduction" and isinstance(a.value, cst.SimpleString)
               and a.value.evaluated_value == "none" for a in call.args)


def _none_criterion(facts: Facts, name: str) -> bool:
    """``name`` is bound to a criterion built with ``reduction='none'``: its calls are elementwise."""
    return any(b.target == name and isinstance(b.value, cst.Call) and _none(b.value) for b in facts.bindings)


def summing(call: Any) -> bool:
    """``call`` is written with ``reduction='sum'`` (or the old ``size_average=False``): a loss summed over the batch,
    or a criterion that makes one."""
    return isinstance(call, cst.Call) and any(a.keyword is not None and (
        a.keyword.value == "reduction" and isinstance(a.value, cst.SimpleString) and
        a.value.evaluated_value == "sum" or a.keyword.value == "size_average" and
        isinstance(a.value, cst.Name) and a.value.value == "False") for a in call.args)


def _summed_call(facts: Facts, scope: Scope, value: cst.Call, line: int) -> bool:
    """``value`` is a loss summed over the batch (:func:`summing`), or a call of a criterion so built (mnist-vae's
    ``loss_fn = nn.BCELoss(reduction="sum")``)."""
    if summing(value):
        return True
    if elements_summed(value, facts) or _returns_sum(facts, value):
        return True
    name = dotted(value.func)
    bound = binding_of(facts, name, scope, line) if name else None
    return bound is not None and summing(bound.value)
