"""Training losses whose value depends on how the batch is split: at N processes each rank's loss is over its
share and DDP averages the ranks' gradients, which equals one process's step only for a mean of per-sample terms.
A loss summed over the batch (with SGD's kin: its steps N times smaller): listed once with the fix; a loss's value
shown from this rank's share said so (contrastive and whole-batch losses: :mod:`.batchwide`).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nmodel = Net()\\nopt = torch.optim.SGD(model.parameters(), lr=1)\\n"
    ...          "for x in ddpkit.data_loader(ds, global_batch_size=4):\\n    model(x).sum().backward()\\n")
    >>> [x.what[:40] for x in p.left]
    ['the training loss is a sum over the batc']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert import batchnames, counted, decay, flow, returns, sizes
from ddpkit.commands.convert.batchmeans import batch_size, loss_name, stepped_losses
from ddpkit.commands.convert.crossing import HANDED, key
from ddpkit.commands.convert.flagged import argument_for
from ddpkit.commands.convert.flow import callee
from ddpkit.commands.convert.names import dotted, heads, names_in
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Call, Loop
from ddpkit.commands.convert.summedloss import elements_summed, summing
from ddpkit.commands.convert.tokens import over_tokens

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, leave, models


SUMMED = ("the training loss is a sum over the batch, not a mean: DDP averages the ranks' gradients, so each "
          "rank's sum over B/N samples makes every step 1/N of the original's")


def summed_loss(work: _Work) -> None:
    """A training loss summed over the batch (``loss.sum().backward()``, ``reduction='sum'`` or the old
    ``size_average=False`` in a training loop, a function it calls, or a criterion it calls), stepped by an
    optimizer whose step follows the gradient's scale (SGD; not Adam's kin): listed once, with the fix (converting
    it silently gave steps N times smaller; ``ddpkit verify`` names it). Stepped by Adam's kin, the steps hold,
    but a value of it shown each step is this rank's share of the sum: said (a VAE's printed loss, halved)."""
    stepping = {c.last for c in work.facts.calls if c.last in OPTIMIZERS}
    if not work.models:
        return
    call = _summed(work)
    if call is None:
        return
    decayed = decay.coupled(work, call)
    if stepping and stepping <= decay.SCALE_FREE and decayed is None:
        _summed_shown(work, call)
        return
    if _scaled(work):  # (the fix this line names, written in: ``loss.sum() * state.world_size``)
        return
    why = SUMMED if decayed is None else (
        f"the training loss is a sum over the batch, not a mean, stepped by {decayed} with weight_decay= (an L2 "
        "term added to the gradient): DDP averages the ranks' gradients, so each rank's sum over B/N samples is "
        "1/N of the original's while the decay is not, and Adam's step follows their ratio")
    # (scaled in the backward alone: a value the loop shows or sums across ranks stays the loss; set 26's cVAE
    # printed twice its loss with ``loss = loss * state.world_size``)
    fix = "average it (reduction='mean', loss.mean()), or keep the sum and multiply it by the number of processes " \
        "in the backward alone ((loss * state.world_size).backward())" if decayed is None else "keep the sum and " \
        "multiply it by the number of processes in the backward alone ((loss * state.world_size).backward(); a " \
        "mean would weigh the decay B " \
        "times more than the original did)"
    work.leave(call.line, why, fix)


def _scaled(work: _Work) -> bool:
    """A training loss multiplied by the number of processes (``loss.sum() * state.world_size``,
    ``(loss * ddpkit.init().world_size).backward()``) in a loop that steps: the sum made one process's again."""
    def scaled(node: cst.BaseExpression) -> bool:
        return isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply) and \
            any("world_size" in work.facts.code(side) for side in (node.left, node.right))

    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        losses = stepped_losses(loop)  # (the loss itself, not a count: ``seen += x.size(0) * state.world_size``)
        for node in m.findall(loop.node, m.BinaryOperation(operator=m.Multiply())):
            assert isinstance(node, cst.BinaryOperation)
            if scaled(node) and any(names_in(side) & losses for side in (node.left, node.right)):
                return True
        # (the fix written as ``(loss * state.world_size).backward()``, or ``loss = criterion(...) * world_size``
        # then ``loss.backward()``: the line stayed listed after its own fix; set 27's run-up)
        if any(c.last == "backward" and isinstance(c.node.func, cst.Attribute) and scaled(c.node.func.value)
               for c in loop.calls):
            return True
        if any(isinstance(b, cst.Assign) and dotted(b.targets[0].target) in losses and scaled(b.value)
               for b in m.findall(loop.node, m.Assign())):
            return True
    return False


