"""A training loss that is a mean over the tokens it does not ignore (``cross_entropy(..., ignore_index=-100)``,
labels padded with ``-100``, a Hugging Face model called with ``labels=``): at N processes each rank's mean is
over its own tokens and DDP weighs the ranks alike, another loss than one process's mean over the step's tokens.

Where the labels the loss reads are a part of the training loader's batch that the loop names (``for i,
(input_ids, labels) in enumerate(loader)``, ``batch["labels"]``, ``model(**batch)``), the loader is told what to
count: ``batch_count=lambda batch: (batch[1] != -100).sum()`` (:mod:`ddpkit.data.weighted`), and the loop stays
as it is. Otherwise (the loss inside the model's module, an ``ignore_index`` read from a setting) it is listed,
with that fix.

Example (the part of the batch a loop names)::

    >>> loop = cst.parse_statement("for i, (ids, labels) in enumerate(loader):\\n    pass\\n")
    >>> _part(loop, "labels"), _part(loop, "ids"), _part(loop, "i")
    ('batch[1]', 'batch[0]', None)
"""

from __future__ import annotations

import re
from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.scan import Call, Loop, dotted

# the plan in the making (plan._Work): facts, edits, note, leave, sharded
_Work = Any
TOKEN_LOSSES = ("cross_entropy", "CrossEntropyLoss", "nll_loss", "NLLLoss")
# what a loop does to its labels before the loss, keeping which tokens they are
_KEEPS = ("view", "reshape", "flatten", "to", "cuda", "long", "contiguous", "squeeze")
_WRAPS = ("enumerate", "tqdm", "progress", "ddpkit.progress")


def token_mean_loss(work: _Work) -> None:
    """The first token-mean loss of a training loop: its loader told what to count, or the line listed."""
    if any(a.keyword is not None and a.keyword.value in ("count", "batch_count") for c in work.facts.calls
           if c.name == "ddpkit.data_loader" for a in c.node.args):
        return
    padded = re.search(r"-100\b(?!\s*:)", work.facts.module.code) is not None  # (not ``losses[-100:]``)
    for call in work.facts.calls:
        keywords = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
        ignored = keywords.get("ignore_index")
        # an ignore_index read from a setting (a pad id) pads; a literal one (minGPT's -1) may mark nothing
        named = ignored is not None and not isinstance(ignored, (cst.Integer, cst.UnaryOperation))
        trained = any(flow.trains(work.facts, loop) for loop in call.loops)
        if call.last in TOKEN_LOSSES and (named or padded):
            labels = _target(call) if trained and not named else None
            value = work.facts.code(ignored) if ignored is not None else "-100"
        elif "labels" in keywords and padded and trained:
            labels, value = keywords["labels"], "-100"
        elif _whole_batch(call) and padded and trained and '"labels"' in work.facts.module.code.replace("'", '"'):
            # ``model(**batch)`` of a Hugging Face loop: the batch's "labels"
            labels, value = cst.parse_expression(f'{_whole_batch(call)}["labels"]'), "-100"
        else:
            continue
        if not (labels is not None and _counted(work, call, labels, value)):
            _listed(work, call)
        return


def _whole_batch(call: Call) -> str | None:
    """The name handed as ``**name`` where that is the loop's whole batch (``for batch in loader``)."""
    starred = [dotted(a.value) for a in call.node.args if a.star == "**"]
    if len(starred) != 1 or not call.loops or not isinstance(call.loops[-1].node, cst.For):
        return None
    target = _unwrapped(call.loops[-1].node)
    return starred[0] if isinstance(target, cst.Name) and target.value == starred[0] else None


def _target(call: Call) -> cst.BaseExpression | None:
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    named = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    return named.get("target", positional[1] if len(positional) > 1 else None)


