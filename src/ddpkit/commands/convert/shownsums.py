"""Running sums and counts of a loop that the script shows as it goes or after it (a progress line's running
loss, a count printed after an evaluation): each is this rank's share of its shard until it is reduced, said where
it is shown; the reductions themselves are :mod:`.reductions`'.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(2, 1)\\n"
    ...          "o = torch.optim.SGD(m.parameters(), lr=0.1)\\ntotal = 0.0\\n"
    ...          "for i, (x, y) in enumerate(DataLoader(ds, batch_size=4, shuffle=True)):\\n"
    ...          "    loss = torch.nn.functional.mse_loss(m(x), y)\\n    o.zero_grad()\\n    loss.backward()\\n"
    ...          "    o.step()\\n    total += loss.item()\\n    print(total / (i + 1))\\n")
    >>> [k.what[:40] for k in p.kept]
    ['print(...) in the loop shows total as ea']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.losses import SHOWN
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Loop
from ddpkit.commands.convert.sums import over_own_batch

_Work = Any  # the plan in the making (plan._Work)


SHOWS = ("print", "progress_bar", "set_postfix", "set_description", "write", "info", "add_scalar", "log")


def running_shown(work: _Work, loop: Loop, names: list[str], after: bool = True) -> None:
    """Sums the loop shows as each step leaves them (kuangliu's CIFAR ``progress_bar(i, len(loader), 'Acc: %.3f%%
    (%d/%d)' % (..., correct, total))``, PyHessian's ``bar.set_postfix(loss=train_loss / total_num)``): this rank's
    running share, said once a loop (``after``: reduced after it, so every rank's there); and a bar counted by
    samples (``bar.update(target.size(0))`` of ``tqdm(total=len(loader.dataset))``): this rank's, it stops at 1/N."""
    # (or a name the loop makes from them: mnist-vae's ``status = {"loss": tr_loss / tr_step}``, then
    # ``t.set_postfix(status)``)
    made = {b.target: b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end and
            b.value is not None and names_in(b.value) & set(names)}
    for call in loop.calls:
        if call.last in SHOWS and call.line > loop.line:
            read = {n for a in call.node.args for n in names_in(a.value)}
            shown = sorted(read & set(names) | {x for k in read & set(made) for x in names_in(made[k].value)
                                                 if x in names})
            # (a sum shown and read nowhere after the loop, reduced by nothing: kuangliu's test bar's ``test_loss``
            # beside its ``correct, total``; set 26)
            nested = [lp for lp in work.facts.loops if loop in lp.outer]  # (an evaluation's sums, reduced there)
            own = {n for n, at in loop.augmented if not any(lp.line <= at <= lp.end for lp in nested)}
            alone = sorted(own & read - set(names) - set(shown)) if after else []
            if shown or alone:
                work.keep(call.line, f"{call.last}(...) in the loop shows {', '.join(shown + alone)} as each step "
                          "leaves them", "this rank's running share of its shard (rank 0's on screen)" +
                          (f"; after the loop {', '.join(shown)} are every rank's" if after and shown else "") +
                          (f", {', '.join(alone)} stays this rank's (read nowhere after it)" if alone and shown
                           else "; read nowhere after the loop, reduced by nothing" if alone else ""))
                break
    for call in loop.calls:
        bar = dotted(call.node.func.value) if call.last == "update" and isinstance(call.node.func, cst.Attribute) \
            else None
        counted = call.node.args and names_in(call.node.args[0].value) & loop.targets  # (``update(y.size(0))``)
        if bar is not None and counted and _counted_bar(work, bar):
            work.keep(call.line, f"{bar}.update(...) counts this rank's samples", f"at N processes {bar} ends at 1/N "
                      "of its total (rank 0's on screen): each rank takes its share of every batch")
            return


def shown_only(work: _Work, loop: Loop) -> tuple[str, int] | None:
    """An evaluation whose sums are shown each step (``progress_bar(i, n, 'Loss: %.3f' % (test_loss / (i + 1)))``)
    and read nowhere after the loop: sharded, what it shows would be rank 0's running share, and no reduction after
    the loop reaches the screen. ``(what it keeps, the line)``."""
    sums = {n for n, _ in loop.augmented}
    after = {name for name, scope, line, _node in work.facts.reads if scope is loop.scope and line > loop.end}
    shown = next((c for c in loop.calls if c.last in SHOWS and c.line > loop.line and
                  {n for a in c.node.args for n in names_in(a.value)} & sums), None)
    if shown is None or sums & after:
        return None
    return f"the running sums it shows each step ({shown.last}(...), read nowhere after it)", shown.line


def shares(work: _Work, loop: Loop, shares: list[tuple[str, int]]) -> None:
    """Sums of the training loop read after it that no reduction here makes every rank's (a sum over a script
    loss whose reduction is unseen, divided by nothing or by something else): rank 0's where shown; said."""
    for name, line in shares:
        if not work.per_process_batch and over_own_batch(work.facts, loop, name):
            work.leave(line, f"{name} adds the loss divided by the batch's own size: each rank's batch is B/N, so "
                       "each term, and the sum read here, is N times one process's (rank 0's on screen)", "divide by "
                       f"the global batch instead, or show ddpkit.reduce({name}, op='mean') / state.world_size")
            continue
        work.keep(line, f"{name}, added up over the training loop's batches, is read here as this rank's sum",
                  "rank 0's share where it is shown (convert cannot tell what it adds up): ddpkit.reduce("
                  f"{name}, op='mean') averages it over the ranks, ddpkit.reduce({name}) adds the ranks' up")


def count_shown(work: _Work, loop: Loop) -> None:
    """A count of the samples so far made in the loop from this rank's batch and shown there (PyTorch's quickstart:
    ``current = (batch + 1) * len(X)`` in ``print(f"[{current:>5d}/{size:>5d}]")``): rank 0's, half the samples at 2
    processes; said once a loop."""
    sized = {f"len({t})" for t in loop.targets} | {f"{t}.size(0)" for t in loop.targets} | \
        {f"{t}.shape[0]" for t in loop.targets}
    # (a step times the batch's size, ``(batch + 1) * len(X)``: not ``loss / len(X)``, not ``x.view(x.size(0), -1)``)
    made = {b.target: b for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end
            and isinstance(b.value, cst.BinaryOperation) and isinstance(b.value.operator, cst.Multiply)
            and any(work.facts.code(side).replace(" ", "") in sized for side in (b.value.left, b.value.right))}
    def counts(node: cst.CSTNode) -> bool:  # (pytorch/examples' ``batch_idx * len(data)`` in the print itself)
        return any(isinstance(p, cst.BinaryOperation) and any(work.facts.code(side).replace(" ", "") in sized
                                                               for side in (p.left, p.right))
                   for p in m.findall(node, m.BinaryOperation(operator=m.Multiply())))

    for call in loop.calls:
        if call.last in ("print", "info", "write", "set_description") and call.line > loop.line:
            shown = sorted({n for a in call.node.args for n in names_in(a.value)} & set(made))
            written = next((work.facts.code(p) for a in call.node.args for p in m.findall(
                a.value, m.BinaryOperation(operator=m.Multiply())) if counts(p)), None) if not shown else None
            shown = shown or ([written] if written else [])
            if shown:
                work.keep(call.line, f"{call.last}(...) in the loop shows {shown[0]}, a count of this rank's samples",
                          "at N processes each rank takes 1/N of the samples (of every batch; of the batches, "
                          "where the batch stays per process): the count is rank 0's share")
                return


def _counted_bar(work: _Work, bar: str) -> bool:
    """``bar`` is a progress bar made with a ``total=`` (``with tqdm(total=n) as bar:``, ``bar = tqdm(total=n)``)."""
    made: list[cst.BaseExpression] = [b.value for b in work.facts.bindings
                                      if b.target == bar and isinstance(b.value, cst.Call)]
    for node in m.findall(work.facts.module, m.With()):
        assert isinstance(node, cst.With)
        made += [i.item for i in node.items if i.asname is not None and dotted(i.asname.name) == bar]
    return any(isinstance(v, cst.Call) and (dotted(v.func) or "").rsplit(".", 1)[-1] in ("tqdm", "progress") and
               any(a.keyword is not None and a.keyword.value == "total" for a in v.args) for v in made)


# an evaluation loop that saves a picture of one of its batches: sharded, rank 0's batch holds samples 0, N, 2N...
def last_shown(work: _Work, loop: Loop, reduced: set[str]) -> None:
    """A value the sharded evaluation loop binds each batch (``loss = criterion(outputs, y)``), shown after it
    (``print(... loss.item(), 100. * correct / total)``): the last batch's, of this rank's shard; said beside the
    reduced sums (wide-resnet's "Validation Epoch #N Loss:")."""
    bound = {b.target for b in work.facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end and
             b.value is not None} - reduced - loop.targets
    for shown in (c for c in work.facts.calls if c.scope is loop.scope and c.line > loop.end and c.last in SHOWN):
        named = sorted(n for n in {n for a in shown.node.args for n in names_in(a.value)} & bound
                       if _from_loop(work, n, loop, shown.line))
        if named:
            work.keep(shown.line, f"{shown.last}(...) shows {named[0]}, the evaluation loop's last batch's",
                      "this rank's last batch of its shard (rank 0's on screen); the sums beside it are every "
                      f"rank's: ddpkit.reduce({named[0]}.detach(), op='mean') shows the mean over the ranks' last "
                      "batches")
            return


def _from_loop(work: _Work, name: str, loop: Loop, line: int) -> bool:
    """What ``name`` holds at ``line``, below ``loop``, was bound in it (not rebound after it: review 29)."""
    bound = flow.binding_of(work.facts, name, loop.scope, line)
    return bound is not None and loop.line < bound.line <= loop.end
