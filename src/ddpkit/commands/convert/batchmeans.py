"""A training loss as a mean over the batch: the names a loop calls ``backward()`` on, whether each is one of
torch's criteria with its default reduction (a mean over the batch), and whether a running sum adds the loss's
own value (``train_loss += loss.item()``): a sum of batch means, which ranks average, not add.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("import torch.nn as nn\\nc = nn.MSELoss()\\nt = 0\\nfor x in ld:\\n    loss = c(x, x)\\n"
    ...                "    loss.backward()\\n    t += loss.item()\\n"))
    >>> stepped_losses(f.loops[0]), batch_mean(f, f.loops[0], "t")
    ({'loss'}, True)
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flow import argument_for, binding_of, callee
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.returns import at
from ddpkit.commands.convert.scan import Facts, Loop, Scope

# a mean of a list's values (``np`` unresolved: numpy's through a star import, NRI's ``from utils import *``)
MEANS = ("numpy.mean", "numpy.average", "statistics.mean", "statistics.fmean", "np.mean", "np.average")
_CODE = cst.Module(body=[])


def stepped_losses(loop: Loop) -> set[str]:
    """The names ``loop`` calls ``backward()`` on (``loss`` of ``loss.backward()``), nested loops included."""
    return {n for c in loop.calls if c.last == "backward" and isinstance(c.node.func, cst.Attribute)
            and (n := dotted(c.node.func.value)) is not None}


def batch_mean(facts: Facts, loop: Loop, name: str, counted: bool = False) -> bool:
    """``name`` is summed from the loss's own value in ``loop`` (``train_loss += loss.item()``, ``float(loss)``,
    ``loss.detach()``): a mean over each batch, of the name a backward is called on, not scaled by the batch."""
    losses = stepped_losses(loop)
    adds = [node for node in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
            if isinstance(node, cst.AugAssign) and _CODE.code_for_node(node.target) == name]
    inside = set(loop.targets) | {dotted(n.targets[0].target) for n in m.findall(loop.node, m.Assign())
                                  if isinstance(n, cst.Assign) and len(n.targets) == 1}
    for node in adds:
        value = node.value  # (``avg_cost += cost / total_batch``: over a count the loop does not change, a mean of
        # batch means; ``counted``: only over the data's count of steps, ``len(ds) // batch_size``, not a rank's own
        # ``len(loader)``: where the batch stays per process, the ranks' sums add up only over the data's count)
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide) and \
                not {n.value for n in m.findall(value.right, m.Name()) if isinstance(n, cst.Name)} & inside and \
                (not counted or step_count(facts, loop, value.right)):
            value = value.left
        if loss_name(value) not in losses:
            return False
    return bool(losses and adds) and all(mean_criterion(facts, loop, name) for name in losses if name)


def step_count(facts: Facts, loop: Loop, node: cst.BaseExpression) -> bool:
    """``node`` names a count of steps made from the data's size before the loop: ``total_batch = len(ds) //
    batch_size`` (or ``/``), not a loader's length."""
    name = dotted(node) if isinstance(node, cst.Name) else None
    made = [b.value for b in facts.bindings if name and b.target == name and b.line < loop.line and
            (b.scope is loop.scope or not b.scope.name)]
    value = made[-1] if made else None
    while isinstance(value, cst.Call) and dotted(value.func) in ("int", "math.ceil", "math.floor") and value.args:
        value = value.args[0].value  # (``int(len(ds) / batch_size)``)
    return isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.FloorDivide, cst.Divide)) and \
        isinstance(value.left, cst.Call) and dotted(value.left.func) == "len" and bool(value.left.args) and \
        not any(w in (dotted(value.left.args[0].value) or "").lower() for w in ("loader", "iter"))


