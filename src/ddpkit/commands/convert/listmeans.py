"""Means of a training loop's list or meter, made every rank's where they are written.

``train_loss.append(metrics[0])`` each step into a list begun before the loop, then ``np.mean(train_loss)``,
``sum(l) / len(l)`` or an ``AverageMeter``'s ``.avg`` (``.average``) below it: each rank's value is the mean over
its own batches; every rank took as many steps, so the mean of the ranks' means is the mean over every batch. Wrapped in
``ddpkit.reduce(..., op='mean')`` (a collective) only where every rank that ran the loop passes: the loop's own
block (a ``with torch.no_grad():`` block counts as it), no ``return`` / ``raise`` / ``try`` between, no test of its
own, not a write the converter makes rank 0's; anywhere else the mean is listed.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import numpy as np\\nimport torch\\nfrom torch.utils.data import DataLoader\\n"
    ...          "m = torch.nn.Linear(2, 1)\\no = torch.optim.SGD(m.parameters(), lr=0.1)\\nls = []\\n"
    ...          "for x, y in DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), "
    ...          "batch_size=4):\\n    loss = torch.nn.functional.mse_loss(m(x), y)\\n    o.zero_grad()\\n"
    ...          "    loss.backward()\\n    o.step()\\n    ls.append(loss.item())\\nprint(np.mean(ls))\\n")
    >>> [line for line in p.text.splitlines() if "np.mean" in line]
    ["ddpkit.print(ddpkit.reduce(np.mean(ls), op='mean'))"]
"""

from __future__ import annotations

import re
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.accumulated import accumulated
from ddpkit.commands.convert.batchmeans import MEANS, loss_name
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import Loop
from ddpkit.commands.convert.summedloss import summing

_Work = Any  # the plan in the making (plan._Work)