def _summed(work: _Work) -> Call | None:
    """The first training loss summed over the batch (see :func:`summed_loss`)."""
    backwards = [c for c in work.facts.calls if c.last == "backward"]
    training = {id(c.loops[-1]) for c in backwards if c.loops}  # an evaluation's summed loss is no step's
    # and the functions a training loop calls (the VAE's loss_function(recon, x, mu, logvar))
    helpers = {id((callee(work.facts, c) or (None,))[0]) for c in work.facts.calls
               if any(id(loop) in training for loop in c.loops)} | _handed_criteria(work)
    for call in work.facts.calls:
        func = call.node.func
        summed_backward = call.last == "backward" and isinstance(func, cst.Attribute) and \
            isinstance(func.value, cst.Call) and isinstance(func.value.func, cst.Attribute) and \
            func.value.func.attr.value == "sum"
        summed_reduction = summing(call.node) or _summed_class(work, call) or _stepped_sum(work, call)
        # (a criterion built before the loop, ``nn.MSELoss(size_average=False)``, called in it: vdsr)
        bound = {b.target for b in work.facts.bindings if b.value is call.node}
        # (``self.criterion = nn.CrossEntropyLoss(reduction="sum")`` in the model's class, called ``model.criterion``)
        held = {name[5:] for name in bound if name.startswith("self.")}
        bound |= {f"{dotted(c.node.func.value)}.{c.last}" for c in work.facts.calls if held and c.last in held and
                  isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value)}
        # (its innermost loop trains: an evaluation loop inside the epoch loop, under no_grad, does not)
        trains = not call.no_grad and (call.loops and id(call.loops[-1]) in training or id(call.scope) in helpers
                                       or any(dotted(c.node.func) in bound and not c.no_grad and (
                                           c.loops and id(c.loops[-1]) in training or id(c.scope) in helpers)
                                              and _calls_it(work, c, call) for c in work.facts.calls))
        # (in a step helper: an LSTM's apply())
        if summed_reduction and over_tokens(work, call):  # (divided by the kept tokens: tokens.py lists it)
            continue
        if (summed_backward or summed_reduction) and counted.divided_by_count(work, call.line):  # (counted.py's)
            continue
        if call.stmt is not None and "/ ddpkit.reduce(" in work.facts.code(call.stmt):  # (counted.py's fix, applied)
            continue
        if summed_backward or summed_reduction and trains:
            return call
    return None


def _calls_it(work: _Work, use: Call, made: Call) -> bool:
    """``use`` calls the criterion ``made`` builds, by the binding its name has there: not another function's
    criterion of the same name (set 28: ``criterion = nn.CrossEntropyLoss(reduction='sum')`` local to an
    evaluation function, beside the training loop's mean ``criterion``)."""
    name = dotted(use.node.func) or ""
    if name.startswith("self."):  # (a class's criterion called through an instance: followed by its name only)
        return True
    found = flow.binding_of(work.facts, name, use.scope, use.line)
    return found is None or found.value is None or found.value is made.node


def _summed_names(work: _Work, call: Call | None) -> set[str]:
    """The names that hold the summed loss ``call`` makes: bound to it, to a call of a criterion bound to it, or to
    a value reading one of those (``loss = recon + kld``); not another loss of the file (review 42: a mean ``aux``
    beside a summed loss was said a sum)."""
    if call is None:
        return set()
    found = {b.target for b in work.facts.bindings if b.value is not None and
             any(n is call.node for n in m.findall(b.value, m.Call()))}
    helper = call.scope.name if call.scope.name and not call.scope.cls else ""  # (``loss_function``'s sum: review 43)
    found |= {b.target for b in work.facts.bindings if helper and isinstance(b.value, cst.Call) and
              dotted(b.value.func) == helper}
    for _ in range(3):
        found |= {b.target for b in work.facts.bindings if b.value is not None and b.target not in found and
                  (names_in(b.value) & found or any(isinstance(c, cst.Call) and dotted(c.func) in found
                                                    for c in m.findall(b.value, m.Call())))}
    return found


