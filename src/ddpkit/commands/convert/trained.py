"""Which models an optimizer trains, for ``ddpkit convert``: ``M`` of ``Adam(M.parameters())``, of parameter
groups, of a name its argument is bound to (a Hugging Face fine-tuning script's weight-decay groups built from
``list(model.named_parameters())``), of ``M.configure_optimizers()``. The plan wraps each where it is built.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("import torch\\nnet = Net()\\nnamed = list(net.named_parameters())\\n"
    ...                    "groups = [{'params': [p for n, p in named if 'bias' not in n]}]\\n"
    ...                    "opt = torch.optim.AdamW(groups)\\n"))
    >>> trained_all(facts, next(c for c in facts.calls if c.last == "AdamW"))
    ['net']
"""

from __future__ import annotations

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert.flow import binding_of, callers, part_of
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Call, Facts


def trained_all(facts: Facts, call: Call) -> list[str]:
    """Every model an optimizer call trains (:func:`trained`), also through a name its argument is bound to
    (``params = list(enc.parameters()) + list(dec.parameters()); Adam(params)``: both), two names deep
    (``groups = [{"params": [p for n, p in named ...]}]``, ``named = list(model.named_parameters())``)."""
    found = trained(call) or _stepped(facts, call) or by_hand(facts, call)
    # (a class of the script's own over a name: ``self.opt.optimizer(_params, lr=...)``, ``_params = filter(...,
    # self.model.parameters())``: followed as an optimizer's argument is, before it is read as handed out)
    if not (optimizer(call) or found or _steps(facts, call)) or not call.node.args:
        return found or _handed_out(facts, call)
    # (a helper stepped as an optimizer takes the parameters anywhere: ``get_instance(torch.optim, 'optimizer',
    # config, params)``, pytorch-segmentation's)
    frontier = [call.node.args[0].value] if optimizer(call) else [a.value for a in call.node.args]
    reads = names_in(frontier[0])  # (a list filled by a loop, beside another model's parameters: both)
    for _ in range(3):  # the argument, what its names are bound to, what theirs are
        if found := found or [t for value in frontier for t in _models(facts, parameters_of(value))]:
            break
        ahead = []
        for value in frontier:
            reads |= names_in(value)
            bound = [binding_of(facts, n, call.scope, call.line) for n in sorted(names_in(value))]
            ahead += [b.value for b in bound if b is not None and b.value is not None]
        frontier = ahead[:32]
    found = list(dict.fromkeys(found + _filled(facts, reads))) or _handed_out(facts, call)
    first = call.node.args[0].value
    if not found and optimizer(call) and isinstance(first, cst.Name) and first.value in call.scope.params and \
            callers(facts, call.scope):
        return [first.value]  # ``optim.Adam(model_params, lr)`` in a helper: what its callers pass (handed.py)
    return found


# what only an optimizer is called: a class of a package convert does not know (``Lion(model.parameters())``,
# SAM's ``first_step`` / ``second_step``) is taken for one by what the script calls on it
def _stepped(facts: Facts, call: Call) -> list[str]:
    """The models of ``call``'s first argument (``Lion(model.parameters(), lr=...)``) when its result is bound to a
    name that the script steps (``opt.step()``) and zeroes (``opt.zero_grad()``), or takes SAM's two steps
    through (``first_step``, ``second_step``): an optimizer of any name.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from lion_pytorch import Lion\\nnet = Net()\\nopt = Lion(net.parameters(), lr=1e-4)\\n"
    ...                    "opt.zero_grad()\\nloss.backward()\\nopt.step()\\n"))
    >>> _stepped(facts, next(c for c in facts.calls if c.last == "Lion"))
    ['net']
    """
    if not call.node.args or not _steps(facts, call):
        return []
    return _models(facts, parameters_of(call.node.args[0].value))


def _steps(facts: Facts, call: Call) -> bool:
    """What ``call`` returns is stepped and zeroed (or taken SAM's two steps through) by the script, and ``call``
    is none of torch's optimizers (nor a gradient clip): an optimizer of another name."""
    if optimizer(call) or call.last in ("clip_grad_norm_", "clip_grad_value_"):
        return False
    called = _called_on_result(facts, call)
    # (LSTNet's ``optim = Optim(model.parameters(), ...)``, stepped, with ``model.zero_grad()`` instead)
    handed = bool(call.node.args) and bool(parameters_of(call.node.args[0].value)) and not _fed_step(facts, call)
    return {"step", "zero_grad"} <= called or {"first_step", "second_step"} <= called or "step" in called and handed


