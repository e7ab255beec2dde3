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
import libcst.matchers as m

from ddpkit.commands.convert import flow, tokensaid
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Call, Loop

# the plan in the making (plan._Work): facts, edits, note, leave, sharded
_Work = Any
TOKEN_LOSSES = ("cross_entropy", "CrossEntropyLoss", "nll_loss", "NLLLoss", "NLLLoss2d")
# what a loop does to its labels before the loss, keeping which tokens they are
_KEEPS = ("view", "reshape", "flatten", "to", "cuda", "long", "contiguous", "squeeze")
_WRAPS = ("enumerate", "tqdm", "progress", "ddpkit.progress")


def token_mean_loss(work: _Work) -> None:
    """Each token-mean loss of a training loop: its loader told what to count, or the line listed (once a loop).
    An evaluation's loss is not what trains: passed over; one outside any loop (a criterion built in a model's
    ``__init__``) is listed."""
    if any(a.keyword is not None and a.keyword.value in ("count", "batch_count") for c in work.facts.calls
           if c.name == "ddpkit.data_loader" for a in c.node.args):
        return
    if work.crossing is not None and work.crossing.counted:  # (told in the module that builds it: set 26)
        return
    code = work.facts.module.code
    padded = _padded(work.facts.module)
    said: set[int] = set()  # the loops (0: none) already counted or listed
    for call in sorted(work.facts.calls, key=lambda c: not _trained(work, c)):  # training loops first
        keywords = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
        ignored = keywords.get("ignore_index")
        # an ignore_index read from a setting (a pad id) pads; a literal one (minGPT's -1) may mark nothing
        named = ignored is not None and not isinstance(ignored, (cst.Integer, cst.UnaryOperation))
        # ``ignore_index=0`` (BERT-pytorch's NLLLoss): a pad token's id, which every padded sequence holds
        pad_id = isinstance(ignored, cst.Integer)
        trained = _trained(work, call)
        if call.loops and not trained or not call.loops and _evaluated_only(work, call):  # an evaluation's loss
            continue
        reduction = keywords.get("reduction")
        if isinstance(reduction, cst.SimpleString) and reduction.evaluated_value in ("sum", "none") and \
                not (reduction.evaluated_value == "sum" and over_tokens(work, call)):
            continue  # no mean (Sentence-VAE's NLLLoss(reduction='sum'), divided by the batch's own size)
        if _false(keywords.get("reduce")) or _false(keywords.get("size_average")) and not over_tokens(work, call):
            continue  # the old ``size_average=False`` (NCRFpp's NLLLoss): a sum, said as one by losses.py; divided
            # by the kept tokens, a mean over them (review 26), as ``reduction='sum'``
        labels: Any = None
        positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
        at = 0 if call.last[:1].isupper() else 2  # ``nn.NLLLoss(weight)``; ``F.cross_entropy(x, y, weight)``
        weighed = keywords.get("weight", positional[at] if len(positional) > at else None)
        if call.last in TOKEN_LOSSES and weighed is not None and not (isinstance(weighed, cst.Name) and
                                                                      weighed.value == "None"):
            loop = id(call.loops[-1]) if call.loops else 0
            if loop not in said and (trained or not call.loops and _trains_with(work, call)):
                said.add(loop)
                tokensaid.weighed(work, call, work.facts.code(weighed))
            continue
        if call.last in TOKEN_LOSSES and (named or padded or pad_id):
            labels = _target(call) if trained and not named else None
            value = work.facts.code(ignored) if ignored is not None else "-100"
        elif "labels" in keywords and padded and trained:
            labels, value = keywords["labels"], "-100"
        elif _starred_batch(call) and padded and trained and '"labels"' in code.replace("'", '"'):
            # ``model(**batch)`` of a Hugging Face loop: the batch's "labels" (listed where it was rebound)
            whole = _whole_batch(work, call)
            labels, value = cst.parse_expression(f'{whole}["labels"]') if whole else None, "-100"
        elif _masked(work, call):  # ``loss_fct(logits[active], labels[active])``: a mean over what a mask keeps
            labels, value = None, "-100"
        else:
            continue
        loop = id(call.loops[-1]) if call.loops else 0
        if loop in said:
            continue
        said.add(loop)
        shift = _shift(code) if call.last not in TOKEN_LOSSES else ""
        if labels is None or shift is None or not _counted(work, call, labels, value, shift):
            tokensaid.listed(work, call, value)