def loss_name(value: Any) -> str | None:
    """The name a loss value is read from: ``loss`` of ``loss.item()``, ``float(loss)``, ``loss.detach().cpu()``.

    >>> loss_name(cst.parse_expression("float(loss.detach())")), loss_name(cst.parse_expression("f(loss)"))
    ('loss', None)
    """
    while isinstance(value, cst.Call) and (isinstance(value.func, cst.Attribute) and not value.args and
                                           value.func.attr.value in ("item", "detach", "cpu", "numpy") or
                                           dotted(value.func) == "float" and len(value.args) == 1):
        value = value.func.value if isinstance(value.func, cst.Attribute) else value.args[0].value
    if isinstance(value, cst.Attribute) and value.attr.value == "data":  # (``cost.data``: the tensor's value)
        return loss_name(value.value)
    return None if isinstance(value, cst.Call) else dotted(value)


def mean_criterion(facts: Facts, loop: Loop, loss: str, depth: int = 0) -> bool:
    """``loss`` is bound in ``loop`` to one of torch's losses with its default reduction, a mean over the batch:
    ``F.cross_entropy(...)``, or ``criterion(...)`` of ``criterion = nn.CrossEntropyLoss()``. Not with
    ``reduction='sum'`` (a VAE's), nor a loss of the script's own or of another module (its reduction unseen)."""
    stepped = max((c.line for c in loop.calls if c.last == "backward" and isinstance(c.node.func, cst.Attribute)
                   and dotted(c.node.func.value) == loss), default=loop.end)
    # (the loop's own: ``loss = total_loss / total`` below it is the epoch's value; the one the backward was called
    # on, not ``loss = loss.detach().cpu().numpy()`` after it, powerful-gnns')
    bound = [b for b in facts.bindings if b.target == loss and b.scope is loop.scope and b.line <= stepped and
             (b.value is not None or isinstance(b.whole, cst.Call) and b.index >= 0)]
    inside = [b for b in bound if b.line >= loop.line]
    chosen = (inside or bound)[-1] if bound else None
    if chosen is not None and chosen.value is None:  # ``loss, score = loss_and_score(net, x)``: the element
        return _unpacked_mean(facts, chosen)
    value = chosen.value if chosen is not None else None
    return _mean_terms(facts, value, named=lambda name: name != loss and depth < 3 and
                       mean_criterion(facts, loop, name, depth + 1))


def loss_number(value: Any) -> str | None:
    """``loss.item()``, ``float(loss)``, ``loss.detach().cpu().item()``: the name (:func:`loss_name`), else None; a
    number only, not ``loss.detach()`` (a tensor the script may ``torch.stack``: review)."""
    number = isinstance(value, cst.Call) and (
        isinstance(value.func, cst.Attribute) and value.func.attr.value == "item" or dotted(value.func) == "float")
    return loss_name(value) if number else None


def stepped_mean(facts: Facts, scope: Scope, mean: bool = True) -> bool:
    """Every value the script's function ``scope`` returns is the number of a loss it calls ``backward()`` on, a
    mean over the batch (a training step's ``loss.backward(); opt.step(); return loss.item()``, its caller
    appending each step's value to a list); without ``mean``, whatever that loss is."""
    values = [value for where, value in facts.returns if where is scope]
    for value in values:
        name = loss_number(value)
        stepped = [c.line for c in facts.calls if c.scope is scope and c.last == "backward" and
                   isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == name]
        bound = binding_of(facts, name, scope, min(stepped)) if name and stepped else None
        if bound is None or mean and not _mean_terms(facts, bound.value, 1):
            return False
    return bool(values)


def _unpacked_mean(facts: Facts, binding: Any) -> bool:
    """Element ``binding.index`` of what the script's own function returns is a mean over the batch in each of its
    returns (a GAN helper's ``return crit(out, ones), out.mean().item()``, unpacked ``g, score = gen_loss(...)``)."""
    call = binding.whole
    own = facts.scopes.get(call.func.value) if isinstance(call.func, cst.Name) else None
    returned = [r for s, r in facts.returns if s is own] if own is not None else []
    return bool(returned) and all(isinstance(r, cst.Tuple) and binding.index < len(r.elements) and
                                  _mean_terms(facts, r.elements[binding.index].value, 1) for r in returned)