def list_means(work: _Work, loop: Loop, whole: set[str]) -> None:
    """``train_loss.append(metrics[0])`` every training step into a list begun before the loop, then ``m =
    np.mean(train_loss)`` below it (Graph-WaveNet): the mean over this rank's batches. Every rank took as many
    steps, so the mean of the ranks' means is the mean over every batch: ``m = ddpkit.reduce(m, op='mean')``."""
    facts = work.facts
    # (``loss_arr += [loss.item()]``, a UNet lesson's: a list extended, as an append)
    appended = {name for name, _ in [*loop.stored, *loop.augmented] if name.isidentifier()}
    begun = {b.target for b in facts.bindings if b.target in appended and b.scope is loop.scope and
             b.line < loop.line and isinstance(b.value, cst.List) and not b.value.elements} - whole

    def lists(line: int) -> set[str]:
        """The lists still this loop's at ``line``: none a later loop above it added to (its mean is not this
        loop's), nor bound again between (an evaluation's ``loss_arr = []`` reusing the name)."""
        later = {n for other in facts.loops if other.scope is loop.scope and loop.end < other.line < line
                 for n, _ in [*other.stored, *other.augmented]}
        later |= {b.target for b in facts.bindings if b.scope is loop.scope and loop.end < b.line < line and
                  not (b.value is not None and b.target in names_in(b.value))}  # (not ``l = np.array(l)``)
        return begun - later
    summed = {name for name in begun if _summed_values(work, loop, name)}
    for name in sorted(summed):  # (a VAE's ``losses.append(loss.detach())`` of ``reduction="sum"``: review 38)
        work.keep(loop.line, f"the training loop's list {name} holds losses summed over each rank's part of the batch",
                  "a mean of it is this rank's (1/N of one process's sums at N processes): ddpkit.reduce(m) of that "
                  "mean (op='sum') gives one process's")
    begun -= summed
    handled: set[int] = set()
    for stmt, scope, line in facts.statements:
        small = stmt.body[0] if len(stmt.body) == 1 else None
        if scope is not loop.scope or line <= loop.end or not isinstance(small, cst.Assign) or \
                len(small.targets) != 1 or not isinstance(small.targets[0].target, cst.Name):
            continue
        value, target = small.value, small.targets[0].target.value
        if isinstance(value, cst.Call) and resolve(dotted(value.func), facts.aliases) in MEANS and \
                any(a.keyword is not None and a.keyword.value == "weights" for a in value.args) and \
                dotted(value.args[0].value) in lists(line):
            handled.add(id(stmt))  # (``np.average(losses, weights=sizes)``: a weighted mean over this rank's)
            work.leave(line, f"{target} = a weighted mean of the training loop's list: over this rank's batches only "
                       "(rank 0's)", "reduce its two sums: ddpkit.reduce(float(np.sum(np.multiply(values, weights)))) "
                       "/ ddpkit.reduce(float(np.sum(weights)))")
            continue
        if not (isinstance(value, cst.Call) and resolve(dotted(value.func), facts.aliases) in MEANS and
                len(value.args) == 1 and dotted(value.args[0].value) in lists(line)):
            continue
        handled.add(id(stmt))
        if not _every_rank(work, stmt) or not _reached(facts, loop, stmt) and _data_tested(facts, loop, stmt):
            # (review 25: under a data-dependent ``if``,
            work.leave(line, f"{target} = a mean of the training loop's list under a test or past a return: it stays "
                       "this rank's (rank 0's where it is shown)", "average it on every rank first, where no rank can "
                       "skip it: m = ddpkit.reduce(m, op='mean') right after the loop, then use m")
            continue  # a collective one rank may skip hangs the others)
        after = work.edits.after.setdefault(id(stmt), [])
        if f"{target} = ddpkit.reduce({target}, op='mean')" not in after:
            after.append(f"{target} = ddpkit.reduce({target}, op='mean')")
            work.note(f"{target} = np.mean(...) of the training loop's list: averaged across ranks (ddpkit.reduce, "
                      "op='mean')", "each rank's list holds its own batches' values; every rank took as many steps",
                      line)


    _meters_shown(work, loop)
    accumulated(work, loop)
    meters = _meters(facts, loop)
    for stmt, scope, line in facts.statements:  # (``return sum(l) / len(l)``, ``print(np.mean(l))``: in place)
        if scope is loop.scope and line > loop.end and id(stmt) not in handled:
            found = _list_mean_nodes(facts, stmt, lists(line)) + [
                n for n in m.findall(stmt, m.Attribute(attr=m.Name("avg") | m.Name("average")))
                if isinstance(n, cst.Attribute) and dotted(n.value) in meters and id(n) not in _called(stmt)] + [
                c for c in m.findall(stmt, m.Call(func=m.Attribute(attr=m.Name("avg") | m.Name("average")), args=[]))
                if isinstance(c, cst.Call) and isinstance(c.func, cst.Attribute) and dotted(c.func.value) in meters]
            reached = _reached(work.facts, loop, stmt)
            if found and not (reached and _every_rank(work, stmt)):
                where = "under a test or past a return" if not reached else "in a write rank 0 alone makes"
                work.leave(line, f"a mean of the training loop's list or meter {where}: it stays this rank's (rank "
                           "0's where it is written)", "average it on every rank first, where no rank can skip it: "
                           "m = ddpkit.reduce(m, op='mean') right after the loop, then use m")
                continue
            fresh = [node for node in found if id(node) not in work.edits.expr]
            for node in fresh:
                work.edits.expr[id(node)] = lambda n: cst.Call(
                    cst.parse_expression("ddpkit.reduce"),
                    [cst.Arg(n), cst.Arg(cst.SimpleString("'mean'"), keyword=cst.Name("op"), equal=TIGHT)])
            if fresh:  # (one line for a statement's means: NRI prints four)
                work.note("a mean of the training loop's list or meter: averaged across ranks (ddpkit.reduce, "
                          "op='mean')", "each rank's list holds its own batches' values; every rank took as many steps",
                          line)


# what shows a value as it is: a running meter handed to one of these inside the loop is seen as it stands
SHOWN = ("print", "format", "info", "write", "log", "set_postfix", "set_description", "add_scalar", "progress_bar")


def _summed_values(work: _Work, loop: Loop, name: str) -> bool:
    """What the loop appends to ``name`` is a loss summed over the batch (``reduction="sum"``, or a criterion built
    so), bound in the loop."""
    appends = [c for c in loop.calls if c.last == "append" and isinstance(c.node.func, cst.Attribute) and
               dotted(c.node.func.value) == name and c.node.args]
    for call in appends:
        loss = loss_name(call.node.args[0].value) or dotted(call.node.args[0].value)
        bound = flow.binding_of(work.facts, loss, loop.scope, call.line) if loss else None
        value = bound.value if bound is not None else None
        criteria = [b.value for b in work.facts.bindings if isinstance(value, cst.Call) and
                    b.target == dotted(value.func)]
        if summing(value) or any(summing(c) for c in criteria):
            return True
    return False


def _meters_shown(work: _Work, loop: Loop) -> None:
    """A running meter shown inside the training loop (LDAM-DRW's ``'Loss {loss.val:.4f} ({loss.avg:.4f})'.format(
    ..., loss=losses)`` every ``print_freq`` steps): this rank's running share, rank 0's on screen and in the log;
    said once a loop (its mean after the loop is reduced above, or listed)."""
    # (not a timer: ``data_time.update(time.time() - end)`` times this rank's steps, which is what it shows)
    timers = {dotted(c.node.func.value) for c in loop.calls if c.last in FEEDS and isinstance(
        c.node.func, cst.Attribute) and "time" in "".join(work.facts.code(a.value) for a in c.node.args)}
    meters = _meters(work.facts, loop) - timers
    for call in loop.calls if meters else ():
        if call.last in SHOWN and call.line > loop.line:
            shown = sorted({n.split(".")[0] for a in call.node.args for n in names_in(a.value)} & meters)
            if shown:
                work.keep(call.line, f"{call.last}(...) in the loop shows the meter {', '.join(shown)} as each step "
                          "leaves it", "this rank's running share of its shard, over 1/N of the samples (rank 0's "
                          "on screen and in a log); its mean after the loop is every rank's where it is reduced")
                return