def _stepped_sum(work: _Work, call: Call) -> bool:
    """``loss = ((out - y) ** 2).sum()`` bound and stepped on in a training loop: every element summed, the
    batch's too (review 42: its running total was summed across ranks, the line under SGD missing)."""
    if not call.loops or not elements_summed(call.node, work.facts):
        return False
    loop = call.loops[-1]
    stepped = stepped_losses(loop)
    backward = max((c.line for c in loop.calls if c.last == "backward"), default=loop.end)
    for b in (b for b in work.facts.bindings if b.value is call.node and b.target in stepped):
        # (divided after, ``loss = loss / valid.sum()`` or ``loss /= n``: a mean then, counted.py's)
        again = any(o.target == b.target and o.scope is b.scope and b.line < o.line <= backward
                    for o in work.facts.bindings) or any(n == b.target and b.line < line <= backward
                                                         for n, line in loop.stored)
        if not again:
            return True
    return False


def _handed_criteria(work: _Work) -> set[int]:
    """The functions of this file handed, by name, to a call that hands an optimizer too (``train(model, loader,
    optimizer, criterion, device)`` of another module, set 26's VAE: ``def criterion(...)`` summing): the loss
    that call's training loop steps by."""
    optimizers = {b.target for b in work.facts.bindings if isinstance(b.value, cst.Call) and
                  (dotted(b.value.func) or "").rsplit(".", 1)[-1] in OPTIMIZERS}
    found: set[int] = set()
    for c in work.facts.calls:
        given = [dotted(a.value) for a in c.node.args]
        if optimizers & set(given):
            found |= {id(work.facts.scopes[g]) for g in given if g in work.facts.scopes}
    return found


def _summed_class(work: _Work, call: Call) -> bool:
    """``call`` builds a loss class of another module of the project that sums over the batch (``loss_fn =
    YoloLoss()`` of loss.py: ``nn.MSELoss(reduction="sum")`` inside; set 26, gradients 1/N with no line)."""
    origin = imported_from(work.facts, dotted(call.node.func) or "") if work.crossing is not None else None
    return origin is not None and f"{origin[0]}.{origin[1]}" in work.crossing.summed


def _summed_shown(work: _Work, call: Call) -> None:
    """The summed loss ``call`` makes, bound in a training loop and shown there each step (``print(..., loss.item())``):
    this rank's share of the batch's sum, 1/N of one process's."""
    made = call
    if not call.loops:  # (a criterion built before the loop, ``criterion = nn.BCELoss(reduction='sum')``: its call;
        # or a loss function of the script's, the VAE's ``loss_function(recon_x, x, mean, std)``: the loop's call of it)
        criteria = {b.target for b in work.facts.bindings if b.value is call.node}
        made = next((c for c in work.facts.calls if c.loops and (dotted(c.node.func) in criteria or call.scope.name
                     and (callee(work.facts, c) or (None,))[0] is call.scope)), call)
        if made is call:  # (the criterion called in a step helper the loop calls: an LSTM's ``apply(...)``)
            inner = [c for c in work.facts.calls if dotted(c.node.func) in criteria and not c.loops]
            made, call = next(((c, i) for i in inner for c in work.facts.calls if c.loops and i.scope.name and
                               (callee(work.facts, c) or (None,))[0] is i.scope), (call, call))
    named = {b.target for b in work.facts.bindings if b.value is made.node} | _unpacked_sums(work, made, call)
    loop = made.loops[-1] if made.loops else None
    # (in the loop each step, or after it, the last batch's: Soooda/vae's ``print(..., loss.item())`` an epoch)
    after = [c for c in work.facts.calls if loop is not None and c.scope is loop.scope and c.line > loop.end]
    for shown in [*loop.calls, *after] if loop is not None and named else ():
        per_sample = _per_sample(shown, named, loop.targets if loop is not None else set())
        if per_sample:  # (``loss.item() / len(data)``: a mean over this rank's samples, the same scale: yakhyo's VAE)
            continue
        read = {n for a in shown.node.args for n in names_in(a.value)} & named
        if shown.last in ("print", "format", "info", "write", "set_postfix", "add_scalar", "log") and \
                shown.line > made.line and read:
            work.keep(shown.line, f"{shown.last}(...) shows {sorted(read)[0]}, a loss summed over the batch, " +
                      ("each step" if loop is None or shown.line <= loop.end else "of the training loop's last batch"),
                      "this rank's share of the batch's sum: 1/N of one process's at N processes (the steps "
                      "nearly hold: the optimizer follows the gradient's scale only through its eps, so ddpkit verify "
                      "may still tell the runs apart; loss.sum() * state.world_size keeps them exact); "
                      "ddpkit.reduce(loss.detach()) shows "
                      "the whole batch's")
            return


