"""The sums ``ddpkit convert`` reduces across ranks: what a loop over a sharded loader accumulates and the code
after it reads. Each rank sums only its shard, so the total is ``ddpkit.reduce(total)``, placed once, after
the outermost loop that runs after the sum was started (``total = 0`` before ``for aug in ...: for x in
loader: total += ...`` is reduced after the ``aug`` loop, not once per pass).

Evaluation: every sum and count read below the loop is reduced (``n += 1``, ``num_batches = len(loader)``,
``len(loader)`` beside a sum). When what is read below cannot be made global (a loop variable: ``total / (i +
1)``), the plan is None and the loader stays plain: every rank evaluates the whole set, right and slower.

Training: the steps are the same on every rank, so a count (``step += 1``) is never reduced. A sum is reduced
when what divides it counts every sample: the whole dataset's size (``train_loss / len(loader.dataset)``: 1/N of
the truth otherwise) or a sum of batch sizes (``correct / total`` of ``total += y.size(0)``: both summed). A mean
over this rank's batches (``epoch_loss / n_batches``, ``/ (i + 1)``) is averaged over the ranks: each took as many
batches. Any other sum (printed whole) is rank 0's, as printed.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("t = 0\\nfor x in ld:\\n    t += x\\nprint(t / len(ld.dataset))\\n"))
    >>> [(p.names, p.anchor.line) for p in sums_after(f, f.loops[0], training=False)]
    [(['t'], 2)]
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import sizes
from ddpkit.commands.convert.accumulates import collection, indexed, sample_counts
from ddpkit.commands.convert.batchmeans import (
    batch_mean,
    batch_size,
    loss_name,
    mean_criterion,
    step_count,
    step_kind,
    stepped_losses,
    summed_means,
)
from ddpkit.commands.convert.devicetext import PROGRESS
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import Facts, Loop
from ddpkit.commands.convert.summedloss import summed_value


class Reduction(NamedTuple):
    """Reduce ``names`` after ``anchor`` (summed, or averaged: ``averaged``), and wrap each ``len(loader)`` call of
    ``lens`` in ``ddpkit.reduce``."""
    anchor: Loop
    names: list[str]
    lens: list[Any]
    averaged: set[str]
    # of ``averaged``, sums of a loss summed over the batch over this rank's count of steps (mnist-vae's ``tr_loss /
    # tr_step``): with the global batch kept, each rank's batch is 1/N of one, so they add up (reductions.py)
    batch_sums: set[str]


def _anchor(facts: Facts, loop: Loop, name: str) -> Loop:
    """The loop after which ``name``'s sum is complete: going outward from ``loop``, each loop that began after
    ``name`` was last set before ``loop`` and does not set it again itself (``val_loss = 0.0`` at the end of
    an epoch's body restarts the sum each epoch: it is complete after the inner loop)."""
    sets = [b.line for b in facts.bindings if b.target == name and b.scope is loop.scope and b.value is not None]
    start = max([line for line in sets if line < loop.line], default=0)
    anchor = loop
    for outer in reversed(loop.outer):
        inside = [line for line in sets if outer.line <= line <= outer.end and not
                  anchor.line <= line <= anchor.end]
        if outer.line <= start or inside:
            break
        anchor = outer
    return anchor


def _local(facts: Facts, loop: Loop) -> set[str]:
    """What counts this rank's own batches: the loop's variables and what is computed from them below it
    (``n_batches = i + 1``)."""
    local = set(loop.targets)
    for b in sorted(facts.bindings, key=lambda b: b.line):
        if b.scope is loop.scope and b.line > loop.end and b.value is not None and names_in(b.value) & local:
            local.add(b.target)
    return local


def sums_after(facts: Facts, loop: Loop, training: bool, datasets: frozenset[str] = frozenset(),
               batches: frozenset[str] = frozenset(), shares: list[tuple[str, int]] | None = None,
               split: bool = True) -> list[Reduction] | None:
    """``batches``: the names of the loader's batch size when it is the global batch (``len(loader) * batch_size``
    is then every sample); ``shares`` gets each training sum left rank 0's and the line that first reads it;
    ``split``: each rank takes a share of the global batch (not a batch of its own, --per-process-batch).
    The :class:`Reduction` s to make; None: what follows the loop reads a local count this cannot reduce, or
    (evaluating) the loop may stop before its shard ends (``if i >= eval_iters: break``)."""
    if loop.breaks and not training:
        return None
    candidates = [n for n, _ in loop.augmented if "." not in n] + indexed(loop)
    named = loop.iter_names - built_from(loop)  # (``len(test)`` of ``DataLoader(test, ...)``: the dataset's size)
    # the loop's batches counted: ``num_batches = len(dataloader)``, ``n += 1`` (a mean over batches divides by one)
    lens = [b.target for b in facts.bindings if b.scope is loop.scope and isinstance(b.value, cst.Call)
            and dotted(b.value.func) == "len" and b.value.args and dotted(b.value.args[0].value) in named]
    if not training:
        candidates += [n for n in loop.counted if "." not in n] + lens
    counts = set(lens) | set(loop.counted)
    plans: dict[int, Reduction] = {}
    samples = sample_counts(loop) if training else set()
    loaders = set(loop.iter_names)
    for name in dict.fromkeys(candidates):
        if "[" not in name and collection(facts, loop, name):  # ``results += [(id, p) ...]``: rows kept, no sum
            if training:
                continue
            return None
        anchor = loop if "[" in name else _anchor(facts, loop, name)  # (``hist[epoch]``: a new one each pass)
        readers: list[Any] = [s for s, sc, line in facts.statements if sc is loop.scope and line > anchor.end
                              and name in _reads(s)]
        if not readers and any(n == name and sc is loop.scope and line > anchor.end for n, sc, line, _ in facts.reads):
            readers = [None]  # read in an if / while test below
        if not readers and not training and any(n == name and sc is loop.scope and line > loop.end
                                                for n, sc, line, _ in facts.reads):
            return None  # read below the loop, but not below where it is complete
        if not readers or _reduced(facts, loop, anchor, name):
            continue
        local = _local(facts, loop) | ({n for n in loop.counted} if training else set())
        if training:
            kind = _training_sum(facts, loop, anchor, name, readers, local, samples,
                                 lambda d: sizes.dataset_size(facts, d, loop.scope, set(datasets), loaders, batches)
                                 or bool(sizes.sampler_lens(d, loaders)), split)
            if kind is None and shares is not None:  # rank 0's, as read: said where ``shares`` asks
                # (read before the name is bound anew: ``data_ptr = 0`` after the loop starts another count)
                anew = min((b.line for b in facts.bindings if b.target == name and b.scope is loop.scope and
                            b.line > anchor.end and b.value is not None and name not in names_in(b.value)),
                           default=1 << 30)
                lines = [line for st, _, line in facts.statements if any(st is r for r in readers) and line < anew]
                if lines or None in readers:
                    shares.append((name, min(lines, default=anchor.end)))
            if kind in (None, "later"):
                continue
            if kind == "mean":
                entry = plans.setdefault(id(anchor), Reduction(anchor, [], [], set(), set()))
                entry.averaged.add(name)
                if _summed_adds(facts, loop, name):
                    entry.batch_sums.add(name)
        elif any(s is not None and names_in(s) & local for s in readers):
            return None  # ``total / (i + 1)``: i counts this rank's batches only
        elif summed_means(facts, loop, name) and not any(
                c.name == "len" and c.stmt in readers and c.node.args and dotted(c.node.args[0].value) in named
                for c in facts.calls) and not any(s is not None and names_in(s) & counts for s in readers):
            return None  # LeNet-5's ``avg_loss += criterion(out, y).sum()`` over ``len(test_set)``: batch means
        entry = plans.setdefault(id(anchor), Reduction(anchor, [], [], set(), set()))
        entry.names.append(name)
        if name in entry.averaged:
            continue
        # (``len(loader) * batch_size`` with the global batch is every sample already)
        counted = {id(n) for s in readers if s is not None for p in sizes.global_products(s, loaders, batches)
                   for n in (p.left, p.right)}
        # (in training every rank takes as many batches: ``len(loader)`` stays, whatever it divides; review: a loss
        # over ``len(loader)`` beside a summed ``correct / total`` was divided by N)
        entry.lens.extend(c.node for c in facts.calls if id(c.node) not in counted and c.name == "len"
                          and c.stmt in readers and c.node.args and c.node not in entry.lens
                          and (dotted(c.node.args[0].value) in named and not training or
                               c.node in sizes.sampler_lens(c.node, loaders)))
    if training:
        kept = _paired(facts, loop, {n for e in plans.values() for n in e.names}, samples)
        for entry in plans.values():
            entry.names[:] = [n for n in entry.names if n in kept]
            entry.averaged.intersection_update(kept)
    return [entry for entry in plans.values() if entry.names]


def built_from(loop: Loop) -> set[str]:
    """The names a loader built in the loop's own header is made from (``test``, ``bs`` of ``for x in
    DataLoader(test, batch_size=bs)``): a dataset and settings, no loader.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> loop = scan(parse("for x, y in enumerate(DataLoader(test, batch_size=bs)):\\n    pass\\n")).loops[0]
    >>> sorted(built_from(loop))
    ['bs', 'test']
    """
    found: set[str] = set()
    for call in m.findall(getattr(loop.node, "iter", cst.Name("_")), m.Call()):
        assert isinstance(call, cst.Call)
        if (dotted(call.func) or "").rsplit(".", 1)[-1] in ("DataLoader", "data_loader"):
            found |= {n for a in call.args for n in names_in(a.value)}
    return found


def _paired(facts: Facts, loop: Loop, reduced: set[str], samples: set[str]) -> set[str]:
    """``reduced`` less the training sums whose ratio would mix a global and a local part: a count of samples
    (``total``) is kept only where every sum of this function divided by it below the loop is reduced too, and
    a sum divided by a count that is not, goes (``return correct, total``: neither; ``correct / total`` where a
    later loop adds to ``total`` alone: neither)."""
    sums = {n for other in facts.loops if other.scope is loop.scope
            for n in [*(a for a, _ in other.augmented), *indexed(other)]}
    over: dict[str, set[str]] = {n: set() for n in samples}  # a count -> the names divided by it
    # (up to where the count is bound again: dgcnn's ``count = 0.0`` before its test loop starts another count)
    until = {n: min((b.line for b in facts.bindings if b.target == n and b.scope is loop.scope and b.line > loop.end
                     and not (b.value is not None and n in names_in(b.value))),  # (not ``count = max(count, 1)``)
                    default=1 << 30) for n in samples}
    for stmt, scope, line in facts.statements:
        if scope is loop.scope and line > loop.end:
            for left, right in _divisions(stmt):
                for n in names_in(right) & samples:
                    over[n] |= left & sums if line < until[n] else set()
    kept = set(reduced)
    # ("samples seen", total); not in a loop that trains or evaluates by a flag (its backward under an ``if`` of a
    # parameter: an evaluation call over a whole loader would count N times; ``if use_amp:`` / ``else:`` steps both)
    flags = {p for p in loop.scope.params if p != "self"}
    steps = any(c.last == "backward" and not any(set(re.findall(r"\w+", t)) & flags for t in c.tests)
                for c in loop.calls)
    shown = {n for n in samples if steps and not over[n] and _only_printed(facts, loop, n)}
    while True:
        dropped = {n for n in kept & samples - shown if not over[n] & kept or over[n] - kept}
        dropped |= {name for n in (samples - kept) | dropped for name in over[n] & kept}
        if not dropped & kept:
            return kept
        kept -= dropped


def _only_printed(facts: Facts, loop: Loop, name: str) -> bool:
    """Every statement below the loop that reads ``name`` prints it (no ratio or return made of it elsewhere)."""
    readers = [s for s, sc, line in facts.statements if sc is loop.scope and line > loop.end and name in _reads(s)]
    return bool(readers) and all(len(s.body) == 1 and isinstance(s.body[0], cst.Expr) and
                                 isinstance(s.body[0].value, cst.Call) and
                                 dotted(s.body[0].value.func) in ("print", "ddpkit.print") for s in readers)


def _training_sum(facts: Facts, loop: Loop, anchor: Loop, name: str, readers: list[Any], local: set[str],
                  samples: set[str], whole: Any, split: bool = True) -> str | None:
    """How a training loop's sum read after it is made every rank's: "sum" where what divides it counts every
    sample (``whole``: the dataset's size; or a sum of batch sizes, ``correct / total``), "mean" where it is
    divided by this rank's count of batches alone (``loss / (i + 1)``, ``/ n_batches``: every rank took as many),
    "later" where a later loop adds to it (reduced after that one), and None (rank 0's, as read) otherwise:
    divided by anything else (``(i + 1) * batch_size``), or started outside this function (a running total kept
    across calls: reduced again at each)."""
    started = any(b.target == name.split("[")[0] and b.scope is loop.scope and b.value is not None and
                  b.line < loop.line for b in facts.bindings)
    # (nor a count a later loop adds to; one bound again before it, dgcnn's ``count = 0.0`` for its test loop, is
    # that loop's own)
    later = {n for other in facts.loops if other.scope is loop.scope and other.line > anchor.end
             for n in [*(a for a, _ in other.augmented), *indexed(other)]
             if not any(b.target == n and b.scope is loop.scope and anchor.end < b.line < other.line and
                        not (b.value is not None and n in names_in(b.value)) for b in facts.bindings)}
    if not started or name in later:
        return "later" if started else None  # (a later loop's sum: reduced after it, not said here)
    divisors = [d for s in readers if s is not None for d in _divisors(s, name)]
    if split and over_own_batch(facts, loop, name):  # (each term N times one process's: said, never averaged)
        return None
    if not divisors and batch_mean(facts, loop, name):  # (returned or printed whole: averaged, or summed with a
        return "sum"  # per-process batch, by :func:`~ddpkit.commands.convert.reductions.reductions`)
    if divisors and all(names_in(d) and names_in(d) <= local for d in divisors):
        return "mean"  # (over this rank's count of steps: averaged; a summed loss's, Reduction.batch_sums)
    if divisors and all(_batches(facts, loop, d) for d in divisors):
        # (``/ len(loader)``: a mean of batch means is averaged; a sum of batch sums, ``correct += (...).sum()``, is
        # per batch of the global batch: summed; anything else rank 0's)
        return "mean" if batch_mean(facts, loop, name) else _per_batch(facts, loop, name)
    if divisors and all(step_count(facts, loop, d) for d in divisors) and batch_mean(facts, loop, name):
        # (``total / train_steps`` of ``train_steps = len(ds) // batch_size``: the data's count of steps; summed
        # here, the reduction then averages it with the global batch, each rank taking as many steps, and adds
        # the ranks' up with a per-process batch, each taking 1/N of them)
        return "sum"
    if any(names_in(d) & local for d in divisors):
        return None
    return "sum" if name in samples or any(whole(d) or names_in(d) & (samples - later) for d in divisors) else None


def over_own_batch(facts: Facts, loop: Loop, name: str) -> bool:
    """Some ``name += value`` of the loop divides a batch's mean by the batch's own size (generative-models'
    ``total += loss.item() / batch_size`` of ``batch_size = x.size(0)``): with the global batch kept, a rank's
    batch is B/N, so each term is N times one process's, and no reduction of the sums gives one process's."""
    for node in m.findall(loop.node, m.AugAssign(operator=m.AddAssign())):
        value = node.value if isinstance(node, cst.AugAssign) and _CODE.code_for_node(node.target) == name else None
        if not isinstance(node, cst.AugAssign) or not isinstance(value, cst.BinaryOperation) or \
                not isinstance(value.operator, cst.Divide):
            continue
        right, line = value.right, _line_of(facts, loop, node)
        held = [b.value for b in facts.bindings if b.target == dotted(right) and b.scope is loop.scope and
                loop.line < b.line <= line]
        loss = loss_name(value.left)  # (a mean criterion's: a summed loss over its batch is a per-sample mean)
        if (batch_size(right) or held and batch_size(held[-1])) and loss in stepped_losses(loop) and loss and \
                mean_criterion(facts, loop, loss):
            return True
    return False


def _per_batch(facts: Facts, loop: Loop, name: str) -> str | None:
    """What each ``name += value`` of the loop adds: "mean" for a batch's mean (``(...).float().mean().item()``,
    ``acc.item()`` of ``acc = accuracy(out, y)``), "sum" for a batch's sum or size (``(...).sum().item()``,
    ``y.size(0)``, ``len(y)``); None when they differ or cannot be told."""
    kinds = {step_kind(facts, loop.scope, node.value, _line_of(facts, loop, node))
             for node in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
             if isinstance(node, cst.AugAssign) and _CODE.code_for_node(node.target) == name}
    return kinds.pop() if len(kinds) == 1 else None


def _summed_adds(facts: Facts, loop: Loop, name: str) -> bool:
    """Each ``name += value`` of the loop adds a loss summed over the batch (:func:`.batchmeans.summed_value`)."""
    adds = [node for node in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
            if isinstance(node, cst.AugAssign) and _CODE.code_for_node(node.target) == name]
    return bool(adds) and all(summed_value(facts, loop.scope, node.value, _line_of(facts, loop, node)) for node in adds)


def _line_of(facts: Facts, loop: Loop, node: cst.AugAssign) -> int:
    """The line of ``node``, a statement of the loop (its bindings above it are what it reads)."""
    return next((line for stmt, scope, line in facts.statements if scope is loop.scope and node in stmt.body),
                loop.end)


def _batches(facts: Facts, loop: Loop, divisor: Any) -> bool:
    """``len(train_loader)``, or a name bound to it before the loop (powerful-gnns' ``total_iters``): this rank's
    count of batches, as many on every rank in training."""
    name = dotted(divisor)
    if name is not None:
        bound = [b.value for b in facts.bindings if b.target == name and b.scope is loop.scope and b.line < loop.line]
        divisor = bound[-1] if len(bound) == 1 else None
    return isinstance(divisor, cst.Call) and dotted(divisor.func) == "len" and len(divisor.args) == 1 and \
        dotted(divisor.args[0].value) in loop.iter_names | _wrapped(facts, loop)


def _wrapped(facts: Facts, loop: Loop) -> set[str]:
    """What the loop's iterable wraps: ``train_loader`` of ``pbar = tqdm(train_loader)`` (powerful-gnns)."""
    found = set()
    for b in facts.bindings:
        if b.target in loop.iter_names and b.scope is loop.scope and b.line < loop.line and \
                isinstance(b.value, cst.Call) and b.value.args and b.value.args[0].keyword is None and \
                (resolve(dotted(b.value.func), facts.aliases) or "") in PROGRESS:  # (not ``DataLoader(ds)``)
            found.add(dotted(b.value.args[0].value) or "")
    return found - {""}


def _divisions(stmt: Any) -> list[tuple[set[str], Any]]:
    """Each division in ``stmt``: the names its left side reads, and its right side (``100. * correct / total``:
    ``({'correct'}, total)``; ``acc /= len(ds)``: ``({'acc'}, len(ds))``)."""
    smalls = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt]
    return [(_reads(small.target), small.value) for small in smalls if isinstance(small, cst.AugAssign)
            and isinstance(small.operator, (cst.DivideAssign, cst.FloorDivideAssign))] + \
        [(_reads(d.left), d.right) for d in m.findall(stmt, m.BinaryOperation(operator=m.Divide() | m.FloorDivide()))
         if isinstance(d, cst.BinaryOperation)]


def _reads(node: Any) -> set[str]:
    """The names ``node`` reads, and the ``name[index]`` items (:func:`indexed`) as their code."""
    items = {_CODE.code_for_node(s) for s in m.findall(node, m.Subscript(value=m.Name()))
             if isinstance(s, cst.Subscript) and len(s.slice) == 1 and isinstance(s.slice[0].slice, cst.Index)}
    return names_in(node) | items


_CODE = cst.Module(body=[])


def _divisors(stmt: Any, name: str) -> list[Any]:
    """What divides ``name`` in ``stmt``: the right side of each division whose left side reads it."""
    return [right for left, right in _divisions(stmt) if name in left]


def _reduced(facts: Facts, loop: Loop, anchor: Loop, name: str) -> bool:
    """Converted already: a ``ddpkit.reduce`` / ``gather`` of ``name`` below the loop."""
    return any(c.scope is loop.scope and c.line > anchor.end and c.name in ("ddpkit.reduce", "ddpkit.gather")
               and name in _reads(c.node) for c in facts.calls)