def _padded(module: cst.Module) -> bool:
    """The script writes the number -100 (labels padded with it), not in a slice (``losses[-100:]``) nor in a
    text (augmix's help: "CIFAR-10, CIFAR-100")."""
    slices = {id(node) for found in m.findall(module, m.Slice()) for node in m.findall(found, m.UnaryOperation())}
    return any(id(node) not in slices for node in m.findall(module, m.UnaryOperation(
        operator=m.Minus(), expression=m.Integer(value="100"))))


_MASKS = ("ne", "eq", "gt", "lt", "ge", "le", "bool", "logical_and", "logical_or", "isin")


def _masked(work: _Work, call: Call) -> bool:
    """A loss over the elements a boolean mask selects (CodeBERT's ``loss_fct(shift_logits.view(-1, V)[active],
    shift_labels.view(-1)[active])``, ``active = mask.ne(0).view(-1) == 1``): a mean over a number of tokens that
    differs from batch to batch. A mask is a comparison (or ``.ne(0)``, ``.bool()``), or a name bound to one; a
    dict key (``outputs[t]``) is not."""
    last = call.last.lower()
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    if len(positional) < 2:
        return False
    if _ignored_where(work, call, positional[1]):
        bound = flow.binding_of(work.facts, dotted(call.node.func) or "", call.scope, call.line)
        summed = bound is not None and isinstance(bound.value, cst.Call) and _summed(bound.value)  # (review)
        return not summed and (last.endswith(("loss", "loss_fct", "criterion")) or _a_token_loss(work, call))
    if not (call.last in TOKEN_LOSSES or last.endswith(("loss", "loss_fct")) or last == "criterion"):
        return False
    for value in positional[:2]:
        index = value.slice[0].slice if isinstance(value, cst.Subscript) and len(value.slice) == 1 else None
        mask = index.value if isinstance(index, cst.Index) else None
        name = dotted(mask) if mask is not None else None
        if name is not None:
            bound = flow.binding_of(work.facts, name, call.scope, call.line)
            mask = bound.value if bound is not None else None
        if not _a_mask(mask):
            return False
    return True


def _ignored_where(work: _Work, call: Call, target: Any) -> bool:
    """Labels a mask sets to the ignored index (bert-entity-extraction's ``torch.where(active_loss, target.view(-1),
    torch.tensor(lfn.ignore_index).type_as(target))``): the loss is a mean over the tokens the mask keeps."""
    name = dotted(target)
    bound = flow.binding_of(work.facts, name, call.scope, call.line) if name else None
    value = bound.value if bound is not None else target
    if not (isinstance(value, cst.Call) and (dotted(value.func) or "").rsplit(".", 1)[-1] == "where" and
            len(value.args) == 3):
        return False
    other = work.facts.code(value.args[2].value).replace(" ", "")
    return "ignore_index" in other or "-100" in other


# a count of the tokens a mask keeps: ``labels.ne(0).long().sum()``, ``(y != -100).sum()``
KEPT_COUNT = re.compile(r"(\.ne\(|!=|\.eq\(|==).*\.sum\(")


def over_tokens(work: _Work, call: Call) -> bool:
    """A summed loss divided, in the same function, by a count of the tokens kept (GPT2-NewsTitle's ``num =
    shift_labels.ne(0).long().sum().item()`` then ``loss = loss / num``): a token mean after all."""
    counts = {b.target for b in work.facts.bindings if b.scope is call.scope and b.value is not None and
              KEPT_COUNT.search(work.facts.code(b.value))}
    return any(isinstance(d, cst.BinaryOperation) and (dotted(d.right) in counts or  # (``loss / num``, a return)
                                                       bool(KEPT_COUNT.search(work.facts.code(d.right))))
               for stmt, scope, line in work.facts.statements if scope is call.scope and line > call.line
               for d in m.findall(stmt, m.BinaryOperation(operator=m.Divide())))


def _summed(made: cst.Call) -> bool:
    """A criterion built with ``reduction='sum'`` or ``'none'`` (not ``'mean'``: review), or the old
    ``size_average=False`` / ``reduce=False``."""
    return any(a.keyword is not None and (a.keyword.value == "reduction" and isinstance(a.value, cst.SimpleString)
                                          and a.value.evaluated_value in ("sum", "none") or
                                          a.keyword.value in ("size_average", "reduce") and _false(a.value))
               for a in made.args)