def _unpacked_sums(work: _Work, made: Call, summed: Call) -> set[str]:
    """What ``loss, rec, kld = loss_func(recon, x)`` (``made``, a function of the script's) takes from its returns
    that holds its summed call ``summed`` (``rec = F.binary_cross_entropy(..., reduction='sum')``, ``loss = rec +
    kld``, ``return loss, rec, kld``): the VAE's elements, each a share of the batch's sum."""
    target = callee(work.facts, made)
    if target is None or target[0] is not summed.scope:
        return set()
    scope, found = target[0], set()
    for b in (b for b in work.facts.bindings if b.whole is made.node and b.value is None and b.index >= 0):
        elements = [e for e in returns.at(work.facts, scope, b.index) if not (isinstance(e, cst.BinaryOperation) and
                    isinstance(e.operator, cst.Divide) and batch_size(e.right))]  # (``rec / x.size(0)``: per sample)
        values = [v for element in elements for v in returns.through(work.facts, scope, element)]
        for _ in range(2):  # (``loss = rec + kld``: through the names the element is made from)
            names = {n for v in values for n in names_in(v)}
            values += [x.value for x in work.facts.bindings if x.scope is scope and x.target in names and
                       x.value is not None and all(x.value is not v for v in values)]
        if any(v is summed.node or any(n is summed.node for n in m.findall(v, m.Call())) for v in values):
            found.add(b.target)
    return found


def _per_sample(shown: Call, named: set[str], targets: set[str]) -> bool:
    """Every read of the loss in ``shown`` is divided by the size of the loop's batch (``loss.item() / len(data)``,
    ``data`` the loop's): a mean over this rank's samples, not a share of the batch's sum."""
    divisions = [d for a in shown.node.args for d in m.findall(a.value, m.BinaryOperation(operator=m.Divide()))
                 if isinstance(d, cst.BinaryOperation) and batch_size(d.right) and names_in(d.right) & targets]
    inside = {id(n) for d in divisions for n in m.findall(d.left, m.Name())}
    reads = [n for a in shown.node.args for n in m.findall(a.value, m.Name()) if isinstance(n, cst.Name) and
             n.value in named]
    return bool(reads) and all(id(n) in inside for n in reads)


SHOWN = ("print", "format", "info", "write", "set_postfix", "set_description", "add_scalar", "log")


