"""A model handed to another module of the project: ``main.py`` builds ``model`` and calls ``train_model(model,
loader, device)`` of ``trainer.py``, whose optimizer trains its parameter. ``trainer.py`` cannot wrap a parameter;
it asks (:data:`~ddpkit.commands.convert.crossing.HANDED_MODEL`) every file that imports it, and each that calls
``train_model`` wraps what it passes, where that is built (:func:`wrap_passed`). Converted alone, the trainer's
line is left to you, as before.

Example::

    >>> from ddpkit.commands.convert.crossing import settle
    >>> from ddpkit.commands.convert.plan import plan
    >>> files = {"trainer.py": "import torch\\ndef fit(net):\\n    opt = torch.optim.SGD(net.parameters(), lr=1)\\n",
    ...          "main.py": "import torch\\nfrom trainer import fit\\nmodel = torch.nn.Linear(2, 2)\\nfit(model)\\n"}
    >>> done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    >>> done["main.py"].text.splitlines()[-2], done["trainer.py"].left
    ('model = ddpkit.prepare_model(torch.nn.Linear(2, 2))', [])
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.crossing import HANDED_MODEL, Ask, key
from ddpkit.commands.convert.flow import argument_for, binding_of, callee, callers
from ddpkit.commands.convert.handedin import given_as
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Call
from ddpkit.commands.convert.trained import parameters_of

_Work = Any  # the plan in the making (plan._Work)
INITS = ("apply",)  # a call that sets a model's weights in place (not a load: every rank reads the same file)


def ask(work: _Work, target: str, call: Call) -> bool:
    """The optimizer ``call`` trains ``target``, a parameter of a plain function that no line of this file calls:
    said done where a file that calls it wrapped what it passes; else asked of the project and left to you. False
    for any other target."""
    head, scope = target.split(".")[0], call.scope
    # (a class's ``__init__`` handed the models it trains, a DCGAN project's ``Trainer(gen=G, dis=D)``: asked as
    # ``Trainer``, the call that runs it, by position after ``self``)
    built = scope.cls is not None and scope.name == f"{scope.cls}.__init__"
    if head not in scope.params or not scope.name or scope.cls and not built or head == "self" or \
            callers(work.facts, scope):
        return False
    index = scope.params.index(head) - (1 if built else 0)
    name = f"{HANDED_MODEL}:{scope.cls if built else scope.name}:{index}={head}"  # (its position, or by name)
    where = work.crossing.provided.get(key("", name))
    work.asks.append(Ask("", name, "model", call.line))  # whatever the answer: settle asks in rounds
    inits = [c for c in work.facts.calls if c.scope is scope and c.line <= call.line and c.last in INITS and
             isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == head]
    if where is not None and inits:  # (a DCGAN project's ``self.generator = generator.apply(weights)``: set 26)
        held = next((b.target for b in work.facts.bindings if b.value is inits[0].node), None)
        fix = f"{held} = ddpkit.prepare_model({work.facts.code(inits[0].node)}) there, the optimizer over " \
            f"{held}.parameters()" if held else f"{head} = ddpkit.prepare_model({head}) right below it"
        work.leave(inits[0].line, f"{head}.{inits[0].last}(...) sets the weights of the model {where} prepared and "
                   "hands in: each rank would set its own after the wrap made them equal (the launch stops at "
                   "the first step: ranks start different)", f"prepare it here instead: {fix}, and leave it "
                   "unwrapped where it is built")
        return True
    if where is not None:
        work.keep(call.line, f"the optimizer over {head} left as it is", f"{head} is handed in by {where}, "
                  "which prepares the model it passes where it is built")
        return True
    elsewhere = work.crossing.elsewhere if work.crossing is not None else None
    # (a class's __init__ runs where the class is named: ``dcgan(nn.Linear(4, 8), ...)`` of ``DCGAN as dcgan``)
    called = scope.cls if built else scope.name.rsplit(".", 1)[-1]
    if elsewhere is not None and called not in elsewhere:  # (AGCRN's unused init_optim)
        work.keep(call.line, f"the optimizer over {head} in {scope.name}(), which no file of the project calls, left "
                  "as it is", "nothing runs it here; a caller outside the project should pass a model it wrapped "
                  "where it is built: ddpkit.prepare_model(...)")
        return True
    work.leave(call.line, f"the model {target!r} this optimizer trains is a parameter of {scope.name}(), which no "
               "line of this file calls", "convert it with the file that calls it (ddpkit convert --imports "
               "SCRIPT, or a folder), or wrap the model there where it is built: model = ddpkit.prepare_model("
               "...)", blocks=True)
    return True


def wrap_passed(work: _Work, want: str) -> None:
    """``module.function:index=name`` (a want of this file): wrap what this file's calls of that imported function
    pass as argument ``index`` or ``name=``, where it is built; said done when every such call's argument was."""
    function, index = want.rsplit(":", 1)
    index, _, param = index.partition("=")  # (``fit(model=net, ...)``: passed by name)
    calls = [c for c in work.facts.calls if resolve(dotted(c.node.func), work.facts.aliases) == function]
    bindings = []
    for c in calls:
        given = given_as(c, int(index), param)
        name = dotted(given) if given is not None else None
        bound = binding_of(work.facts, name, c.scope, c.line) if name else None
        if bound is None or bound.value is None and bound.whole is None:  # (``model, crit = set_model()``: built)
            return
        bindings.append(work._unconditional(work._source(bound)))
    for binding in bindings:
        if any(b is binding for b in work.models) or work._wrap(binding, None):
            work.models.append(binding)
    if bindings and all(any(b is binding for b in work.models) for binding in bindings):
        work.done.append(want)


def passed_here(work: _Work, target: str, call: Call) -> list[tuple[Call, list[str]]]:
    """The calls of this file that hand ``call``'s function the parameters its optimizer trains (AdaBound's
    ``create_optimizer(args, net.parameters())``, whose ``optim.Adam(model_params, ...)`` trains ``model_params``):
    each with the models of what it passes (``net``); [] when ``target`` is no parameter of a function this file
    calls."""
    scope = call.scope
    if target not in scope.params or not scope.name:
        return []
    # (``train_model(model, loader)``, whose ``Adam(model.parameters())`` trains the model itself: what each call
    # passes is the model, built in each caller, an LSTM notebook's two experiments)
    whole = target in parameters_of(call.node)
    found = []
    for site in work.facts.calls:
        made = callee(work.facts, site)
        if made is None or made[0] is not scope:
            continue
        arg = argument_for(site, target, scope, made[1])
        name = dotted(arg) if whole and isinstance(arg, (cst.Name, cst.Attribute)) else None
        found.append((site, [name] if name else parameters_of(arg) if arg is not None else []))
    return found
