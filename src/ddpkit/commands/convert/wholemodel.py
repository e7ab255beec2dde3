"""A model saved whole (``torch.save(model, f)``, in a dict, moved first: ``torch.save(model.cpu(), f)``): the plain
module is saved, since a pickled DDP wrapper loads only where a process group runs; a move or mode change inside the
saved expression runs on every rank, above the save rank 0 alone makes.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\nnet = torch.nn.Linear(2, 2)\\n"
    ...             "opt = torch.optim.SGD(net.parameters(), lr=1)\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...             "    net(x).sum().backward()\\n    opt.step()\\ntorch.save(net.eval(), 'net.pt')\\n").text
    >>> text.splitlines()[-3:]
    ['net.eval()', 'if ddpkit.init().is_main:', "    torch.save(ddpkit.unwrap(net), 'net.pt')"]
"""

from __future__ import annotations

import re
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flow import binding_of, callers, visible
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Binding

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, models, lists


MOVES = ("cpu", "cuda", "to", "eval", "float", "half", "double")  # what hands back the module it moved


def whole_model(work: _Work, call: Any) -> None:
    """``torch.save(model, f)`` of the prepared model -> ``torch.save(ddpkit.unwrap(model), f)``: a pickled DDP
    wrapper loads only where a process group runs, so the script's own inference code could not read it."""
    arg = call.node.args[0].value if call.node.args else None
    if isinstance(arg, cst.Subscript) and dotted(arg.value) in work.lists:  # ``torch.save(models[0], f)``
        work.edits.expr[id(arg)] = lambda node: cst.parse_expression(f"ddpkit.unwrap({work.facts.code(node)})")
        work.note(f"torch.save({work.facts.code(arg)}, ...) -> torch.save(ddpkit.unwrap(...), ...)", "the plain "
                  "module is saved: a pickled wrapper loads only where a process group runs", call.line)
        return
    if arg is not None and call.stmt is not None and _moves_hoisted(work, call, arg):
        return
    name = dotted(arg)
    found = binding_of(work.facts, name, call.scope, call.line) if name else None
    held = arg if isinstance(arg, cst.Dict) else found.value if found is not None else None
    if isinstance(held, cst.Dict):  # ``{"epoch": e, "model": model}``: the model inside, unwrapped (vdsr)
        for element in held.elements:  # (``'net': model.module if args.cuda else model``: each side)
            values = [element.value.body, element.value.orelse] if isinstance(element, cst.DictElement) and \
                isinstance(element.value, cst.IfExp) else [element.value] if isinstance(element, cst.DictElement) \
                else []
            for value in values:
                if _prepared(work, value, call):
                    inner = dotted(value)
                    work.edits.expr[id(value)] = lambda node, n=inner: cst.parse_expression(f"ddpkit.unwrap({n})")
                    work.note(f"{{..., {inner}}} -> {{..., ddpkit.unwrap({inner})}}", "the plain module is saved in "
                              "the dict: a pickled wrapper loads only where a process group runs", call.line)
        return
    if found is None or not _prepared(work, arg, call):
        return
    work.edits.expr[id(arg)] = lambda node: cst.parse_expression(f"ddpkit.unwrap({name})")
    work.note(f"torch.save({name}, ...) -> torch.save(ddpkit.unwrap({name}), ...)", "the plain module is saved: "
              "a pickled wrapper loads only where a process group runs", call.line)


def _moves_hoisted(work: _Work, call: Any, arg: cst.BaseExpression) -> bool:
    """``torch.save(self.model.cpu(), path)`` (set 29's trainer), ``torch.save(model.cpu().state_dict(), f)``: the
    move, or ``.eval()``, of a prepared model is made on every rank above the save, which rank 0 alone makes (inside
    its guard, rank 0's model alone would change, and SyncBatchNorm's collectives no longer pair: review 45's hang);
    the model saved whole is the plain module."""
    for node in m.findall(arg, m.Call(func=m.Attribute(attr=m.OneOf(*(m.Name(n) for n in MOVES))))):
        assert isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)
        moved = node.func.value
        while isinstance(moved, cst.Call) and isinstance(moved.func, cst.Attribute) and moved.func.attr.value in MOVES:
            moved = moved.func.value
        if not dotted(moved) or not _prepared(work, moved, call):
            continue
        inner, code = dotted(moved), work.facts.code(node)
        work.edits.before.setdefault(id(call.stmt), []).append(code)
        whole = node is arg
        text = f"ddpkit.unwrap({inner})" if whole else str(inner)
        work.edits.expr[id(node)] = lambda _n, t=text: cst.parse_expression(t)
        work.note(f"torch.save({work.facts.code(arg)}, ...) -> {code} above it", "moved on every rank (inside the "
                  "save's guard rank 0's model alone would move)" + (", and the plain module saved: a pickled wrapper "
                  "loads only where a process group runs" if whole else ""), call.line)
        return True
    return False


def _prepared(work: _Work, value: Any, call: Any) -> bool:
    """``value`` is a name bound to a model this plan prepares, as ``call`` reads it (a parameter: as the one
    call site that passes it binds it, ``save_checkpoint(model, epoch)``)."""
    name = dotted(value)
    found = binding_of(work.facts, name, call.scope, call.line) if name else None
    return found is not None and any(found is b or found.target == b.target and any(visible(
        work.facts, b.target, b.scope, s) for s in (call.scope, found.scope)) for b in work.models) or \
        found is not None and (_handed_model(work, found) or _returned_model(work, found))


def _returned_model(work: _Work, found: Binding) -> bool:
    """Bound to what a function of the file returns, a model it prepared (``vae = train(...)``, ``train`` building,
    preparing and training it: the after-fix re-run's whole-model save of the wrapper)."""
    func = dotted(found.value.func) if isinstance(found.value, cst.Call) else None
    scope = work.facts.scopes.get(func or "")
    return scope is not None and any(s is scope and isinstance(v, cst.Name) and any(
        b.target == v.value and b.scope is scope for b in work.models) for s, v in work.facts.returns)


def _handed_model(work: _Work, found: Binding) -> bool:
    """A parameter named for a model (``model``, ``net``, ``encoder_model``) of a function no line of this file
    calls: another module passes it (a tutorial's ``utils.save_checkpoint(epoch, model, ...)``), and the model it
    prepares is a wrapper. (``ddpkit.unwrap`` hands back anything else as it is.)"""
    if not (found.value is None and found.whole is None and found.stmt is None and found.target in
            found.scope.params and not callers(work.facts, found.scope)):
        return False
    # (or used as one there: ``netG.train()``, ``netG.zero_grad()``, or annotated ``netG: torch.nn.Module``; set
    # 28's cGAN trainer, whose ``torch.save(netG, path)`` pickled the wrapper and crashed)
    used = {f"{found.target}.{method}" for method in ("train", "eval", "zero_grad", "parameters", "state_dict")}
    params = m.findall(found.scope.node, m.Param(name=m.Name(found.target)))
    return bool(re.fullmatch(r"(\w+_)?(model|net|network)", found.target)) or any(
        c.scope is found.scope and dotted(c.node.func) in used for c in work.facts.calls) or any(
        isinstance(p, cst.Param) and p.annotation is not None and
        "Module" in work.facts.code(p.annotation.annotation) for p in params)