def _false(value: Any) -> bool:
    return isinstance(value, cst.Name) and value.value == "False"


def _a_token_loss(work: _Work, call: Call) -> bool:
    """``lfn(...)`` where ``lfn = nn.CrossEntropyLoss()`` (or another token loss) in the same function."""
    bound = flow.binding_of(work.facts, dotted(call.node.func) or "", call.scope, call.line)
    return bound is not None and isinstance(bound.value, cst.Call) and \
        (dotted(bound.value.func) or "").rsplit(".", 1)[-1] in TOKEN_LOSSES and not _summed(bound.value)


def _a_mask(node: Any) -> bool:
    if isinstance(node, cst.Comparison):
        return True
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        if node.func.attr.value in _MASKS:
            return True
        node = node.func.value
    return False


def _trained(work: _Work, call: Call) -> bool:
    return any(flow.trains(work.facts, loop) for loop in call.loops)


# Hugging Face heads whose loss compares each label with the prediction one place before it (``labels[..., 1:]``)
_SHIFTED = ("CausalLM", "LMHeadModel")
_IN_PLACE = ("ForTokenClassification", "ForMaskedLM", "ForConditionalGeneration", "ForSeq2SeqLM", "ForQuestion")


def _shift(code: str) -> str | None:
    """What a Hugging Face model's ``labels=`` loss counts of its labels: ``[..., 1:]`` for a causal language model
    (it drops the first of each sample), all of them for a token-level head; None where the script names
    neither, or both (listed: a count off by one a sample weighs ranks wrongly)."""
    shifted, kept = any(w in code for w in _SHIFTED), any(w in code for w in _IN_PLACE)
    return None if shifted == kept else "[..., 1:]" if shifted else ""


def _starred_batch(call: Call) -> str | None:
    """The name handed as ``**name`` where that is the name of the loop's whole batch (``for batch in loader``)."""
    starred = [dotted(a.value) for a in call.node.args if a.star == "**"]
    if len(starred) != 1 or not call.loops or not isinstance(call.loops[-1].node, cst.For):
        return None
    target = _unwrapped(call.loops[-1].node)
    return starred[0] if isinstance(target, cst.Name) and target.value == starred[0] else None


def _whole_batch(work: _Work, call: Call) -> str | None:
    """:func:`_starred_batch`, still the batch there, or a dict made from its items (``{k: v.to(device) for k, v
    in batch.items()}``)."""
    name = _starred_batch(call)
    return None if name is None or _rebound(work, call, name) else name


def _rebound(work: _Work, call: Call, name: str) -> bool:
    """``name`` is bound again in the loop, above ``call``, to something else than its own items."""
    loop = call.loops[-1]
    for b in work.facts.bindings:
        if b.target != name or b.scope is not call.scope or not loop.line < b.line <= call.line:
            continue
        value = b.value
        own = isinstance(value, cst.DictComp) and any(
            isinstance(f.iter, cst.Call) and dotted(f.iter.func) == f"{name}.items" for f in _fors(value))
        if not own:
            return True
    return False


def _fors(comp: cst.DictComp) -> list[cst.CompFor]:
    found: list[cst.CompFor] = []
    node: cst.CompFor | None = comp.for_in
    while node is not None:
        found.append(node)
        node = node.inner_for_in
    return found


def _target(call: Call) -> cst.BaseExpression | None:
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    named = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    return named.get("target", positional[1] if len(positional) > 1 else None)


def _counted(work: _Work, call: Call, labels: cst.BaseExpression, value: str, shift: str) -> bool:
    """Tell the one training loader the call's loop reads what to count; False where that cannot be said: another
    loss beside it (a sample mean weighed by tokens would be wrong), labels masked in the loop, no one loader."""
    loop = call.loops[-1]
    if sum(_a_loss(c) for c in loop.calls) > 1:
        return False
    loaders = [c for c in work.facts.calls if id(c.node) in work.sharded and _reads(work, loop, c)]
    part = _labels_part(work, call, loop, labels)
    if len(loaders) != 1 or part is None or not isinstance(loop.node, cst.For):
        return False
    count = f"lambda batch: ({part}{shift} != {value}).sum()"
    loader = loaders[0]
    rewrite = work.edits.expr[id(loader.node)]
    work.edits.expr[id(loader.node)] = lambda node: add_keyword(rewrite(node), "batch_count", count)
    work.note(f"batch_count={count}", f"the loss at line {call.line} is a mean over the tokens not labelled "
              f"{value}: each rank's gradient is weighed by its share of the batch's tokens over all ranks, as one "
              "process's mean over the global batch", loader.line)
    return True