def _data_tested(facts: Any, loop: Loop, stmt: cst.CSTNode) -> bool:
    """``stmt`` sits under an ``if`` whose test reads what the training loop made (a loss, a metric, its list):
    ranks may take it apart. A test of the epoch or an option (``if (epoch + 1) % 2 == 0:``) every rank takes alike
    (review 26)."""
    made = set(loop.targets) | {b.target for b in facts.bindings if loop.line <= b.line <= loop.end} | \
        {n for n, _ in [*loop.stored, *loop.augmented]}
    holders = [n for n in m.findall(loop.scope.node, m.If()) if isinstance(n, cst.If) and
               any(s is stmt for s in m.findall(n.body, m.SimpleStatementLine()))]
    return any(names_in(h.test) & made for h in holders) or not holders


def _called(stmt: cst.CSTNode) -> set[int]:
    """The attributes ``stmt`` calls (``meter.average()``, a method: its value, not the attribute, is the mean)."""
    return {id(c.func) for c in m.findall(stmt, m.Call()) if isinstance(c, cst.Call)}


def _meters(facts: Any, loop: Loop) -> set[str]:
    """The running-average meters of a training loop (bearpaw's CIFAR recipe: ``losses = AverageMeter()`` before it,
    ``losses.update(loss.item(), inputs.size(0))`` each step): their ``.avg`` after it is this rank's batches' mean;
    every rank took as many samples, so the mean over the ranks is every sample's."""
    made = {b.target for b in facts.bindings if b.scope is loop.scope and b.line < loop.line and
            isinstance(b.value, cst.Call) and (dotted(b.value.func) or "").rsplit(".", 1)[-1].endswith(METERS)}
    return made & {dotted(c.node.func.value) for c in loop.calls
                   if c.last in FEEDS and isinstance(c.node.func, cst.Attribute)}


# a running average's class (``AverageMeter``, ``AvgMeter``, ``Averager``) and what feeds it a step's value
# (a CIFAR recipe's ``meter.add(loss.item(), x.size(0))`` as ``update``)
METERS = ("Meter", "Averager", "RunningAverage")
FEEDS = ("update", "add", "record", "push", "accumulate")


def _reached(facts: Any, loop: Loop, stmt: cst.SimpleStatementLine) -> bool:
    """``stmt`` sits in the block of the function (or of a loop around the training loop, an epoch loop), below a
    statement of that block that holds the training loop, with nothing between that may route a rank around it (a
    ``return``, a ``raise``, a ``try``), and in no ``if`` / ``with`` / ``try`` of its own: every rank that ran the
    loop runs it, so a collective there is met by all (review: ``if losses.avg < best: best = ...``, a rank's early
    ``return`` in an ``except``). A ``with torch.no_grad():`` block counts as the block it sits in."""
    root = loop.scope.node
    owners = [root, *m.findall(root, m.For() | m.While())]
    for owner in owners:
        body = getattr(owner, "body", None)
        tops = _flat(facts, list(getattr(body, "body", body) or []) if not isinstance(owner, cst.Module)
                     else list(owner.body))
        end = next((i for i, s in enumerate(tops) if s is stmt), None)
        if end is None:
            continue
        start = next((i for i, s in enumerate(tops[:end]) if s is loop.node or any(
            n is loop.node for n in m.findall(s, m.For() | m.While()))), None)
        between = [s for s in tops[start + 1:end] if not any(  # (not the ``with`` that holds ``stmt``)
            n is stmt for n in m.findall(s, m.SimpleStatementLine()))] if start is not None else []
        return start is not None and not any(isinstance(s, cst.Try) or m.findall(s, m.Return() | m.Raise())
                                             for s in between)
    return False


def _flat(facts: Any, block: list) -> list:
    """The statements of a block, each :func:`transparent` ``with``'s own after it (in order)."""
    out: list = []
    for stmt in block:
        out.append(stmt)
        if isinstance(stmt, cst.With) and transparent(facts, stmt) and isinstance(stmt.body, cst.IndentedBlock):
            out.extend(_flat(facts, list(stmt.body.body)))
    return out


