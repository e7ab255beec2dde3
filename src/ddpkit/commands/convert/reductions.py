"""The sums a loader's loops keep, reduced across ranks: what an evaluation (or a training loop that reports)
accumulates over its shard and the code below reads becomes every rank's with ``ddpkit.reduce`` after the loop
(:mod:`ddpkit.commands.convert.sums` finds them); an evaluation loop runs under ``torch.no_grad()``; a loop that
keeps what cannot be summed leaves its loader whole, said.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\n"
    ...          "test_loader = DataLoader(ds, batch_size=8)\\nright = 0\\nwith torch.no_grad():\\n"
    ...          "    for x, y in test_loader:\\n        right += (m(x).argmax(1) == y).sum().item()\\nprint(right)\\n")
    >>> [e.what for e in p.edits if "reduce" in e.what]
    ['after the evaluation loop: right summed across ranks (ddpkit.reduce)']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow, shownsums
from ddpkit.commands.convert.accumulates import batch_wide, collection, indexed
from ddpkit.commands.convert.batchmeans import batch_mean, summed_means
from ddpkit.commands.convert.curves import curves
from ddpkit.commands.convert.listmeans import list_means
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Call, Loop
from ddpkit.commands.convert.sums import sums_after

_Work = Any  # the plan in the making (plan._Work)

# an evaluation loop calling these needs gradients: it cannot run under no_grad, so it is not sharded
NEEDS_GRAD = ("grad", "requires_grad_", "enable_grad", "set_grad_enabled", "backward", "vjp", "jacobian")


def reductions(work: _Work, loops: list[Loop], call: Call | None, training: bool,
               batches: frozenset[str] = frozenset(), when: tuple[str, str] | None = None) -> bool:
    """Sum across ranks what the loops over a loader accumulate and the code below reads
    (:mod:`ddpkit.commands.convert.sums`); an evaluation loop also runs under ``torch.no_grad()`` (a DDP
    forward with gradients on is collective, and the ranks' shards differ in length: the longer one would
    wait forever). False, before any edit: an evaluation loader is then left as it is (every rank evaluates
    the whole set, which is right, only slower), when a loop keeps results this cannot sum."""
    fors = [loop for loop in loops if isinstance(loop.node, cst.For)]
    drawn = [loop for loop in loops if not isinstance(loop.node, cst.For) and not flow.trains(work.facts, loop)]
    if drawn and call is not None and not training:  # DANN's ``while i < len(loader): x = next(it)``: sums unread
        work.plain.add(id(call.node))
        work.keep(drawn[0].line, f"the evaluation draws from the DataLoader at line {call.line} with next() in a while "
                  "loop, whose sums convert does not follow: the loader is left as it is", "each rank evaluates the "
                  "whole set, which is right (to share the work: a for loop over ddpkit.data_loader(..., train=False), "
                  "then ddpkit.reduce(...) the sums)")
        return False
    # (None: a loader built in another module of the project, whose training loops here keep sums)
    datasets = frozenset(filter(None, [dotted(call.node.args[0].value)])) if call and call.node.args else frozenset()
    datasets |= _subset(work, call) if call is not None else frozenset()
    plans = []
    evaluations = [loop for loop in fors if not (training and flow.trains(work.facts, loop))]
    for loop in fors:
        summed_as_training = loop not in evaluations  # a training loader's evaluation (check_accuracy) sums
        if summed_as_training:
            list_means(work, loop, curves(work, loop))
            _scored(work, loop)
            filled = _filled_by_callee(work, loop)
            if filled is not None:  # dlwpt's ``trnMetrics_g`` (a slot per sample): half of them never filled
                work.leave(filled[1], f"the training loop keeps per-sample results in {filled[0]}: sharded, each "
                           "rank fills the slots of its own batches only, and what it reports from the rest is what "
                           "they were made with (zeros)", "ddpkit.gather(...) each batch's results and fill the "
                           "slots from them on every rank, or report a sum ddpkit.reduce(...) makes every rank's")
        items = indexed(loop)  # ``hist[epoch] += ...``: a sum, one item per epoch, not rows kept
        # (the results, not a timer: MixMatch's ``data_time.update(...)`` comes before ``losses.update(...)``)
        kept_rows = sorted((s for s in loop.stored if s[0] not in items), key=lambda s: "time" in s[0].lower())
        stored = next(iter(kept_rows), None) if not summed_as_training else None
        if stored is None and not summed_as_training:  # dlwpt's ``computeBatchLoss(..., metrics_g)``: slots filled
            stored = _filled_by_callee(work, loop, counts=True)
        if stored is None and not summed_as_training:  # ``results += [(id, p) ...]``: rows kept in a list
            stored = next(((n, line) for n, line in loop.augmented if collection(work.facts, loop, n)), None)
        if stored is None and not summed_as_training and _returns_inside(loop):  # (``return model(x).argmax(1)``)
            stored = ("what it returns from inside the loop", loop.line)
        if stored is None and not summed_as_training:  # cVAE's ``if i == 0: save_image(comparison, ...)``
            stored = next(((f"an image of a batch, {c.last}()", c.line) for c in loop.calls
                           if c.last in BATCH_IMAGES), None)
        if stored is None and not summed_as_training:  # a figure drawn from each batch (``plt.scatter(out[:, 0],
            stored = next(((f"a figure of its batches, {c.last}()", c.line) for c in loop.calls  # ...)``)
                           if _drawn(work, c)), None)
        if stored is None and not summed_as_training:  # kuangliu's test bar, the loop's only output (set 26)
            stored = shownsums.shown_only(work, loop)
        needs = next((c.last for c in loop.calls if c.last in NEEDS_GRAD and not _grad_off(c)), None)
        if not summed_as_training and not loop.no_grad and stored is None and needs:
            stored = (f"{needs}() results (it needs gradients, so it cannot run under no_grad)", loop.line)
        # a batch that is one unit (a trial); a batch of one sample is a unit whichever rank takes it
        wide = None if summed_as_training or call is None or _one_sample(call) else batch_wide(work.facts, loop)
        shares: list[tuple[str, int]] = []
        shared = not (work.per_process_batch or call is not None and id(call.node) in work.per_process)
        plan = sums_after(work.facts, loop, summed_as_training, datasets, batches, shares, shared) \
            if stored is None and wide is None else None
        if plan is None and not summed_as_training:
            assert call is not None  # (without a call, only training loops are handed in)
            line = stored[1] if stored else wide[1] if wide else loop.line
            meant = next((n for n, _ in loop.augmented if summed_means(work.facts, loop, n)), None)
            why = f"keeps per-batch results in {stored[0]}" if stored else f"takes {wide[0]} over each whole " \
                "batch (a batch is one unit, such as an N-way trial; sharded sample by sample, a rank's batch " \
                "would mix units)" if wide else "may stop before its shard ends (a break)" if loop.breaks else \
                f"adds up the loss's batch means in {meant} (each rank's batches are its shard's: neither the " \
                "ranks' sum nor their mean is one process's)" if meant else \
                "divides by a count of its own batches (its loop variable)"
            if training:  # the loader must be sharded to train: its evaluation would then be rank 0's shard only
                work.leave(line, f"the evaluation loop over the training DataLoader at line {call.line} {why}: "
                           "sharded for training, each rank would evaluate only its shard", "evaluate on a "
                           "DataLoader of its own (DataLoader(dataset, batch_size): convert keeps it whole, every "
                           "rank evaluating the whole set), or ddpkit.gather(...) the results there, then convert "
                           "again", blocks=True)
                return False
            work.plain.add(id(call.node))  # (right as it is, only slower: kept, said, not left to the user)
            work.keep(line, f"the evaluation loop {why}: sharded, the result would be this rank's only, so the "
                      f"DataLoader at line {call.line} is left as it is", "each rank evaluates the whole set, which "
                      "is right (to share the work: ddpkit.data_loader(..., train=False), then ddpkit.gather(...) the "
                      "results or ddpkit.reduce(...) the sums and counts, docs/convert.md)")
            return False
        plans += [(summed_as_training, p) for p in plan or []]
        if not summed_as_training and call is not None:
            shownsums.last_shown(work, loop, {n for p in plan or [] for n in p[1]})
        if summed_as_training:  # (PyHessian's bar: ``set_postfix(loss=train_loss / total)``; a step sum shown and
            # reset each k steps beside an epoch sum reduced after the loop: tuguldurio's ``running_loss / k``)
            reduced = {n for p in plan or [] for n in p[1]}
            # (not a sum of an evaluation nested in it, over a loader of its own: ZZy979's ``correct`` of the test
            # loop run every N steps, which every rank reads whole)
            nested = [lp for lp in work.facts.loops if loop in lp.outer and isinstance(lp.node, cst.For) and
                      not flow.trains(work.facts, lp) and lp.iter_names and not lp.iter_names <= {"range"}]
            own = [n for n, line in loop.augmented if n not in reduced and
                   not any(lp.line <= line <= lp.end for lp in nested)]
            shownsums.running_shown(work, loop, own, after=False)
        if summed_as_training:
            shownsums.count_shown(work, loop)
            shownsums.shares(work, loop, shares)
    pickers = [lp for lp in work.facts.loops if when is not None and lp.targets == {when[0]}]
    for summed_as_training, (anchor, names, lens, averaged, batch_sums) in plans:
        split = when if any(p is o for p in pickers for o in anchor.outer) else None  # (one split's sum: its test)
        if any(p is anchor or any(anchor is o for o in p.outer) for p in pickers):  # begun outside the splits' loop
            work.leave(anchor.line, f"{', '.join(names)} summed over every split (begun outside the loop over "
                       "them): the trained split's part is this rank's shard, the others' whole, and no one "
                       "reduction makes it every rank's", "sum each split apart (begin the sum inside the loop over "
                       "the splits), then convert again", blocks=True)
            return False
        after = work.edits.after.setdefault(id(anchor.node), [])
        # a sum of the loss's batch means (``train_loss += loss.item()``), not divided by the number of batches:
        # with the global batch kept, each rank took as many steps as one process did, so the ranks' sums are
        # averaged (summed, N times one process's); a per-process batch splits the steps: summed
        kept = work.per_process_batch or call is not None and id(call.node) in work.per_process
        # (a batch kept per process splits the steps: a sum of batch means over no count, or over the data's count
        # of steps, adds up across ranks; one over a rank's own count, ``len(loader)``, is still averaged)
        means = averaged | {n for n in names if summed_as_training and not lens and batch_mean(work.facts, anchor, n)
                            and not (kept and batch_mean(work.facts, anchor, n, counted=True))}
        means -= set() if kept else batch_sums  # (a summed loss over this rank's steps: 1/N of the batch, added up)
        test = f" if {split[1]} else " if split is not None else ""  # (a split's sums: its own shard's only)
        new = [f"{n} = ddpkit.reduce({n}{', op=' + repr('mean') if n in means else ''})"
               f"{test + n if test else ''}" for n in names
               if not any(line.startswith(f"{n} = ddpkit.reduce({n}") for line in after)]
        if not new:  # one evaluation function called with two loaders (check_accuracy): reduced once
            continue
        after.extend(new)
        shownsums.running_shown(work, anchor, names)
        if not summed_as_training:
            work.reduced.extend(evaluations)
        summed = [n for n in names if n not in means]
        if summed:
            # (a summed loss's batch sums over this rank's count of steps, a VAE's: its batch is 1/N of one)
            why = "each rank accumulated only its own shard" + (" of that split; the others are whole" if split
                                                                 else "")
            if set(summed) <= averaged & batch_sums:
                why = "each step's loss is a sum over this rank's 1/N of the global batch: the ranks' add up to it"
            work.note(f"after the {'training' if summed_as_training else 'evaluation'} loop: {', '.join(summed)} "
                      f"summed across ranks (ddpkit.reduce{', if ' + split[1] if split else ''})", why, anchor.end)
        if means - averaged:
            work.note(f"after the training loop: {', '.join(sorted(means - averaged))} averaged across ranks "
                      "(ddpkit.reduce, op='mean')", "a sum of the loss's batch means: each rank took as many steps as "
                      "one process, each over its part of the global batch", anchor.end)
        if averaged & means:
            work.note(f"after the training loop: {', '.join(sorted(averaged & means))} averaged across ranks "
                      "(ddpkit.reduce, "
                      "op='mean')", "divided by this rank's count of batches: every rank took as many, so the mean "
                      "of the ranks' means is the mean over every batch", anchor.end)
        for node in lens:  # ``total / len(loader)``: every rank's batches, as the sum is every rank's
            work.edits.expr[id(node)] = lambda n, split=split: cst.parse_expression(
                f"ddpkit.reduce({work.facts.module.code_for_node(n)})" if split is None else
                f"(ddpkit.reduce({work.facts.module.code_for_node(n)}) if {split[1]} else "
                f"{work.facts.module.code_for_node(n)})")
            sampler = (dotted(node.args[0].value) or "").endswith(".sampler")
            work.note(f"len(loader{'.sampler' * sampler}) -> ddpkit.reduce(len(loader{'.sampler' * sampler}))",
                      f"every rank's {'samples' if sampler else 'batches'}, as the sum divided by it is every rank's",
                      anchor.end)
    for loop in evaluations:
        if not loop.no_grad and id(loop.node) not in work.edits.no_grad:
            work.edits.no_grad.add(id(loop.node))
            work.note("the evaluation loop runs under torch.no_grad()", "a DDP forward with "
                      "gradients on is collective, and the ranks' evaluation shards differ in length",
                      loop.line)
    return True


def _one_sample(call: Call) -> bool:
    """``DataLoader(ds)`` / ``DataLoader(ds, batch_size=1)``: batches of one sample."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    size = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "batch_size"),
                positional[1].value if len(positional) > 1 else None)
    return size is None and not any(a.star == "**" for a in call.node.args) or \
        isinstance(size, cst.Integer) and size.value == "1"