def _mean_terms(facts: Facts, value: Any, depth: int = 0, named: Any = None) -> bool:
    """``value`` is a mean over the batch: a call of one of torch's losses with its default reduction, a
    ``.mean()`` / ``torch.mean(...)``, or a sum of such terms, each maybe weighted by a number or a name (a VAE's
    ``F.binary_cross_entropy(out, x) + beta * torch.mean(mu ** 2)``); ``named(name)``: whether a name the loop binds
    is one (a GAN's ``loss_D = loss_D_real + loss_D_fake``)."""
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Add, cst.Subtract)):
        return _mean_terms(facts, value.left, depth, named) and _mean_terms(facts, value.right, depth, named)
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
        terms = [side for side in (value.left, value.right)
                 if not isinstance(side, (cst.Integer, cst.Float, cst.Name, cst.Attribute))]  # (not the weight)
        return len(terms) == 1 and _mean_terms(facts, terms[0], depth, named)
    if isinstance(value, cst.UnaryOperation):  # (``-elbo.mean()``)
        return _mean_terms(facts, value.expression, depth, named)
    if isinstance(value, cst.Name) and named is not None and depth < 3:
        return bool(named(value.value))
    if not isinstance(value, cst.Call):
        return False
    if isinstance(value.func, cst.Attribute) and value.func.attr.value == "mean" and not value.args or \
            (resolve(dotted(value.func), facts.aliases) or "") == "torch.mean" and len(value.args) == 1:
        return True
    own = facts.scopes.get(value.func.value) if isinstance(value.func, cst.Name) and depth < 2 else None
    if own is not None:  # a loss function of the script's (``l2_loss(out, y)`` returning ``F.mse_loss(out, y)``)
        returned = [r for s, r in facts.returns if s is own]
        return bool(returned) and all(_mean_terms(facts, r, depth + 1) for r in returned)
    return mean_call(facts, value)


def mean_call(facts: Facts, value: cst.Call) -> bool:
    """``value`` calls one of torch's losses with its default reduction (``F.cross_entropy(...)``, ``criterion(...)``
    of ``criterion = nn.CrossEntropyLoss()``)."""
    def torch_loss(call: cst.Call) -> bool:  # (``nn`` of a star import, ``from models import *``: torch's)
        return (resolve(dotted(call.func), facts.aliases) or "").startswith(("torch.nn.", "nn."))

    made: list[cst.BaseExpression | None] = [value]
    if not torch_loss(value):  # ``criterion(...)``: what it is bound to
        # (not ``loss_fn = loss_fn.to(device)``, the tutorial's: the same criterion, moved)
        held: list[cst.BaseExpression | None] = [b.value for b in facts.bindings if b.target == dotted(value.func)
                                                 and isinstance(b.value, cst.Call) and dotted(_unmoved(b.value))
                                                 != b.target]
        if not held and isinstance(value.func, cst.Attribute):  # ``model.criterion(...)``: the class's own
            held = [kept] if (kept := _kept(facts, value.func)) is not None else []
        made = held[-1:] or _passed(facts, value)
    for one in made or [None]:
        one = _unmoved(one)  # ``nn.CrossEntropyLoss().to(self.device)``
        if isinstance(one, (cst.Name, cst.Attribute)) and one is not value and \
                (resolve(dotted(one), facts.aliases) or "").startswith("torch.nn.functional."):
            one = cst.Call(one)  # (``self.loss_function = F.cross_entropy``, handed on: called with its default)
        if not isinstance(one, cst.Call) or not torch_loss(one) or any(
                a.keyword is not None and a.keyword.value in ("reduction", "size_average", "reduce")
                for a in (*value.args, *one.args)):
            return False
    return True