def step_loss_shown(work: _Work) -> None:
    """The loss a training loop steps on, shown as it is, each step or after the loop (its last batch's:
    ``print(f"epoch {e} loss {loss.item()}")``): with the global batch kept, a mean over this rank's 1/N of the
    batch, rank 0's on screen; said once for each loss (a GAN's two), at the first line showing it (a summed one is
    said by :func:`_summed_shown`)."""
    # (or a loader sharded here, or handed in converted by another file, with the model: Amaurydpk's loop module)
    handed = bool(work.crossing.provided.get(key("", HANDED))) if work.crossing is not None else False
    if not work.models and not work.trains and not handed or \
            not (sizes.global_batch_kept(work) or handed and not work.per_process_batch):
        return
    if any("a loss summed over the batch" in k.what for k in work.kept):
        return
    said: set[str] = set()
    summed = _summed_names(work, _summed(work))
    for loop in sorted((lp for lp in work.facts.loops if flow.trains(work.facts, lp)), key=lambda lp: -len(lp.outer)):
        losses = stepped_losses(loop) | _stepped_by_helper(work, loop) | _scaled_losses(work, loop)
        losses |= {b.target for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end
                   and isinstance(b.value, cst.BinaryOperation) and names_in(b.value) and
                   names_in(b.value) <= losses}  # (a GAN's ``loss_d = loss_real + loss_fake``)
        after = [c for c in work.facts.calls if c.scope is loop.scope and c.line > loop.end and
                 all(o.line <= c.line <= o.end for o in loop.outer)]  # (within the epoch loop around it)
        backwards = [c.line for c in loop.calls if c.last == "backward"]
        first, stepped = min(backwards, default=loop.end), max(backwards, default=loop.end)
        outputs, terms = _outputs(work, loop), _terms(work, loop, losses)
        for shown in [*loop.calls, *after]:
            read = {n.split(".")[0] for a in shown.node.args for n in names_in(a.value)}
            # (in the loop before the backward too: ``print(f"Loss: {loss:.3f}")`` above ``loss.backward()``)
            inside = shown.line > first or loop.line < shown.line <= loop.end
            also = sorted(read & outputs - losses - said) if shown.last in SHOWN and inside else []
            parts = sorted(read & terms - set(also) - said) if shown.last in SHOWN and inside else []
            named = sorted({n for a in shown.node.args for n in names_in(a.value)} & losses - said)
            # (what the name holds there is the stepped loss, not one rebound below the step: review 29, b/s02's
            # ``loss = running_loss / n_batch`` after the inner loop, then printed in the epoch loop)
            # (a rebinding that reads the loss alone still holds it: the quickstart's ``loss, current = loss.item(),
            # (batch + 1) * len(X)``)
            named = [n for n in named if (b := flow.binding_of(work.facts, n, loop.scope, shown.line)) is not None
                     and (b.line <= stepped or b.value is not None and heads(b.value) == {n})]
            # (or kept after the loop, once an epoch: a/s02's ``losses.append(loss.item())``, then written)
            kept = shown.last == "append" and shown.line > loop.end
            if (shown.last in SHOWN or kept) and (named or also or parts) and inside:
                said.update(named + also + parts)
                what = [f"{', '.join(named)}, the step's loss" + ("es" if len(named) > 1 else "")] if named else []
                what += [f"{', '.join(also)}, of the model's outputs on the batch"] if also else []
                what += [f"{', '.join(parts)}, terms of the step's loss"] if parts else []
                whole = f"ddpkit.reduce({named[0]}.detach(), op='mean')" if named else \
                    f"ddpkit.reduce({(also or parts)[0]}, op='mean')"
                where = "in the log" if shown.last == "log" else "in the list" if kept else "on screen"
                why = f"this rank's: a mean over its 1/N of the global batch (rank 0's {where}), the same quantity " \
                    f"from fewer samples; {whole} shows the whole batch's"
                if named and named[0] in summed:  # (set 26's YOLO and VAE: a sum called "the same quantity")
                    why = f"this rank's: a sum over its 1/N of the global batch (rank 0's {where}), about 1/N of " \
                        f"the whole batch's sum; ddpkit.reduce({named[0]}.detach(), op='sum') shows the whole batch's"
                    bound = flow.binding_of(work.facts, named[0], loop.scope, shown.line)
                    if bound is not None and bound.value is not None and "world_size" in work.facts.code(bound.value):
                        why = "this rank's: N times its sum over 1/N of the global batch (rank 0's on screen), about " \
                            f"the whole batch's sum; ddpkit.reduce({named[0]}.detach(), op='mean') shows it exactly"
                work.keep(shown.line, f"{shown.last}(...) {'keeps' if kept else 'shows'} {'; '.join(what)}" +
                          (", the training loop's last" if shown.line > loop.end else ""), why)


def _scaled_losses(work: _Work, loop: Loop) -> set[str]:
    """The losses ``loop`` steps as ``(loss * state.world_size).backward()`` (a summed loss's named fix)."""
    return {n for c in loop.calls if c.last == "backward" and isinstance(c.node.func, cst.Attribute)
            for n in names_in(c.node.func.value) if "world_size" in work.facts.code(c.node.func.value)
            and "world_size" not in n}


def _called(value: cst.Call) -> cst.Call:
    """The call a chain of methods starts from: ``net(x)`` of ``net(x).view(-1)`` (DCGAN's ``output =
    netD(real).view(-1)``)."""
    while isinstance(value.func, cst.Attribute) and isinstance(value.func.value, cst.Call):
        value = value.func.value
    return value


def _terms(work: _Work, loop: Loop, losses: set[str]) -> set[str]:
    """The names a stepped loss is summed from in ``loop`` (an f-GAN's ``errD = errD_real + errD_fake``, each of
    the step's batch), each bound in the loop itself (not a weight set above it)."""
    within = [b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end]
    summed = {n for b in within if b.target in losses for n in _added(b.value)}
    return {b.target for b in within if b.target in summed - losses}