def _grad_off(call: Call) -> bool:
    """``torch.set_grad_enabled(False)``: gradients off, as under ``no_grad``."""
    first = call.node.args[0].value if call.node.args else None
    return call.last == "set_grad_enabled" and isinstance(first, cst.Name) and first.value == "False"


def _returns_inside(loop: Loop) -> bool:
    """The loop hands back a value from inside (a predict helper's ``for x, _ in loader: return
    model(x).argmax(1)`` over one batch of the whole set): sharded, that would be this rank's part."""
    return any(isinstance(r, cst.Return) and r.value is not None and dotted(r.value) != "None"
               for r in m.findall(loop.node.body, m.Return()))


def _subset(work: _Work, call: Call) -> frozenset[str]:
    """The indices a ``SubsetRandomSampler(train_idx)`` given as the loader's ``sampler=`` draws from (directly or
    through a name): ``len(train_idx)`` is then the loader's whole set (the U-Net zoo's ``train_loss /
    len(train_idx)``)."""
    given = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "sampler"), None)
    name = dotted(given) if given is not None else None
    if name is not None:
        bound = flow.binding_of(work.facts, name, call.scope, call.line)
        given = bound.value if bound is not None else None
    if isinstance(given, cst.Call) and (dotted(given.func) or "").endswith("SubsetRandomSampler") and given.args:
        indices = dotted(given.args[0].value)
        return frozenset([indices]) if indices else frozenset()
    return frozenset()