def _passed(facts: Facts, value: cst.Call) -> list[cst.BaseExpression | None]:
    """What each call of the script's function that calls ``value`` hands in as its parameter ``value.func``
    (``train_model(model, loader, opt, nn.CrossEntropyLoss(), device)`` for ``criterion``), through a name bound to
    it; [] when none does, or the function is called where its callers are not all seen (none found)."""
    name = value.func.value if isinstance(value.func, cst.Name) else None
    scope = next((c.scope for c in facts.calls if c.node is value), None)
    found: list[cst.BaseExpression | None] = []
    for call in facts.calls if name and scope is not None and name in scope.params else ():
        target = callee(facts, call)
        if target is None or target[0] is not scope:
            continue
        given = argument_for(call, str(name), target[0], target[1])
        bound = binding_of(facts, dotted(given) or "", call.scope, call.line) if isinstance(given, cst.Name) else None
        kept = _kept(facts, given, call.scope.cls) if isinstance(given, cst.Attribute) else None
        given = kept if kept is not None else given
        found.append(bound.value if bound is not None else given)
    return found


def _class_of(facts: Facts, attribute: cst.Attribute) -> str | None:
    """The script's class the object ``attribute`` is read from was made of (``model`` of ``model = Net()`` or
    ``Net().to(device)``, bound above the read in its function), else None."""
    call = next((c for c in facts.calls if c.node.func is attribute), None)
    name = dotted(attribute.value)
    bound = binding_of(facts, name, call.scope, call.line) if call is not None and name else None
    made = _unmoved(bound.value) if bound is not None else None
    cls = dotted(made.func) if isinstance(made, cst.Call) else None
    return cls if cls and any(key.startswith(f"{cls}.") for key in facts.scopes) else None