def _a_loss(call: Call) -> bool:
    """A call that makes a loss: torch's (``cross_entropy``, ``nn.MSELoss()(...)``), a criterion, a model called
    with ``labels=``."""
    last = call.last.lower()
    return call.last in TOKEN_LOSSES or last.endswith("loss") or last == "criterion" or \
        any(a.keyword is not None and a.keyword.value == "labels" for a in call.node.args)


def _reads(work: _Work, loop: Loop, loader: Call) -> bool:
    """``loop`` (or a loop around it) iterates over the name ``loader``'s call is bound to."""
    bound = {b.target for b in work.facts.bindings if b.value is loader.node}
    return any(bound & set(each.iter_names) for each in [*loop.outer, loop])


def _labels_part(work: _Work, call: Call, loop: Loop, labels: cst.BaseExpression) -> str | None:
    """``batch[k]`` / ``batch["labels"]``: the part of the loader's batch that ``labels`` is, through the methods
    that keep its tokens (``.view(-1)``, ``.to(device)``) and the bindings in the loop (``y = batch[1].cuda()``);
    None for labels changed in place in the loop (``labels[labels == pad] = -100``: the batch's are not those)."""
    body = work.facts.code(loop.node)
    for _ in range(4):
        while isinstance(labels, cst.Call) and isinstance(labels.func, cst.Attribute) and \
                labels.func.attr.value in _KEEPS:
            labels = labels.func.value
        if isinstance(labels, cst.Subscript):
            name = dotted(labels.value)
            return None if name is None or _rebound(work, call, name) else _subscript(labels, loop)
        name = dotted(labels)
        if name is None or re.search(rf"\b{re.escape(name)}\s*\[[^\]]*\]\s*=(?!=)|\b{re.escape(name)}\."
                                     r"(masked_fill_|fill_|copy_|index_fill_|scatter_)\(", body):
            return None
        bound = flow.binding_of(work.facts, name, call.scope, call.line)
        if bound is not None and bound.value is not None and bound.line > loop.line:
            labels = bound.value  # bound in the loop, after the batch: followed
            continue
        return _part(loop.node, name) if isinstance(loop.node, cst.For) else None
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


def _evaluated_only(work: _Work, call: Call) -> bool:
    """A criterion built outside the loops whose every call evaluates, under ``no_grad`` (set 27's seq2seq after its
    own fix: the training step builds its summed loss inline, and the criterion is ``validate()``'s alone)."""
    names = {b.target for b in work.facts.bindings if b.value is call.node}
    uses = [c for c in work.facts.calls if dotted(c.node.func) in names]
    called = {id(c.node.func) for c in uses}
    # (read otherwise, handed to a training function as ``loss_fn=criterion``: that one trains with it; review 42)
    handed = any(name in names and id(node) not in called for name, _scope, _line, node in work.facts.reads)
    def evaluates(c: Call) -> bool:  # (not a loop over time steps, in the step or a helper it calls: review)
        trains = lambda lp: flow.trains(work.facts, lp)  # noqa: E731
        data = [lp for lp in c.loops if not lp.over_count()]  # (the innermost loop over data decides)
        return c.no_grad or bool(data) and not trains(data[-1]) and \
            not flow.called_from_loop(work.facts, c.scope, trains)
    # (a validation loop with no backward and no no_grad, ``model.eval()`` alone: review 43)
    return bool(uses) and not handed and all(evaluates(c) for c in uses)


def _trains_with(work: _Work, call: Call) -> bool:
    """A criterion built outside the loops (``criterion = nn.CrossEntropyLoss(weight=w)``) that a training loop
    calls; one only a validation calls is no training loss."""
    names = {b.target for b in work.facts.bindings if b.value is call.node}
    return any(dotted(c.node.func) in names and c.loops and flow.trains(work.facts, c.loops[-1])
               for c in work.facts.calls) or not names