def _scored(work: _Work, loop: Loop) -> None:
    """A metric of scikit-learn over lists the training loop fills each step, after it (x-vector's
    ``accuracy_score(full_gts, full_preds)``): each rank's lists hold its shard's samples only, so the score printed
    is rank 0's part; said, with the fix."""
    kept = {name for name, _ in loop.stored if name.isidentifier()}
    for call in work.facts.calls:
        name = resolve(dotted(call.node.func), work.facts.aliases) or ""
        if call.scope is loop.scope and call.line > loop.end and name.startswith("sklearn.metrics.") and \
                {dotted(a.value) for a in call.node.args} & kept:
            work.leave(call.line, f"{call.last}(...) after the training loop scores lists it fills each step: each "
                       "rank's hold its shard's samples only, so this is rank 0's part", "gather them first: "
                       "ddpkit.gather(torch.tensor(lst)) on every rank (a tensor per list), then score the gathered "
                       "lists")
            return


BATCH_IMAGES = ("save_image", "imwrite", "imsave", "savefig", "add_image", "add_images")
FIGURES = ("scatter", "imshow", "plot", "hist", "bar", "contour", "contourf", "pcolormesh")


def _drawn(work: _Work, call: Call) -> bool:
    """``call`` draws into a matplotlib figure: a pyplot function, or a plotting method of an axes pyplot made
    (``ax.scatter(...)`` of ``fig, ax = plt.subplots()``)."""
    name = resolve(call.name or "", work.facts.aliases) or ""
    if name.startswith("matplotlib."):
        return call.last in FIGURES
    # (an axes matplotlib made, ``fig, ax = plt.subplots()``: not a tensor's ``x.scatter(dim, index, src)``)
    owner = call.node.func.value if isinstance(call.node.func, cst.Attribute) else None
    head = work.facts.code(owner).split("[")[0].split(".")[0] if owner is not None else ""
    held = flow.binding_of(work.facts, head, call.scope, call.line) if head else None
    made = (held.whole or held.value) if held is not None else None
    return call.last in FIGURES and isinstance(made, cst.Call) and \
        (resolve(dotted(made.func), work.facts.aliases) or "").startswith("matplotlib.")