def _unmoved(value: Any) -> Any:
    """``nn.CrossEntropyLoss().to(device).cuda()`` -> ``nn.CrossEntropyLoss()``."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and \
            value.func.attr.value in ("to", "cuda", "cpu"):
        value = value.func.value
    return value


def _kept(facts: Facts, attribute: cst.Attribute, cls: str | None = None) -> cst.BaseExpression | None:
    """What an object of the script's classes holds as ``attribute`` (``model.criterion``, ``self.loss_function``):
    the value the class binds to ``self.<name>`` (``nn.CrossEntropyLoss()``, lab 11-3's; ``F.cross_entropy``), else
    the one value its ``@property`` of that name returns (a Fashion-MNIST wrapper's ``loss_function``); None when
    no class, or several properties, hold it. ``cls``: the class of ``self.`` (else any one class of the script)."""
    name, own = attribute.attr.value, cls if dotted(attribute.value) == "self" else _class_of(facts, attribute)
    held = [b for b in facts.bindings if b.target == f"self.{name}" and b.scope.cls and
            (own is None or b.scope.cls == own) and isinstance(b.value, (cst.Call, cst.Name, cst.Attribute))]
    if len({b.scope.cls for b in held}) > 1:  # (two classes of the script hold one: which, unknown)
        return None
    if held:
        return held[-1].value  # (the last the class binds, as the loop would call it after __init__'s)
    made = [scope for key, scope in facts.scopes.items() if key.endswith(f".{name}") and key.count(".") == 1 and
            (own is None or scope.cls == own) and isinstance(scope.node, cst.FunctionDef) and
            any(dotted(d.decorator) == "property" for d in scope.node.decorators)]
    values = at(facts, made[0], -1) if len(made) == 1 else []
    return values[0] if len(values) == 1 else None


def summed_means(facts: Facts, loop: Loop, name: str) -> bool:
    """``name`` adds up a loss criterion's batch means in ``loop`` (LeNet-5's evaluation: ``avg_loss +=
    criterion(output, labels).sum()``, or ``loss = crit(...)`` then ``total += loss.item()``), not a sum over samples.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("import torch.nn as nn\\nc = nn.CrossEntropyLoss()\\nt = 0\\nfor x, y in ld:\\n"
    ...                "    t += c(x, y).sum()\\n"))
    >>> summed_means(f, f.loops[0], "t")
    True
    """
    adds = [node for node in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
            if isinstance(node, cst.AugAssign) and _CODE.code_for_node(node.target) == name]
    if not adds:
        return False
    for node in adds:
        value: Any = node.value
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and not value.args and \
                value.func.attr.value in ("sum", "item", "detach", "cpu", "mean"):
            value = value.func.value
        if isinstance(value, cst.Call) and dotted(value.func) == "float" and len(value.args) == 1:
            value = value.args[0].value
        named = dotted(value)
        if named is not None and "." not in named and mean_criterion(facts, loop, named):
            continue
        last = (dotted(value.func) or "").rsplit(".", 1)[-1].lower() if isinstance(value, cst.Call) else ""
        lossy = "loss" in last or "entropy" in last or last == "kl_div" or isinstance(value, cst.Call) and \
            any(b.target == dotted(value.func) and "loss" in _CODE.code_for_node(b.value).lower()
                for b in facts.bindings if b.value is not None)
        if not (isinstance(value, cst.Call) and lossy and mean_call(facts, value)):
            return False
    return True


def step_kind(facts: Facts, scope: Scope, value: Any, line: int, depth: int = 0) -> str | None:
    """What a value a loop adds up each step is: "mean" for a mean over the batch (``(...).float().mean()``,
    ``correct / y.shape[0]``, or a name bound to one, or a call of the script's own function returning one: a
    CIFAR project's ``acc = accuracy(out, y)``, its returns read at its end), "sum" for a sum or a size
    (``(...).sum()``, ``y.size(0)``); None when it cannot be told.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("def acc(o, y):\\n    return (o == y).sum() / y.shape[0]\\n"))
    >>> step_kind(f, f.scopes[""], cst.parse_expression("acc(o, y).item()"), 9)
    'mean'
    """
    while isinstance(value, cst.Call) and (isinstance(value.func, cst.Attribute) and not value.args and
                                           value.func.attr.value in ("item", "detach", "cpu", "numpy", "float",
                                                                     "double") or
                                           dotted(value.func) == "float" and len(value.args) == 1):
        value = value.func.value if isinstance(value.func, cst.Attribute) else value.args[0].value
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide):
        return "mean" if batch_size(value.right) else None
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):  # (``100. * acc``)
        kinds = {step_kind(facts, scope, side, line, depth) for side in (value.left, value.right)
                 if not isinstance(side, (cst.Integer, cst.Float))}
        return kinds.pop() if len(kinds) == 1 else None
    if not isinstance(value, (cst.Call, cst.Name)) or depth > 3:
        return None
    if isinstance(value, cst.Name):  # (``acc = accuracy(out, y)`` in the loop, above ``epoch_acc += acc.item()``)
        bound = binding_of(facts, value.value, scope, line)
        return step_kind(facts, bound.scope, bound.value, bound.line, depth + 1) \
            if bound is not None and bound.value is not None and bound.line < line else None
    last = value.func.attr.value if isinstance(value.func, cst.Attribute) else dotted(value.func)
    if last in ("mean",):
        return "mean"
    if last in ("sum", "size", "numel", "len"):
        return "sum"
    own = facts.scopes.get(dotted(value.func) or "") if isinstance(value.func, cst.Name) else None
    kinds = {step_kind(facts, own, r, 1 << 30, depth + 1) for s, r in facts.returns if s is own} \
        if own is not None else set()
    return kinds.pop() if len(kinds) == 1 else None


def batch_size(node: Any) -> bool:
    """``len(y)``, ``y.size(0)``, ``y.shape[0]``, ``y.numel()``: the size of a batch a helper is handed."""
    if isinstance(node, cst.Call) and dotted(node.func) == "len" and len(node.args) == 1:
        return dotted(node.args[0].value) is not None
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in ("size",
                                                                                                     "numel"):
        return True
    return isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute) and \
        node.value.attr.value == "shape"

