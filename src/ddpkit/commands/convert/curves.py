"""A training loop's list of per-step values kept whole (a training curve): averaged across ranks, step by step.

``losses.append(loss.item())`` each step into a list begun before the loop, then the list itself returned, saved or
plotted (video-classification's ``return losses, scores``, saved with ``np.save``): each rank's list holds its own
part of each global batch, so what is saved is rank 0's curve. Every rank took as many steps, and each value is a
mean over the rank's part of the batch (the loss of a mean criterion, a batch's score), so the mean over the ranks of
step k's values is step k's value over the global batch, as one process has it. Right after the loop, every rank
running it (no ``break`` a rank could take alone, each append a statement of the loop's own block)::

    losses = ddpkit.reduce(torch.tensor(losses, dtype=torch.float64), op='mean').tolist()

A list read only through a mean (``np.mean(losses)``) is left to :mod:`.reductions` (one number, not the list).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(2, 1)\\n"
    ...          "o = torch.optim.SGD(m.parameters(), lr=0.1)\\nls = []\\n"
    ...          "for x, y in DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), "
    ...          "batch_size=4):\\n    loss = torch.nn.functional.mse_loss(m(x), y)\\n    o.zero_grad()\\n"
    ...          "    loss.backward()\\n    o.step()\\n    ls.append(loss.item())\\ntorch.save(ls, 'curve.pt')\\n")
    >>> [line for line in p.text.splitlines() if line.startswith("ls = ddpkit")]
    ["ls = ddpkit.reduce(torch.tensor(ls, dtype=torch.float64), op='mean').tolist()"]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.batchmeans import MEANS, loss_number, mean_criterion, stepped_losses, stepped_mean
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Loop

_Work = Any  # the plan in the making (plan._Work)
# per-batch scores that are a mean over the batch's samples
SCORES = ("sklearn.metrics.accuracy_score",)


def curves(work: _Work, loop: Loop) -> set[str]:
    """Average, right after ``loop``, each list of per-step batch means it fills and the code below reads whole;
    the names averaged (their means need nothing more)."""
    facts = work.facts
    if loop.breaks or not isinstance(loop.node, cst.For) or not isinstance(loop.node.body, cst.IndentedBlock) or \
            _skips(loop.node.body) or \
            facts.aliases.get("torch") != "torch":  # (the line it adds calls torch.tensor)
        return set()
    begun = {b.target for b in facts.bindings if b.scope is loop.scope and b.line < loop.line and
             isinstance(b.value, cst.List) and not b.value.elements}
    done = set()
    for name in sorted({n for n, _ in loop.stored} & begun):
        appends = [c for c in loop.calls if c.last == "append" and isinstance(c.node.func, cst.Attribute) and
                   dotted(c.node.func.value) == name]
        every_step = all(_own_step(loop, c.stmt) and _batch_mean(work, loop, c.node, c.line) for c in appends)
        if appends and every_step and _read_inside(work, loop, name, appends) and \
                not any(n == name for n, _ in loop.augmented):  # (read inside: averaged as it grows, read after too)
            _averaged_each(work, name, appends)  # (WGAN-GP's curve plotted and saved every few steps, in the loop)
            done.add(name)
            continue
        inside = bool(appends) and not every_step and _read_inside(work, loop, name, appends)
        if not inside and (not appends or not _read_whole(work, loop, name)) or \
                any(n == name for n, _ in loop.augmented):
            continue
        if not every_step:  # (read whole after the loop, or inside it: ChatBotCHS's mean of the last few steps)
            _unknown_means(work, loop, name, appends)
            continue
        work.edits.after.setdefault(id(loop.node), []).append(
            f"{name} = ddpkit.reduce(torch.tensor({name}, dtype=torch.float64), op='mean').tolist()")
        work.note(f"after the training loop: {name} averaged across ranks step by step (ddpkit.reduce, op='mean')",
                  "each rank's list holds its part of each global batch; every rank took as many steps, so the "
                  "mean of the ranks' values at a step is the global batch's", loop.end)
        done.add(name)
    return done


def _read_inside(work: _Work, loop: Loop, name: str, appends: list[Any]) -> bool:
    """Inside the loop, the list is read other than by its appends and through a mean (plotted, saved)."""
    own = {id(c.stmt) for c in appends}
    for stmt, scope, line in work.facts.statements:
        if scope is loop.scope and loop.line < line <= loop.end and id(stmt) not in own and \
                any(not _in_mean(work, stmt, node) for node in m.findall(stmt, m.Name(value=name))):
            return True
    return False


def _averaged_each(work: _Work, name: str, appends: list[Any]) -> None:
    """Each value averaged across ranks as it is appended: the list, read inside the loop, is one process's curve
    at every read (one scalar all-reduce a step, where ``.item()`` waits for the step already)."""
    for call in appends:
        value = call.node.args[0].value
        code = work.facts.module.code_for_node(value)
        work.edits.expr[id(value)] = lambda _node, code=code: cst.parse_expression(
            f"ddpkit.reduce(torch.tensor({code}, dtype=torch.float64), op='mean').item()")
        work.note(f"{name}.append(...): each value averaged across ranks (ddpkit.reduce, op='mean')", "the list is "
                  "read inside the loop (plotted or saved there), and each rank's value is a mean over its part of the "
                  "global batch: the ranks' mean is the global batch's, as one process has it", call.line)


def _unknown_means(work: _Work, loop: Loop, name: str, appends: list[Any]) -> None:
    """A list of the trained loss's values, step by step, whose mean over the batch convert cannot see (a loss of
    another module's function, ``d_loss, score = discriminator_loss(...)``; vltkv's ``D_losses``): kept, said."""
    stepped = stepped_losses(loop)
    shown = [c for c in appends if _own_step(loop, c.stmt) and len(c.node.args) == 1 and
             (loss_number(c.node.args[0].value) in stepped or _stepped_by(work, loop, c.node.args[0].value))]
    if shown and len(shown) == len(appends):
        work.keep(shown[0].line, f"{name} keeps this rank's loss step by step (rank 0's curve where it is saved or "
                  "shown): convert cannot tell it is a mean over the batch (a loss a function returns)",
                  f"if it is: {name} = ddpkit.reduce(torch.tensor({name}, dtype=torch.float64), op='mean').tolist() "
                  "after the loop averages the ranks' step by step")


def _stepped_by(work: _Work, loop: Loop, value: Any) -> bool:
    """``value`` calls the script's own training step, which returns the number of the loss it steps (LSGAN's
    ``d_loss.append(self.train_discriminator(...))``, its ``return total_loss.item()``)."""
    made = next((c for c in loop.calls if c.node is value), None)
    own = flow.callee(work.facts, made) if made is not None else None
    return own is not None and stepped_mean(work.facts, own[0], mean=False)


def _own_step(loop: Loop, stmt: Any) -> bool:
    """The append is a statement of the loop's own block, or of a ``with`` there (``with torch.no_grad():``, a
    WGAN-GP's bookkeeping) or of a ``try`` body (LSGAN's ``try: d_loss.append(...)``): every step adds one, on
    every rank."""
    block, found = list(loop.node.body.body), []
    while block:  # (a one-line ``with x: y = ...`` holds no statement line of its own: review 34's hang)
        found += [s for s in block if not isinstance(s, (cst.With, cst.Try))]
        block = [t for s in block if isinstance(s, (cst.With, cst.Try)) and isinstance(s.body, cst.IndentedBlock)
                 for t in s.body.body]
    return stmt is not None and any(s is stmt for s in found)


def _batch_mean(work: _Work, loop: Loop, call: cst.Call, line: int) -> bool:
    """What is appended is a mean over the rank's part of the batch: the trained loss's value (a mean
    criterion's), or a per-batch score (``accuracy_score(y, pred)``)."""
    if len(call.args) != 1:
        return False
    value = call.args[0].value
    if isinstance(value, cst.Name):  # ``step_score = accuracy_score(...)`` in the loop, then appended
        bound = flow.binding_of(work.facts, value.value, loop.scope, line)
        if bound is not None and bound.value is not None and bound.line >= loop.line:
            value = bound.value
    if isinstance(value, cst.Call) and (resolve(dotted(value.func), work.facts.aliases) or "") in SCORES:
        return not any(a.keyword is not None and a.keyword.value == "normalize" and  # (False: a count)
                       not (isinstance(a.value, cst.Name) and a.value.value == "True") for a in value.args)
    made = next((c for c in loop.calls if c.node is value), None)  # (``losses.append(step(x, y))``)
    own = flow.callee(work.facts, made) if made is not None else None
    if own is not None:
        return stepped_mean(work.facts, own[0])
    name = loss_number(value)  # (a stepped loss, or one the loop sums from them: a GAN's ``loss_D``)
    return name is not None and (name in _means(work, loop) or mean_criterion(work.facts, loop, name))


def _means(work: _Work, loop: Loop) -> set[str]:
    """The names backward is called on whose value is a mean criterion's (:func:`.batchmeans.mean_criterion`)."""
    return {loss for loss in stepped_losses(loop) if mean_criterion(work.facts, loop, loss)}


def _read_whole(work: _Work, loop: Loop, name: str) -> bool:
    """Below the loop, in its function, the list is read other than through a mean (returned, saved, plotted,
    appended to another list)."""
    for stmt, scope, line in work.facts.statements:
        if scope is not loop.scope or line <= loop.end:
            continue
        for node in m.findall(stmt, m.Name(value=name)):
            if not _in_mean(work, stmt, node):
                return True
    return False


def _in_mean(work: _Work, stmt: Any, node: cst.CSTNode) -> bool:
    """``node`` is the argument of a mean (``np.mean(l)``, ``sum(l) / len(l)``'s parts, ``len(l)``)."""
    for call in m.findall(stmt, m.Call()):
        if isinstance(call, cst.Call) and len(call.args) == 1 and call.args[0].value is node and \
                resolve(dotted(call.func), work.facts.aliases) in (*MEANS, "sum", "len", "torch.mean"):
            return True
    return False


def _skips(node: cst.CSTNode) -> bool:
    """A ``continue`` of this loop's own (not one of a loop inside it): a step that skips its append."""
    if isinstance(node, cst.Continue):
        return True
    if isinstance(node, (cst.For, cst.While, cst.FunctionDef, cst.ClassDef)):
        return False
    return any(_skips(child) for child in node.children)