def _filled_by_callee(work: _Work, loop: Loop, counts: bool = False) -> tuple[str, int] | None:
    """A container the loop hands to a function of the script that writes into it by index (dlwpt's
    ``computeBatchLoss(batch_ndx, batch_tup, batch_size, metrics_g)`` setting ``metrics_g[0, start:end] = ...``):
    per-sample results kept, as ``metrics[i] = ...`` in the loop itself would be. ``counts`` (an evaluation): also
    a dict of sums made above the loop that the function adds to (``update_metrics(val_metrics, out, y)``'s
    ``metrics['total_correct'] += ...``, set 26: sharded, the printed accuracy was rank 0's half)."""
    for call in loop.calls:
        target = flow.callee(work.facts, call)
        if target is None:
            continue
        scope, skip = target
        written = {dotted(a.target.value) for a in m.findall(scope.node, m.AssignTarget(target=m.Subscript()))
                   if isinstance(a, cst.AssignTarget) and isinstance(a.target, cst.Subscript)}
        added = {dotted(a.target.value) for a in m.findall(scope.node, m.AugAssign(target=m.Subscript()))
                 if isinstance(a, cst.AugAssign) and isinstance(a.target, cst.Subscript)} if counts else set()
        for param in sorted(p for p in (written | added) & set(scope.params) if p):
            passed = flow.argument_for(call, param, scope, skip)
            name = dotted(passed) if passed is not None else None
            made = flow.binding_of(work.facts, name, loop.scope, loop.line) if name else None
            # (a tensor or array made before the loop to hold results: not a dict of settings, nor the batch)
            if made is not None and made.line < loop.line and isinstance(made.value, cst.Call) and \
                    (resolve(dotted(made.value.func), work.facts.aliases) or "") in CONTAINERS:
                return f"{name} (filled by {scope.name}())", call.line
            if made is not None and made.line < loop.line and param in added and _a_dict(work, made.value):
                return f"{name} (added to by {scope.name}())", call.line
    return None


def _a_dict(work: _Work, value: cst.BaseExpression | None) -> bool:
    """``{...}``, ``dict(...)``, or a call of a function of the script that returns a dict literal
    (``reset_metrics()``)."""
    if isinstance(value, cst.Dict) or isinstance(value, cst.Call) and dotted(value.func) == "dict":
        return True
    made = flow.callee(work.facts, next(c for c in work.facts.calls if c.node is value)) \
        if isinstance(value, cst.Call) and any(c.node is value for c in work.facts.calls) else None
    return made is not None and bool(m.findall(made[0].node, m.Return(value=m.Dict())))


CONTAINERS = tuple(f"{lib}.{f}" for lib in ("torch", "numpy") for f in ("zeros", "empty", "full", "ones"))