def _every_rank(work: _Work, stmt: cst.SimpleStatementLine) -> bool:
    """A statement every rank runs as it is, where a collective may go: a return, an assignment, or a print
    (made ``ddpkit.print``, whose arguments every rank computes); not one a guard makes rank 0's (a save, a write in
    a ``with open`` block), nor one under a test of the rank."""
    small = stmt.body[0] if len(stmt.body) == 1 else None
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        name = resolve(dotted(small.value.func), work.facts.aliases) or ""
        if name.rsplit(".", 1)[-1] in GUARDED:  # (a write the converter makes rank 0's: a collective there hangs)
            return False
    elif not isinstance(small, (cst.Return, cst.Assign, cst.AugAssign, cst.AnnAssign)):
        return False
    holders = [n for n in m.findall(work.facts.module, m.With() | m.If()) if any(
        s is stmt for s in m.findall(n, m.SimpleStatementLine()))]
    return not any(isinstance(h, cst.With) and not transparent(work.facts, h) or isinstance(h, cst.If) and
                   RANK_TEST.search(work.facts.code(h.test).lower()) for h in holders)


# calls the converter guards (rank 0 alone runs them): a print, a log call, ``l.append(m)``, ``sched.step(m)`` are
# every rank's (review: ``logger.info(np.mean(l))`` was listed)
GUARDED = ("save", "savefig", "save_image", "imwrite", "imsave", "mimsave", "savetxt", "savez", "savez_compressed",
           "to_csv", "to_json", "to_parquet", "to_excel", "dump", "write", "writerow", "writerows", "savemat",
           "pprint", "pp", "copy", "copy2", "copyfile", "move", "rename", "replace", "write_wav")
RANK_TEST = re.compile(r"\b(rank|local_rank|global_rank|is_main\w*|is_master|master|main_process)\b")
# ``with`` blocks every rank runs as they are (not ``with open(...)``, which the converter guards)
EVERY_RANK_WITH = ("torch.no_grad", "torch.inference_mode", "torch.enable_grad", "torch.set_grad_enabled",
                   "torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast")


def transparent(facts: Any, node: cst.With) -> bool:
    """A ``with`` every rank runs as it is: ``with torch.no_grad():`` (review: a mean printed there stayed rank
    0's), not ``with open(...)``."""
    return all(isinstance(item.item, cst.Call) and resolve(dotted(item.item.func), facts.aliases) in EVERY_RANK_WITH
               for item in node.items)


def _list_mean_nodes(facts: Any, stmt: cst.CSTNode, lists: set[str]) -> list[cst.BaseExpression]:
    """The means of one of ``lists`` in ``stmt``: ``np.mean(l)``, ``sum(l) / len(l)``, ``torch.mean(torch.tensor(l))``
    (a DCGAN's ``torch.mean(torch.FloatTensor(D_losses))``), ``torch.stack(l).mean()`` (a VAE project's epoch
    loss); not one inside another."""
    found: list[cst.BaseExpression] = []
    for node in m.findall(stmt, m.Call() | m.BinaryOperation(operator=m.Divide())):
        if any(id(node) in {id(n) for n in m.findall(f, m.Call() | m.BinaryOperation())} for f in found):
            continue
        if isinstance(node, cst.BinaryOperation):
            parts = [(resolve(dotted(side.func), facts.aliases), dotted(side.args[0].value))
                     for side in (node.left, node.right) if isinstance(side, cst.Call) and len(side.args) == 1]
            if len(parts) == 2 and parts[0][0] == "sum" and parts[1][0] == "len" and parts[0][1] == parts[1][1] \
                    and parts[0][1] in lists:
                found.append(node)
            continue
        name = resolve(dotted(node.func), facts.aliases) if isinstance(node, cst.Call) else None
        held = node.func.value if isinstance(node, cst.Call) and not node.args and isinstance(
            node.func, cst.Attribute) and node.func.attr.value == "mean" else None  # (``torch.stack(l).mean()``)
        if isinstance(node, cst.Call) and isinstance(held, cst.Call) and len(held.args) == 1 and \
                dotted(held.args[0].value) in lists and resolve(dotted(held.func), facts.aliases) in TENSORS:
            found.append(node)
            continue
        if not isinstance(node, cst.Call) or len(node.args) != 1:
            continue
        inner = node.args[0].value
        if name in ("torch.mean", "numpy.mean") and isinstance(inner, cst.Call) and len(inner.args) == 1 and \
                resolve(dotted(inner.func), facts.aliases) in TENSORS:
            inner = inner.args[0].value
        if name in (*MEANS, "torch.mean") and dotted(inner) in lists:
            found.append(node)
    return found


TIGHT = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
TENSORS = ("torch.FloatTensor", "torch.tensor", "torch.Tensor", "numpy.array", "numpy.asarray", "torch.stack")


