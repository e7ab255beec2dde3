"""Which parameter of its function a training loop's loader is (``dataloader`` of ``train_step(model, dataloader)``,
``self.loader`` set from ``__init__``'s ``loader``, ``load_data.train_loader`` of a data object handed in), followed
through the file's own callers to the parameters another module's call passes (:mod:`.handedin` asks those).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("def fit(model, opt, data):\\n    for x in data.train_loader:\\n"
    ...          "        model(x).sum().backward()\\n        opt.step()\\n")
    >>> [x.what[:60] for x in p.left]
    ['the training loop reads data.train_loader, a parameter of fi']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flagged, flow
from ddpkit.commands.convert.crossing import EVAL, HANDED, Ask
from ddpkit.commands.convert.devicetext import PROGRESS
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Binding, Call
from ddpkit.commands.convert.sums import sums_after

_Work = Any  # the plan in the making (plan._Work)


def parameters(work: _Work, name: str, scope: Any, line: int, depth: int = 0) -> set[tuple[str, str, int]]:
    """:func:`parameter` of ``name`` and of each name its function binds it to (StarGAN's ``data_loader =
    self.celeba_loader`` or ``self.rafd_loader`` in an ``if`` / ``elif``: both handed in)."""
    found = {parameter(work, name, scope, line)}
    # (only those before the loop: ``data = self.val_loader`` after the training loop is another loop's)
    for bound in [b for b in work.facts.bindings if b.target == name and b.scope is scope and b.value is not None
                  and b.line <= line]:
        source = dotted(bound.value)
        found.add(parameter(work, source, scope, bound.line) if source else None)
    return {q for p in found if p is not None for q in _through_callers(work, p, depth)}


def _through_callers(work: _Work, found: tuple[str, str, int], depth: int) -> set[tuple[str, str, int]]:
    """A parameter of a function this file calls with different arguments (BERT-pytorch's ``iteration(epoch,
    data_loader, train)``, called by ``train()`` with ``self.train_data`` and by ``test()`` with
    ``self.test_data``): what each call hands in, followed to the parameters of another module's callers
    (``BERTTrainer.__init__``'s ``train_dataloader`` and ``test_dataloader``); itself when no call here passes it."""
    name, where, _ = found
    scope = work.facts.scopes.get(where)
    sites = flow.callers(work.facts, scope) if scope is not None and depth < 3 else []
    if not sites:
        return {found}
    skip = 1 if scope.cls and scope.params[:1] in (["self"], ["cls"]) else 0
    deeper: set[tuple[str, str, int]] = set()
    for site in sites:
        if flagged.switched_off(work.facts, site, scope, skip):  # (``iteration(..., train=False)``): kept whole
            _evaluation(work, scope, site)
            passed = dotted(flow.argument_for(site, name, scope, skip) or cst.Name("_"))
            for param, function, index in parameters(work, passed, site.scope, site.line, depth + 1) \
                    if passed and passed != "_" else set():  # its callers keep it whole, and say so
                work.asks.append(Ask("", f"{HANDED}:{function}:{index}:{param}", EVAL, site.line))
            continue
        base, dot, attr = name.partition(".")  # (``load_data.train_loader``: that attribute of what is passed)
        passed = dotted(flow.argument_for(site, base, scope, skip) or cst.Name("_"))
        passed = f"{passed}{dot}{attr}" if passed and passed != "_" and dot else passed
        more = parameters(work, passed, site.scope, site.line, depth + 1) if passed and passed != "_" else set()
        if not more:  # (a site that hands in something else, a loader built here: not all handed in)
            return {found}
        deeper |= more
    return deeper


def _evaluation(work: _Work, scope: Any, site: Call) -> str:
    """How ``site``, which runs the training loop of ``scope`` as an evaluation (:mod:`.flagged`), hands in its
    loader: ``whole`` when the loop sums nothing across ranks (every rank evaluates the whole set; a mean over the
    ranks of the same value is that value), else ``mixed``, left to the user: kept whole, a sum reduced across
    ranks would count it N times; sharded as the training loader is, its shards are padded (a sample counted
    twice) and what the loop keeps unreduced (a list, a count) would be rank 0's part."""
    loops = [loop for loop in work.facts.loops if loop.scope is scope]
    summed = {n for loop in loops for r in sums_after(work.facts, loop, True) or [] for n in r.names
              if n not in r.averaged}
    if not summed:
        return "whole"
    if not any(left.line == site.line for left in work.left):
        work.leave(site.line, f"this call runs the training loop of {scope.name} as an evaluation (its backward "
                   f"switched off), and the loop sums {', '.join(sorted(summed))} across ranks: over the whole set "
                   "each rank reads that sum would count it N times, and sharded as the training set is, its "
                   "shards are padded", "give the evaluation a loop of its own (no backward, under "
                   "torch.no_grad()), then convert again")
    return "mixed"


def parameter(work: _Work, name: str, scope: Any, line: int, depth: int = 0) -> tuple[str, str, int] | None:
    """(the parameter, its function, its place among the arguments a caller writes) ``name`` holds when it is a
    parameter that no call in this file passes: ``dataloader`` of ``train_step(model, dataloader)`` (1), or
    ``self.train_loader`` set from ``__init__``'s ``train_loader`` (a Solver a caller builds: ``Solver(config,
    train_loader)``, 1: ``self`` is not written); None otherwise."""
    bound = flow.binding_of(work.facts, name, scope, line)
    head, dot, attr = name.partition(".")
    if bound is None and dot and head != "self" and "." not in attr and depth <= 2:
        # (``load_data.train_loader`` of a data object handed in: asked of the callers as that attribute of what
        # they pass; set 26's VAE project, refused as fed by hand)
        inner = parameter(work, head, scope, line, depth + 1)
        return (f"{inner[0]}.{attr}", inner[1], inner[2]) if inner is not None and not set(inner[0]) & set(".[") \
            else None
    if bound is None or depth > 2:
        return None
    if bound.value is None and bound.stmt is None and bound.target in bound.scope.params:
        own = 1 if bound.scope.cls and bound.scope.params[:1] in (["self"], ["cls"]) else 0
        return bound.target, bound.scope.name, bound.scope.params.index(bound.target) - own
    element = _element_of(bound)
    if element is not None:  # ``self.train_loader = loaders[0]``, ``train, valid = loaders``: a handed-in tuple's
        inner = parameter(work, element[0], bound.scope, bound.line, depth + 1)
        return (f"{inner[0]}[{element[1]!r}]", inner[1], inner[2]) if inner is not None and "[" not in inner[0] \
            else None
    source = dotted(_unwrapped_bar(work, bound.value)) if bound.value is not None else None
    before = bound.line - 1 if source == name else bound.line  # (``x = tqdm(x)``: the ``x`` bound before)
    return parameter(work, source, bound.scope, before, depth + 1) if source else None


def _unwrapped_bar(work: _Work, value: cst.BaseExpression) -> cst.BaseExpression:
    """``tqdm(data_loader, file=sys.stdout)`` -> ``data_loader``: a progress bar over the loader hands on its batches
    (DialoGPT's ``data_loader = tqdm(data_loader)`` before its loop)."""
    if isinstance(value, cst.Call) and (resolve(dotted(value.func), work.facts.aliases) or "") in PROGRESS and \
            value.args and value.args[0].keyword is None and not value.args[0].star:
        return value.args[0].value
    return value


def _element_of(bound: Binding) -> tuple[str, int | str] | None:
    """(the name, k) where ``bound`` is element k of a name: ``x = held[0]``, or ``a, b = held``; or item k of a
    dict: ``train_loader = dataloaders['train']`` (a key a want can carry: no quote, colon or bracket in it)."""
    value = bound.value
    if isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index) \
            and isinstance(value.slice[0].slice.value, cst.Integer) and dotted(value.value):
        return str(dotted(value.value)), int(value.slice[0].slice.value.value)
    if isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index) \
            and isinstance(key := value.slice[0].slice.value, cst.SimpleString) and dotted(value.value) and \
            isinstance(key.evaluated_value, str) and not set(key.evaluated_value) & set(":'\"[]"):
        return str(dotted(value.value)), key.evaluated_value
    if value is None and bound.index >= 0 and bound.whole is not None and dotted(bound.whole):
        return str(dotted(bound.whole)), bound.index
    return None
