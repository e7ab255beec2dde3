"""A training loss taken from a method of the prepared model (pytorch-flows' ``loss = -model.log_probs(x).mean()``):
the method is named in ``prepare_model(..., forward_methods=(...))``, so that it runs as DDP's forward.

Outside DDP's forward its graph has no reduction prepared: each rank would train its own model (ddpkit's first step
stops it). Only a method whose result the loss that the training loop backwards is made from, followed through the
loop's own assignments (``out = model.decode(x)``, ``loss = crit(out, y)``) and fed with the batch: a set-up call
(``init_hidden(bsz)``) stays the plain method.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\nnet = Flow()\\n"
    ...             "opt = torch.optim.Adam(net.parameters())\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...             "    loss = -net.log_probs(x).mean()\\n    opt.zero_grad()\\n    loss.backward()\\n"
    ...             "    opt.step()\\n").text
    >>> text.splitlines()[3]
    "net = ddpkit.prepare_model(Flow(), forward_methods=('log_probs',))"
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import batchnames, flow
from ddpkit.commands.convert.apply import keyword_on_wraps
from ddpkit.commands.convert.names import dotted, names_in

# the plan in the making (plan._Work): facts, models, note
_Work = Any


def loss_methods(work: _Work) -> dict[str, list[str]]:
    """{a prepared model's name: the methods of it the training losses are made from}, each said once."""
    models = {b.target for b in work.models}
    found: dict[str, list[str]] = {}
    said: set[tuple[str, str]] = set()
    for loop in work.facts.loops:
        if not flow.trains(work.facts, loop):
            continue
        for call in (c for c in work.facts.calls if c.last == "backward" and c.loops and c.loops[-1] is loop
                     and isinstance(c.node.func, cst.Attribute)):
            for owner, method, line, outputs in _made_from(work, loop, call):
                held = _attribute_of(work, owner, method) if owner in models else None
                named = any(w in method.lower() for w in LOSS_NAMES)
                if held is None and named and outputs:  # (a class this file cannot see: a GAN book's two)
                    held = "a criterion on its outputs"  # ``netD.adv_loss(netD(x), real)``: no forward to name
                loss = held is not None and (held.endswith(LOSSES) or named)
                if held is not None and not loss and (owner, method) not in said:
                    said.add((owner, method))  # (a layer the model holds, called on the module: outside DDP)
                    work.leave(line, f"{owner}.{method}(...) makes the loss: {method} is a layer {owner} holds "
                               f"({held}(...)), called outside its forward, which DDP does not see (each rank would "
                               "train its own copy; the first step stops it)", f"call {owner}.{method} inside "
                               f"{owner}'s forward (or a method of its class), then convert again")
                if owner in models and method not in found.get(owner, []) and held is None:
                    found.setdefault(owner, []).append(method)
                    work.note(f"{owner}.{method}(...) makes the loss: forward_methods=({method!r},) given to "
                              f"the wrap of {owner}", NAMED, line)
    _called_elsewhere(work, found)
    return found


NAMED = "it then runs as DDP's forward and its gradients are averaged (a method called on the module alone runs " \
    "outside DDP)"


def _called_elsewhere(work: _Work, found: dict[str, list[str]]) -> None:
    """A loss method of a prepared model's class of this file that another file of the project calls (set 29: main.py
    hands the model to training.py's ``train(model, ...)``, which backwards ``model.loss(batch)``): named in
    ``forward_methods`` as a loop of this file would have it."""
    elsewhere = work.crossing.elsewhere if work.crossing is not None else None
    if not elsewhere:
        return
    for b in work.models:
        cls = _class_of(work, b.target)
        # (one that runs ``self(x)`` too: called on the wrapper, it reaches the module's forward outside DDP's;
        # named, DDP's forward runs it: review 45)
        methods = [n.rsplit(".", 1)[-1] for n in work.facts.scopes if cls is not None and n.rpartition(".")[0] == cls]
        for method in methods:
            if method in elsewhere and any(w in method.lower() for w in LOSS_NAMES) and \
                    method not in found.get(b.target, []):
                found.setdefault(b.target, []).append(method)
                work.note(f"{b.target}.{method}(...) makes the loss in another file: forward_methods=({method!r},) "
                          f"given to the wrap of {b.target}", NAMED, b.line)


def forward_called(work: _Work) -> None:
    """``model.forward(x)`` of a prepared model -> ``model(x)``: the call runs the module's hooks, which ``forward``
    skips (DDP's own forward runs either way); one process then runs the same path as N (set 29: verify's
    dropout-off hooks ran in the N-process run only, a false FAIL).

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nfrom torch.utils.data import DataLoader\\nnet = torch.nn.Linear(2, 2)\\n"
    ...             "opt = torch.optim.SGD(net.parameters(), lr=1)\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...             "    net.forward(x).sum().backward()\\n    opt.step()\\n").text
    >>> text.splitlines()[-2]
    '    net(x).sum().backward()'
    """
    models = {b.target for b in work.models}
    for call in work.facts.calls:
        func = call.node.func
        if call.last == "forward" and isinstance(func, cst.Attribute) and dotted(func.value) in models:
            work.edits.expr[id(func)] = lambda node: node.value
            work.note(f"{dotted(func.value)}.forward(...) -> {dotted(func.value)}(...)", "a call of the model runs "
                      "its hooks, which .forward skips: one process and N then run the same path", call.line)


def self_trained(work: _Work) -> None:
    """List a training loop written as a method of the prepared model's own class (``class Net(nn.Module): def
    fit(self, loader): ... out = self(x)``, called ``model.fit(loader)``): ``self`` there is the plain module, its
    forward outside DDP, so each rank would train its own copy (ddpkit's first step stops it).

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nfrom torch.utils.data import DataLoader\\nclass Net(torch.nn.Linear):\\n"
    ...         "    def fit(self, opt, ds):\\n        for x in DataLoader(ds, batch_size=8, shuffle=True):\\n"
    ...         "            self(x).mean().backward()\\n            opt.step()\\nnet = Net(2, 2)\\n"
    ...         "net.fit(torch.optim.SGD(net.parameters(), lr=0.1), ds)\\n")
    >>> [(left.line, left.what[:48]) for left in plan(text).left]
    [(5, 'the training loop of Net.fit runs the model as s')]
    """
    classes = {cls for b in work.models if (cls := _class_of(work, b.target)) is not None}
    for loop in work.facts.loops:
        if loop.scope.cls not in classes or loop.outer or not flow.trains(work.facts, loop):
            continue
        method = loop.scope.name
        run = any(c.last == method.split(".")[-1] and isinstance(c.node.func, cst.Attribute) for c in
                  work.facts.calls)  # (``model.fit(...)``: a method no line calls trains nothing here)
        if run and any(dotted(c.node.func) in ("self", "self.forward") for c in loop.calls):
            work.leave(loop.line, f"the training loop of {method} runs the model as self(...): a method of the "
                       "model's own class, called on the prepared model, runs the plain module outside DDP's forward "
                       "(each rank would train its own copy; the first step stops it)", "move the loop out of the "
                       f"class into a function handed the model (def {method.split('.')[-1]}(model, ...), model(x) "
                       "for self(x)), call it with the prepared model, then convert again")


def _class_of(work: _Work, owner: str) -> str | None:
    """The class of the script a prepared model is built from (``Gan`` of ``Gan().to(device)``), or None."""
    made: Any = next((b.value for b in work.models if b.target == owner), None)
    while isinstance(made, cst.Call) and (dotted(made.func) == "ddpkit.prepare_model" and made.args or
                                          isinstance(made.func, cst.Attribute) and
                                          made.func.attr.value in ("to", "cuda", "cpu")):  # (``Gan().to(device)``)
        func: Any = made.func
        made = made.args[0].value if dotted(func) == "ddpkit.prepare_model" else func.value
    return dotted(made.func) if isinstance(made, cst.Call) else None


def _attribute_of(work: _Work, owner: str, name: str) -> str | None:
    """What the model's class of this file sets ``self.<name>`` to (``nn.CrossEntropyLoss`` of a lesson's
    ``self.criterion = nn.CrossEntropyLoss().to(device)``), where ``name`` is no method it defines: no forward
    method to name (prepare_model refuses an attribute: review 26); None where it is a method, or not known."""
    cls = _class_of(work, owner)
    if cls is None or f"{cls}.{name}" in work.facts.scopes:
        return None
    for b in work.facts.bindings:
        value = b.value if b.value is not None else _element(b)  # (``self.gen, self.disc = A(), B()``)
        if b.target == f"self.{name}" and b.scope.cls == cls and value is not None:
            while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and \
                    value.func.attr.value in ("to", "cuda", "cpu") and isinstance(value.func.value, cst.Call):
                value = value.func.value  # (``nn.CrossEntropyLoss().to(device)``)
            # (a criterion handed to ``__init__``, ``self.criterion = criterion``: named by what it is bound from)
            return dotted(value.func) or "a call" if isinstance(value, cst.Call) else dotted(value) or "a value"
    return None


def _element(binding: Any) -> Any:
    """The element an unpacked binding takes from a tuple written out (``a, b = A(), B()``), else None."""
    whole = binding.whole
    if isinstance(whole, cst.Tuple) and 0 <= binding.index < len(whole.elements):
        return whole.elements[binding.index].value
    return None


# what names a criterion (no parameters): a model's attribute of one is called on the module rightly
LOSSES = ("Loss", "Criterion", "Entropy", "loss", "criterion")
LOSS_NAMES = ("loss", "criterion", "crit")  # (an attribute so named: ``self.criterion = SmoothedCE()``, review 26)


def _made_from(work: _Work, loop: Any, backward: Any) -> list[tuple[str, str, int, bool]]:
    """(model, method, line, on its outputs) of each ``model.method(...)`` in the loss ``backward`` is called on,
    followed through the assignments of the loop (three deep); on its outputs: an argument is what a call of the
    model itself returned in the loop (``y = netD(x)``, then ``netD.adv_loss(y, real)``)."""
    facts = work.facts
    frontier = names_in(backward.node.func.value)
    seen: set[str] = set()
    found: list[tuple[str, str, int, bool]] = []
    inside = {id(n) for n in m.findall(loop.node, m.SimpleStatementLine())}
    batch = _batch_names(work, loop, inside)
    outputs = {(dotted(v.func), b.target) for b in facts.bindings if id(b.stmt) in inside and
               isinstance(v := b.value if b.value is not None else b.whole, cst.Call)}
    raw = batchnames.batch_names(facts, loop)  # (``x = x.to(d)``: what the model's own forward may read)
    for _ in range(3):
        # (``mean, log_var = model.encoding(x)``: an unpacked binding's whole value)
        values = [(b, b.value if b.value is not None else b.whole) for b in facts.bindings if b.target in
                  frontier - seen and id(b.stmt) in inside and (b.value or b.whole) is not None and
                  b.line <= backward.line]
        seen |= frontier
        frontier = set()
        for binding, value in values:
            for call in m.findall(value, m.Call(func=m.Attribute())):
                assert isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                owner, method = dotted(call.func.value), call.func.attr.value
                fed = set().union(*(names_in(a.value) for a in call.args)) if call.args else set()
                if owner and method not in flow.TORCH_METHODS and not method.startswith("_") and fed & batch:
                    # (on its outputs only: a method fed what the model's own forward reads, ``consistency_loss(
                    # target, x)``, may run the layers: review 33's self-distillation; labels are no input)
                    inputs = {n for c in m.findall(loop.node, m.Call()) if isinstance(c, cst.Call) and
                              dotted(c.func) == owner for a in c.args for n in names_in(a.value)} & raw
                    found.append((owner, method, binding.line,
                                  any((owner, n) in outputs for n in fed) and not fed & inputs))
            frontier |= names_in(value)
    return found


def _batch_names(work: _Work, loop: Any, inside: set[int]) -> set[str]:
    """What the loop's batch is bound to (``for x, y in loader``), and the names the loop binds from those
    (``x = x.to(device)``): a method fed with the batch runs the layers on it (``init_hidden(bsz)`` is not fed)."""
    names = set(loop.targets)
    for _ in range(2):
        names |= {b.target for b in work.facts.bindings if id(b.stmt) in inside and (b.value or b.whole) is not None
                  and names_in(b.value if b.value is not None else b.whole) & names}
    return names


def name_methods(text: str, methods: dict[str, list[str]]) -> str:
    """``model = ddpkit.prepare_model(...)`` in the converted ``text`` gets ``forward_methods=(...)``."""
    return keyword_on_wraps(text, "forward_methods", {target: "(" + ", ".join(repr(n) for n in names) + ",)"
                                                      for target, names in methods.items()})
