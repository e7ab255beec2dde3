"""A loader's role, from what the loops over it do: ``train`` (a backward in the loop or a function it calls),
``eval`` (no backward, under ``no_grad`` / ``inference_mode`` or after ``model.eval()``), or, with no loop found,
from its ``shuffle=`` and the words of its name (``test_loader``, ``devloader``) or the split an ``if`` around it
tests. A look at the first batch (``break`` after one) and a generator handing batches on say nothing.

Example::

    >>> _eval_named("val_loader"), _eval_named("device_loader"), _eval_named("devloader")
    (True, False, True)
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flagged import switched_off
from ddpkit.commands.convert.flow import callee, callers, step_off, trains
from ddpkit.commands.convert.names import names_in
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop


def evaluates(facts: Facts, loop: Loop) -> bool:
    """A loop with positive signs of evaluation: no backward pass, and under ``no_grad`` / ``inference_mode``
    (its own, or at every call of its function: torchdiffeq's ``with torch.no_grad(): acc =
    accuracy(model, test_loader)``), after ``model.eval()`` in the same function, or calling a helper whose step
    it switches off (``network_pass(..., train=False)``)."""
    if trains(facts, loop):
        return False
    sites = callers(facts, loop.scope) if loop.scope.name else []
    stepped = any(id(c.node) in facts.eval_steps for c in loop.calls)  # (another module's evaluation step)
    # (a helper of the script's whose step this call switches off: ``network_pass(net, x, y, crit)``, train=False)
    off = any(step_off(facts, c) for c in loop.calls)
    if loop.no_grad or sites and all(c.no_grad for c in sites) or stepped or off:
        return True
    # (or at every call of its function, after ``model.eval()`` there: marinepal's ``self.model.eval()``, then
    # ``print(self.metrics())``, whose loop only collects predictions)
    return any(c.scope is loop.scope and c.last == "eval" and not c.node.args and c.line <= loop.line
               for c in facts.calls) or bool(sites) and all(_after_eval(facts, site) for site in sites)


def _after_eval(facts: Facts, site: Call, depth: int = 0) -> bool:
    """``site`` comes after a ``.eval()`` of its function, with no ``.train()`` between; or its function switches
    nothing and every call of it does (marinepal's ``get_metrics()`` in ``save()``, called after ``model.eval()``
    in ``train()``), three calls deep at most."""
    switches = [c for c in facts.calls if c.scope is site.scope and c.last in ("eval", "train") and
                not c.node.args and c.line <= site.line and c is not site]
    if switches:
        return max(switches, key=lambda c: c.line).last == "eval"
    sites = callers(facts, site.scope) if site.scope.name and depth < 3 else []
    return bool(sites) and all(_after_eval(facts, s, depth + 1) for s in sites)


def role(facts: Facts, loops: list[Loop], binding: Binding | None, call: Call) -> str | None:
    """``train``, ``eval`` or None, from what the loops over the loader do (a training loader that is also
    evaluated trains); a loader no loop is found for (built in one place, iterated through an expression this
    cannot follow) by its shuffle= and names."""
    # (a generator's loop that yields each batch, ``def cycle(it): while True: for x in it: yield x``: its
    # caller's loop over ``cycle(loader)`` tells the role)
    loops = [loop for loop in loops if not peek(loop) and not passes_on(loop)]
    shuffled, words = _naming(facts, binding, call)
    named_eval = not shuffled and _eval_named(words)
    if loops:
        kinds = {"train" if trains(facts, loop) else "eval" if evaluates(facts, loop) else None for loop in loops}
        if kinds == {None} and named_eval:  # no backward in its loops, and named for evaluation: both agree
            return "eval"
        if kinds == {"train", "eval"}:  # ``check_accuracy(train_loader, model)`` after training: its shard is
            return "train"              # evaluated on each rank, and its evaluation's sums reduced (loaders)
        return kinds.pop() if len(kinds) == 1 else None
    if shuffled or "train" in words:
        return "train"
    return "eval" if named_eval else _branch_role(facts, call)


def flagged_off(facts: Facts, binding: Binding, loops: list[Loop]) -> bool:
    """Every loop over ``binding``'s loader is in a function of the script that trains or evaluates by a flag, and
    every call handing it the loader switches the backward off (``run_model(net, val_loader, opt, False)`` of
    ``if train: loss.backward()``: :func:`.flagged.switched_off`): the loader is evaluated there."""
    scopes = {id(loop.scope): loop.scope for loop in loops}
    if any(not scope.name for scope in scopes.values()):
        return False
    sites = [c for c in facts.calls if (t := callee(facts, c)) is not None and id(t[0]) in scopes and
             any(binding.target in names_in(a.value) for a in c.node.args)]
    return bool(sites) and all(switched_off(facts, c, t[0], t[1]) for c in sites
                               if (t := callee(facts, c)) is not None)


def _branch_role(facts: Facts, call: Call) -> str | None:
    """The role a split's name says in the ``if`` around the loader (a data provider's ``if flag == 'train':
    DataLoader(...)`` / ``else: DataLoader(...)``): ``train`` in the branch of ``== 'train'``, ``eval`` in its
    ``else`` or in the branch of ``== 'val'`` / ``'test'``; None where no such test holds it."""
    for node in m.findall(facts.module, m.If()):
        if not isinstance(node, cst.If) or call.stmt is None or not isinstance(node.test, cst.Comparison):
            continue
        split = next((c.comparator for c in node.test.comparisons if isinstance(c.operator, cst.Equal)), None)
        word = split.evaluated_value if isinstance(split, cst.SimpleString) else None
        if not isinstance(word, str):
            continue
        inside = any(s is call.stmt for s in m.findall(node.body, m.SimpleStatementLine()))
        other = node.orelse is not None and any(s is call.stmt for s in m.findall(node.orelse, m.SimpleStatementLine()))
        if inside and word.lower() == "train":
            return "train"
        if inside and _eval_named(word.lower()) or other and word.lower() == "train":
            return "eval"
    return None


def passes_on(loop: Loop) -> bool:
    """A loop whose body yields (a generator handing each batch on) and neither trains nor evaluates itself."""
    return bool(m.findall(loop.node.body, m.Yield())) and not trains_anything(loop)


def _naming(facts: Facts, binding: Binding | None, call: Call) -> tuple[bool, str]:
    """(the loader shuffles, the words of its name and its dataset's, lower case)."""
    shuffle = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
    words = " ".join(filter(None, [binding.target if binding else None,
                                   facts.code(call.node.args[0].value) if call.node.args else None])).lower()
    return isinstance(shuffle, cst.Name) and shuffle.value == "True", words


def _eval_named(words: str) -> bool:
    """Named for evaluation: test, val, eval, dev (a dev set: knowledge-distillation's ``devloader``; not a
    device)."""
    return "train" not in words and (any(w in words for w in ("test", "val", "eval")) or
                                     re.search(r"dev(?!ice)", words) is not None)


def shuffled_eval_name(facts: Facts, binding: Binding | None, call: Call) -> bool:
    """Named for evaluation (``test_loader``) but shuffled: why its name alone was not trusted."""
    shuffled, words = _naming(facts, binding, call)
    return shuffled and _eval_named(words)


def roles_said(facts: Facts, loops: list[Loop]) -> str:
    """Why no role: the loops that train, evaluate or do neither, by line."""
    if not loops:
        return "no loop over it was found"
    neither = "neither trains (no backward found) nor evaluates (no no_grad, inference_mode or model.eval())"
    said = [f"line {loop.line} " + ("trains" if trains(facts, loop) else "evaluates" if evaluates(facts, loop)
                                    else neither) for loop in loops]
    return "; ".join(said)


def peek(loop: Loop) -> bool:
    """``for x, y in loader: print(x.shape); break``: a look at the first batch, which says nothing of the role."""
    body = loop.node.body.body if isinstance(loop.node.body, cst.IndentedBlock) else ()
    last = body[-1] if body else None
    return isinstance(last, cst.SimpleStatementLine) and any(isinstance(s, cst.Break) for s in last.body) \
        and not trains_anything(loop)


def trains_anything(loop: Loop) -> bool:
    return any(c.last == "backward" for c in loop.calls)