def _added(value: Any) -> list[str]:
    """The names a sum adds (``errD_real + errD_fake``): not a weight or what it weighs (``beta * kld``)."""
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Add, cst.Subtract)):
        return _added(value.left) + _added(value.right)
    return [value.value] if isinstance(value, cst.Name) else []


def _outputs(work: _Work, loop: Loop) -> set[str]:
    """The names ``loop`` binds to the prepared model's output on the batch, or to a value read from it alone (a
    GAN's ``D_x = output.mean().item()``, ``score = out``); not a running sum (``c = c + ...``: reduced, or said,
    as a sum)."""
    models = {b.target for b in work.models}
    # (not in an evaluation nested in the epoch's loop: a whole loader's outputs are every rank's; nor the model's
    # outputs on anything but a training batch: a fixed validation tensor's, ``model(X_val)``, are every rank's)
    evaluations = [lp for lp in work.facts.loops if loop in lp.outer and not flow.trains(work.facts, lp)]
    trained = [loop] + [lp for lp in work.facts.loops if loop in lp.outer and lp not in evaluations]
    batch = {n for lp in trained for n in batchnames.batch_names(work.facts, lp)}
    inside = [b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end and
              b.value is not None and b.target not in heads(b.value) and
              not any(lp.line <= b.line <= lp.end for lp in evaluations)]
    found = {b.target for b in inside if isinstance(b.value, cst.Call) and dotted((c := _called(b.value)).func) in
             models and any(heads(a.value) & batch for a in c.args)}
    for _ in range(2):  # (``out = D(x)``, ``score = out``, ``shown = score.mean().item()``)
        found |= {b.target for b in inside if "." not in b.target and
                  heads(b.value) & found}
    return found | _helper_outputs(work, loop)


def _helper_outputs(work: _Work, loop: Loop) -> set[str]:
    """The names ``loop`` binds to what a training step of this file returns read from a model it is handed
    (MonoFlow's ``return lossD.item(), d.mean().item()`` of ``d = netD(fake)``, printed after the loop as
    ``loss_g``: rank 0's last half batch; set 26)."""
    found = set()
    for b in work.facts.bindings:
        made = next((c for c in loop.calls if c.node is b.whole), None) if b.scope is loop.scope else None
        target = callee(work.facts, made) if made is not None else None
        if made is None or target is None or not flow.scope_trains(work.facts, target[0]):
            continue
        ran = {h.target for h in work.facts.bindings if h.scope is target[0] and isinstance(h.value, cst.Call) and
               dotted(_called(h.value).func) in target[0].params and
               not _a_function(work, argument_for(made, dotted(_called(h.value).func) or "", *target))}
        if any(heads(element) & ran for element in returns.at(work.facts, target[0], b.index)):
            found.add(b.target)
    return found


def _a_function(work: _Work, passed: cst.BaseExpression | None) -> bool:
    """What a step helper is handed is a function, not a model: a lambda, a function of the file, a ``partial``
    (``lr = lr_at(step)`` of a schedule: the same on every rank, no share of a batch; review 41)."""
    if isinstance(passed, cst.Call):
        return dotted(passed.func) in ("partial", "functools.partial")
    name = dotted(passed) if passed is not None else None
    return isinstance(passed, cst.Lambda) or name is not None and name in work.facts.scopes and \
        not work.facts.scopes[name].cls


def _stepped_by_helper(work: _Work, loop: Loop) -> set[str]:
    """The names ``loop`` binds to the loss a step function of this file returns after its backward
    (``loss = step(model, opt, x)``, whose body ends ``loss.backward(); opt.step(); return loss``)."""
    found = set()
    for b in work.facts.bindings:
        made = next((c for c in loop.calls if c.node is b.whole), None) if b.scope is loop.scope else None
        target = callee(work.facts, made) if made is not None else None
        if made is None or target is None:
            continue
        backed = {dotted(c.node.func.value) for c in work.facts.calls if c.scope is target[0] and
                  c.last == "backward" and isinstance(c.node.func, cst.Attribute)} - {None}
        if any(loss_name(element) in backed for element in returns.at(work.facts, target[0], b.index)):
            found.add(b.target)
    return found