def _fed_step(facts: Facts, call: Call) -> bool:
    """A ``step(...)`` on what ``call`` returns is handed parameters (an EMA's ``ema.step(student.parameters())``):
    an average that follows a model, no optimizer."""
    bound = next((b for b in facts.bindings if b.value is call.node), None)
    return bound is not None and any(
        c.last == "step" and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == bound.target
        and any(parameters_of(a.value) for a in c.node.args) for c in facts.calls)


def _handed_out(facts: Facts, call: Call) -> list[str]:
    """The model whose own method hands out its optimizer (a tutorial's ``BasicModule.get_optimizer(lr, wd)``:
    ``optimizer = model.get_optimizer(0.01, 0)``), told as :func:`_stepped` tells one: the script steps and zeroes
    what it returns. The method named for it (``optim`` in its name)."""
    func = call.node.func
    if not isinstance(func, cst.Attribute) or "optim" not in call.last.lower() or optimizer(call):
        return []
    owner = dotted(func.value)
    if owner is None:
        return []
    return _models(facts, [owner]) if {"step", "zero_grad"} <= _called_on_result(facts, call) else []


def _called_on_result(facts: Facts, call: Call) -> set[str]:
    """The methods the script calls on the name ``call``'s result is bound to (``opt = ...; opt.step()``)."""
    bound = next((b for b in facts.bindings if b.value is call.node), None)
    if bound is None:
        return set()
    return {c.last for c in facts.calls if isinstance(c.node.func, cst.Attribute)
            and dotted(c.node.func.value) == bound.target}


def _filled(facts: Facts, names: set[str]) -> list[str]:
    """The models whose parameters a loop appends to one of ``names`` (``for n, p in model.named_parameters():
    (no_decay if "bias" in n else decay).append(p)``, then ``AdamW([{"params": decay}, ...])``)."""
    found: list[str] = []
    fills = m.Call(func=m.Attribute(attr=m.Name("append") | m.Name("extend")))
    for loop in m.findall(facts.module, m.For()):
        assert isinstance(loop, cst.For)
        filled: set[str | None] = set()
        for call in m.findall(loop.body, fills):
            assert isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            target = call.func.value  # ``decay.append(p)``, or ``(no_decay if ... else decay).append(p)``
            filled |= names_in(target) if isinstance(target, cst.IfExp) else {dotted(target)}
        for grown in m.findall(loop.body, m.AugAssign(operator=m.AddAssign())):  # ``params += [{'params': [v]}]``
            assert isinstance(grown, cst.AugAssign)
            filled.add(dotted(grown.target))
        if filled & names:
            found += _models(facts, parameters_of(loop.iter))
    return found


def _models(facts: Facts, names: list[str]) -> list[str]:
    """The names a value of the script is bound to: not ``self`` (minGPT's configure_optimizers groups its own
    parameters for a caller), not a comprehension's variable (``for mn, m in self.named_modules()``)."""
    def head(t: str) -> str:  # what is bound: ``model`` of model.fc, ``self.model`` of self.model.fc
        parts = t.split(".")
        return ".".join(parts[:2]) if parts[0] == "self" else parts[0]

    return [t for t in names if t and t != "self" and
            any(b.target == head(t) and b.value is not None for b in facts.bindings)]


# where an optimizer of torch's names comes from besides torch: Hugging Face's AdamW (``from transformers import
# AdamW``, in fine-tuning scripts before transformers 4.46), and the packages of optimizers in torch's names
OPTIMIZER_PACKAGES = ("torch.optim", "transformers", "torch_optimizer", "timm.optim", "bitsandbytes.optim",
                      "optim.")  # (``optim.Adam`` of an ``import torch.optim as optim`` convert does not see: a star
# import of a project module that imports it)


# packages whose every class is an optimizer (``bnb.optim.AdamW8bit``, ``timm.optim.Lamb``)
OPTIMIZER_MODULES = ("bitsandbytes.optim.", "timm.optim.", "torch_optimizer.", "apex.optimizers.")
FACTORIES = ("timm.optim.create_optimizer_v2", "timm.optim.create_optimizer")  # (model, ...): its parameters


def optimizer(call: Call) -> bool:
    name = call.name or ""
    return call.last in OPTIMIZERS and name.startswith((*OPTIMIZER_PACKAGES, call.last)) or \
        name.startswith(OPTIMIZER_MODULES) and call.last[:1].isupper() or _by_name(call.node)