def _counted(work: _Work, call: Call, labels: cst.BaseExpression, value: str) -> bool:
    """Tell the one training loader the call's loop reads what to count; False where that cannot be said."""
    loop = call.loops[-1]
    loaders = [c for c in work.facts.calls if id(c.node) in work.sharded and _reads(work, loop, c)]
    part = _labels_part(work, call, loop, labels)
    if len(loaders) != 1 or part is None or not isinstance(loop.node, cst.For):
        return False
    count = f"lambda batch: ({part} != {value}).sum()"
    loader = loaders[0]
    rewrite = work.edits.expr[id(loader.node)]
    work.edits.expr[id(loader.node)] = lambda node: add_keyword(rewrite(node), "batch_count", count)
    work.note(f"batch_count={count}", f"the loss at line {call.line} is a mean over the tokens not labelled "
              f"{value}: each rank's gradient is weighed by its share of the batch's tokens over all ranks, as one "
              "process's mean over the global batch", loader.line)
    return True


def _reads(work: _Work, loop: Loop, loader: Call) -> bool:
    """``loop`` (or a loop around it) iterates over the name ``loader``'s call is bound to."""
    bound = {b.target for b in work.facts.bindings if b.value is loader.node}
    return any(bound & set(each.iter_names) for each in [*loop.outer, loop])


def _labels_part(work: _Work, call: Call, loop: Loop, labels: cst.BaseExpression) -> str | None:
    """``batch[k]`` / ``batch["labels"]``: the part of the loader's batch that ``labels`` is, through the methods
    that keep its tokens (``.view(-1)``, ``.to(device)``) and one binding in the loop (``y = batch[1].cuda()``)."""
    for _ in range(3):
        while isinstance(labels, cst.Call) and isinstance(labels.func, cst.Attribute) and \
                labels.func.attr.value in _KEEPS:
            labels = labels.func.value
        name = dotted(labels)
        if isinstance(labels, cst.Subscript):
            return _subscript(labels, loop)
        if name is None:
            return None
        found = _part(loop.node, name) if isinstance(loop.node, cst.For) else None
        if found is not None:
            return found
        bound = flow.binding_of(work.facts, name, call.scope, call.line)
        if bound is None or bound.value is None or bound.line < loop.line:
            return None
        labels = bound.value
    return None


def _subscript(labels: cst.Subscript, loop: Loop) -> str | None:
    """``batch["labels"]`` / ``batch[1]`` of a loop whose target is the single name ``batch``."""
    target = loop.node.target if isinstance(loop.node, cst.For) else None
    inner = _unwrapped(loop.node) if isinstance(loop.node, cst.For) else None
    whole = inner.value if isinstance(inner, cst.Name) else None
    if whole is None or dotted(labels.value) != whole or len(labels.slice) != 1 or target is None:
        return None
    index = labels.slice[0].slice
    if not isinstance(index, cst.Index) or not isinstance(index.value, (cst.SimpleString, cst.Integer)):
        return None
    return "batch[" + cst.Module(body=[]).code_for_node(index.value) + "]"


def _unwrapped(loop: cst.For) -> cst.BaseExpression | None:
    """The part of a for loop's target bound to the loader's batch: ``(x, y)`` of ``for i, (x, y) in
    enumerate(loader)``."""
    target: cst.BaseExpression = loop.target
    source = loop.iter
    while isinstance(source, cst.Call) and (dotted(source.func) or "") in _WRAPS and source.args:
        if dotted(source.func) == "enumerate":
            if not isinstance(target, cst.Tuple) or len(target.elements) != 2:
                return None
            target = target.elements[1].value
        source = source.args[0].value
    return target


def _part(loop: cst.For, name: str) -> str | None:
    """``batch[k]`` for the name at place k of the loop's tuple target, ``batch`` for the whole."""
    target = _unwrapped(loop)
    if isinstance(target, cst.Name):
        return "batch" if target.value == name else None
    if isinstance(target, (cst.Tuple, cst.List)):
        for k, element in enumerate(target.elements):
            if isinstance(element.value, cst.Name) and element.value.value == name:
                return f"batch[{k}]"
    return None


def _listed(work: _Work, call: Call) -> None:
    work.leave(call.line, f"{call.last}: a mean over the tokens it does not ignore (ignore_index, labels of -100): "
               "at N processes each rank's mean is over its own tokens and DDP weighs the ranks alike, another "
               "loss than one process's mean over the step's tokens (ddpkit verify FAILs it)",
               "tell the training loader what the loss averages over: ddpkit.data_loader(..., batch_count=lambda "
               "batch: (labels != -100).sum()), labels as the batch holds them (docs/global-batch.md, "
               "token-weighted losses); or keep it if the difference is acceptable")