def _by_name(node: cst.Call) -> bool:
    """``getattr(torch.optim, args.optimizer)(model.parameters(), ...)``: an optimizer picked by name."""
    func = node.func
    return isinstance(func, cst.Call) and dotted(func.func) == "getattr" and bool(func.args) and \
        (dotted(func.args[0].value) or "") in ("optim", "torch.optim")


def trained(call: Call) -> list[str]:
    """The models an optimizer call trains: ``M`` of ``Adam(M.parameters())`` (``M.fc.parameters()``,
    ``filter(..., M.parameters())``, parameter groups, ``list(a.parameters()) + list(b.parameters())``: each) or
    of ``M.configure_optimizers(...)``; ``[""]``: a model built in the call itself (``SGD(Net().parameters())``)."""
    if call.last == "configure_optimizers" and isinstance(call.node.func, cst.Attribute):
        return [dotted(call.node.func.value) or ""]
    if (call.name or "") in FACTORIES and call.node.args:  # timm's create_optimizer_v2(model, "adamw", ...)
        return [dotted(call.node.args[0].value) or ""]
    if not optimizer(call) and call.last != "add_param_group":  # (``opt.add_param_group({"params": peer.
        return []  # parameters()})``: the peer is trained too)
    found: list[str] = []
    for arg in call.node.args:
        found += parameters_of(arg.value)
    return list(dict.fromkeys(found))


def by_hand(facts: Facts, call: Call) -> list[str]:
    """The model whose ``.parameters()`` ``call`` hands to a loop that steps each by its gradient, no optimizer
    (``for p in model.parameters(): p -= lr * p.grad``, ``p.data.add_(p.grad, alpha=-lr)``: Zaremba's LSTM, course
    homework; set 28: never prepared, each rank trained a model of its own).

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("for p in net.parameters():\\n    p.data -= 0.1 * p.grad\\n"
    ...                "for q in net.parameters():\\n    q.requires_grad = False\\n"))
    >>> [by_hand(f, c) for c in f.calls if c.last == "parameters"]
    [['net'], []]
    """
    loop = next((lp.node for lp in facts.loops if isinstance(lp.node, cst.For) and lp.node.iter is call.node), None)
    if loop is None or not isinstance(loop.target, cst.Name):
        return []
    p = loop.target.value
    graded = {f"{p}.grad", f"{p}.grad.data"}
    stepped = any(isinstance(a, cst.AugAssign) and dotted(a.target) in (p, f"{p}.data") and
                  names_in(a.value) & graded for a in m.findall(loop.body, m.AugAssign())) or any(
        # (``p.data = p.data - lr * p.grad.data``: review 44)
        isinstance(a, cst.Assign) and any(dotted(t.target) == f"{p}.data" for t in a.targets) and
        names_in(a.value) & graded for a in m.findall(loop.body, m.Assign())) or any(
        isinstance(c, cst.Call) and isinstance(c.func, cst.Attribute) and c.func.attr.value in ("add_", "sub_",
                                                                                                  "copy_")
        and dotted(c.func.value) in (p, f"{p}.data") and any(names_in(a.value) & graded for a in c.args)
        for c in m.findall(loop.body, m.Call()))
    return [name for name in parameters_of(call.node) if name] if stepped else []


def parameters_of(node: cst.CSTNode) -> list[str]:
    """``M`` of every ``M.parameters()`` / ``M.named_parameters()`` in ``node``, in the order a visit meets them
    ("" for one built in place)."""
    # (``model[0].parameters()``: a part of ``model``, set 27's layer-wise groups; not one built in place)
    return [part_of(call.func.value) or "" for call in m.findall(node, m.Call())
            if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and (call.func.attr.value in ("parameters", "named_parameters") or _params_method(call.func.attr.value))]


def _params_method(name: str) -> bool:
    """A model's own method that yields some of its parameters (deeplab's ``get_1x_lr_params()``,
    ``get_10x_lr_params()``, a ``trainable_parameters()``), handed to an optimizer as a parameter group.

    >>> _params_method("get_1x_lr_params"), _params_method("trainable_parameters"), _params_method("num_params")
    (True, True, False)
    """
    return name.endswith(("_params", "_parameters")) and name.startswith(("get_", "trainable", "backbone", "head",
                                                                           "decoder", "encoder", "optim"))
