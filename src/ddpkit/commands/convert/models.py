"""The model of a script: what its optimizers train, and where ``ddpkit.prepare_model`` wraps it.

The plan (:mod:`ddpkit.commands.convert.plan`) asks for each optimizer's model: built here (wrapped where it is
built or moved), imported from another module of the project (asked of it), held in a list, a plain object or a
base class, handed in as a parameter. A model moved again under an ``if`` is wrapped at its build outside the
``if``; an alias (``net = self.model``) at its source; a ``model.to(device)`` line becomes the wrap.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nmodel = Net()\\nmodel.to('cpu')\\nopt = torch.optim.SGD(model.parameters(), lr=1)\\n")
    >>> [e.what for e in p.edits if 'prepare_model' in e.what]
    ['model.to(...) -> model = ddpkit.prepare_model(model)']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import (
    branches,
    crossing,
    handed,
    holders,
    inherited,
    inits,
    listed,
    parallel,
    parts,
    rules,
    stepped,
    trained,
    unusedlayers,
)
from ddpkit.commands.convert.crossing import MODEL, Ask
from ddpkit.commands.convert.flow import argument_for, binding_of, callee, part_of
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Binding, Call

_Work = Any  # the plan in the making (plan._Work)


def models(work: _Work) -> None:
    held = parts.containers(work)  # (a GAN class's generator and discriminator, each its own optimizer's)
    for head, pairs in held.items():
        parts.wrap_parts(work, head, pairs)
    for call in work.facts.calls:
        for target in trained.trained_all(work.facts, call):
            if target.split(".")[0] not in held:
                _model_of(work, target, call)
    for name, kind in work.crossing.wants.items():
        if kind == MODEL and ":" in name:  # a model this file hands to a function of another (handed.py)
            handed.wrap_passed(work, name)
        elif kind == MODEL:
            _wanted_model(work, name)

def _wanted_model(work: _Work, name: str) -> None:
    """A module-level model that an optimizer in another module of the project trains: wrapped here."""
    if any(b.target == name for b in work.models):  # prepared here already, for an optimizer of this module
        work.done.append(name)
        return
    bound = [b for b in work.facts.bindings if b.target == name and b.scope.name == "" and b.value is not None
             and not (isinstance(b.value, cst.Name) and b.value.value == "None")]  # (``model = None``: not built)
    found = inherited.wanted(work.facts, name)  # ``Exp_Basic.self.model``: a base class's
    if isinstance(found, list):  # built by a base class of another module: asked of it in turn
        inherited.asks(work, found, 1)
        if any(crossing.key(*f) in work.crossing.provided for f in found):
            work.done.append(name)
        return
    bound += [found] if found is not None else []
    bound += filter(None, [holders.wanted(work.facts, name)])  # ``Analyzer().model``: a plain object's
    if not bound:
        return
    binding = unconditional(work, source(work, bound[-1]))
    if any(b is binding for b in work.models) or wrap(work, binding, None):
        work.models.append(binding)
        work.done.append(name)

def _model_of(work: _Work, target: str, call: Call) -> None:
    if holders.holder(work, target, call):  # ``analyzer.model`` of a plain object: where its class builds it
        return
    binding = model_binding(work, target, call) if target else None
    if binding is None and not target:
        work.leave(call.line, "the model this optimizer trains is built inside the optimizer call",
                   "build it first: model = ddpkit.prepare_model(Net()), then the optimizer over "
                   "model.parameters()", blocks=True)
    elif binding is None and (origin := imported_from(work.facts, target)):
        # the wrap belongs in the other module; asked of it when the project is converted together
        (module, name), head = origin, target.split(".")[0]
        work.asks.append(Ask(module, name, MODEL, call.line))  # whatever the answer: settle asks in rounds
        if crossing.key(module, name) in work.crossing.provided:
            work.keep(call.line, f"the optimizer over {head} left as it is", f"{head} is prepared where it is "
                      f"built, in {work.crossing.provided[crossing.key(module, name)]} (imported from {module})")
            return
        work.leave(call.line, f"the model {target!r} this optimizer trains is imported from {module}, and "
                   "convert does not follow a name from one module to another outside a project", "convert "
                   f"them together (ddpkit convert --imports SCRIPT, or a folder), or wrap it in {module} "
                   f"where it is built: {head} = ddpkit.prepare_model(...)")
    elif binding is None and (held := listed.listed(work, target, call)):  # ``for m in models``: each
        if isinstance(held, Binding) and all(b is not held for b in work.models):  # blocks of a model: it
            work.models.append(held)
            wrap(work, held, call)
    elif binding is None and handed.ask(work, target, call):  # a parameter: the files that call it wrap it
        pass
    elif binding is None and (sites := handed.passed_here(work, target, call)) and all(t for _, t in sites):
        for site, models in sites:  # ``create_optimizer(lr, net.parameters())``: what each call passes
            for model in models:
                _model_of(work, model, site)
    elif binding is None and target == "self" and _handed_out(call) and not any(
            c.last == "backward" and c.scope.cls == call.scope.cls for c in work.facts.calls):
        # a method that returns the model's optimizer and no training in the class: the script steps it
        work.keep(call.line, "an optimizer the model's own method makes over self.parameters() left as it is",
                  "the class does not train itself: the script that calls the method prepares the model, and "
                  "the method, called through the wrapper, makes it over the same parameters")
    elif binding is None and target == "self" and work.crossing is not None and \
            stepped.unreached(work.facts, call.scope, work.crossing.elsewhere, work.crossing.imported):
        work.keep(call.line, f"an optimizer {call.scope.cls or call.scope.name} makes over self.parameters() left as "
                  "it is", "no file of the project builds that class: nothing runs it")
    elif binding is None and target == "self":  # a module that owns its optimizer
        work.leave(call.line, "the model this optimizer trains is the class itself (an optimizer over "
                   "self.parameters(), made in its own method)", "build the optimizer outside the class, over "
                   "the prepared model: model = ddpkit.prepare_model(Net()); opt = torch.optim.Adam(model."
                   "parameters()); and take the step where model(x) is called, through the wrapper (a "
                   "backward inside the class's own methods is not synchronised), then convert again",
                   blocks=True)
    elif binding is None and (base := inherited.inherited(work.facts, target, call)) is not None:
        inherited.wrap(work, base, call, inherited.attribute(target) or target)
    elif binding is None:
        work.leave(call.line, f"the model {target!r} this optimizer trains: where it is built was not "
                   "found", f"wrap it yourself where it is built: {target} = ddpkit.prepare_model("
                   f"{target})", blocks=True)
    elif _collection(binding):  # (``nets = [G, D]``, then ``Adam(nets[0].parameters())``: review 43)
        work.leave(call.line, f"the optimizer trains a part of {binding.target}, a collection of models: "
                   "prepare_model wraps one model", f"prepare each model where it is built ({binding.target}'s "
                   "elements: G = ddpkit.prepare_model(G)) and build the optimizer over that one's parameters, then "
                   "convert again", blocks=True)
    elif all(b is not binding for b in work.models):
        work.models.append(binding)
        wrap(work, binding, call)

def _collection(binding: Binding) -> bool:
    """A Python list, tuple or dict of models (``[G, D]``), not one model (an ``nn.ModuleList`` is a module
    prepare_model wraps as one)."""
    return isinstance(binding.value, (cst.List, cst.Tuple, cst.Dict))


def model_binding(work: _Work, target: str, call: Call) -> Binding | None:
    parts = target.split(".")
    for end in range(2 if parts[0] == "self" else 1, len(parts) + 1):  # model.fc.parameters(): model
        binding = binding_of(work.facts, ".".join(parts[:end]), call.scope, call.line)
        for _ in range(3):  # (SCINet's ``self.model, lr, e = load_model(self.model, path)`` under ``if resume``)
            if binding is None or not _reloaded(binding):
                break
            binding = binding_of(work.facts, binding.target, binding.scope, binding.line - 1)
        if binding is not None and _built(binding):
            return unconditional(work, source(work, binding))
    return None

def unconditional(work: _Work, binding: Binding) -> Binding:
    """A model moved again under an ``if`` (``if use_gpu: model = model.cuda()``) that a binding before it, outside
    that ``if``, built: that one is wrapped (a wrap under the ``if`` leaves the model unwrapped wherever the test
    is false: each rank then trains its own copy). A new model bound under the ``if`` stays: :mod:`.branches`
    prepares it below the ``if``."""
    guard = work._guard(binding.stmt)
    while guard is not None:
        earlier = binding_of(work.facts, binding.target, binding.scope, binding.line - 1)
        if earlier is None or not _built(earlier) or within(earlier.stmt, guard):
            return binding
        bare = parallel.inner(binding.value, work.facts.aliases)
        if bare is None or dotted(rules.without_moves(bare)) != binding.target:
            return binding  # ``if args.pretrained: net = load(p)``: another model, prepared below the if
        binding = source(work, earlier)
        guard = work._guard(binding.stmt)
    return binding

def source(work: _Work, binding: Binding, depth: int = 0) -> Binding:
    """Where an alias (``model, config = self.model, self.config``) got its value: the model is wrapped
    where it is built or moved, once, not in every method that reads it."""
    bare = parallel.inner(binding.value, work.facts.aliases)  # model = DataParallel(model): the one before
    alias = part_of(bare)  # ``head = model[-1]``, ``head = model.fc``: a part of the model, which is wrapped
    if alias is None or alias == binding.target and bare is binding.value or depth >= 4:
        return binding
    parts = alias.split(".")
    for end in range(len(parts), 1 if parts[0] == "self" else 0, -1):
        found = binding_of(work.facts, ".".join(parts[:end]), binding.scope, binding.line - 1)
        if found is not None and _built(found):
            return source(work, found, depth + 1)
    return binding

def wrap(work: _Work, binding: Binding, optimizer: Call | None) -> bool:
    """Wrap the model ``optimizer`` trains (None: an optimizer of another module) where ``binding`` builds it;
    False where it is left to the user instead."""
    value = binding.value  # None: one of several names a call's result is unpacked to (net, name = f())
    aliases = work.facts.aliases
    if _prepared(value, aliases) or any(_prepared(b.value, aliases) for b in work.facts.bindings
                                        if b.target == binding.target and b.value is not None):
        return True  # converted already
    until = optimizer.line if optimizer is not None else max((c.line for c in work.facts.calls), default=0)
    moves = [c for c in work.facts.calls if c.scope is binding.scope and c.last in ("to", "cuda")
             and binding.line < c.line <= until and c.stmt is not None
             and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == binding.target
             and len(c.stmt.body) == 1 and isinstance(c.stmt.body[0], cst.Expr)
             and work._guard(c.stmt) is work._guard(binding.stmt)]  # not one under an `if` of its own
    unread = _unread_device(work, [n for n in (value, *(c.node for c in moves)) if n is not None], binding)
    if unread is not None:
        work.leave(binding.line, f"the model moves to {unread.target}, set up at line {unread.line} in a form "
                   "convert does not read: prepare_model would put it on ddpkit's device and the data would "
                   f"go to {unread.target}", f"write {unread.target} = torch.device('cuda' if "
                   "torch.cuda.is_available() else 'cpu') (or with your own switch), then convert again",
                   blocks=True)
        return False
    if _at_data_parallel(work, binding, until):  # ``if a: m = A() elif b: m = B()``, then ``m = DataParallel(m)``
        return True
    if branches.place(work, binding, optimizer):  # ``if resume: net = ckpt['net'] else: net = Net()``: below the if
        return True
    if inits.place(work, binding, moves):  # ``netG.apply(weights_init)`` below the build: the wrap below it
        return True
    spare = unusedlayers.unused(work.facts, value)  # (layers no forward reaches: DDP told to look for them)
    extra = ", find_unused_parameters=True" if spare else ""
    if spare:
        work.note(f"{binding.target}'s wrap told find_unused_parameters=True", f"{', '.join(spare)} "
                  "is built and no forward reaches it: its parameters get no gradient, which DDP stops at unless "
                  "told (or delete the layer)", binding.line)
    if moves:  # ``model.to(device)`` on its own line: that line becomes the wrap
        move = moves[-1]
        work.edits.replace[id(move.stmt)] = [f"{binding.target} = ddpkit.prepare_model({binding.target}{extra})"]
        work.note(f"{binding.target}.{move.last}(...) -> {binding.target} = ddpkit.prepare_model("
                  f"{binding.target})", "prepare_model moves it to this rank's device, converts BatchNorm to "
                  "SyncBatchNorm and wraps it in DDP", move.line)
        return True
    if value is None:  # ``net, name = get_network()``: the wrap on the line below
        assert binding.stmt is not None
        work.edits.after.setdefault(id(binding.stmt), []).append(
            f"{binding.target} = ddpkit.prepare_model({binding.target})")
    elif _moved_alias(work, binding, value) is not None:  # ``model = MODEL.to(d)``, then MODEL trained on
        alias = _moved_alias(work, binding, value)
        assert binding.stmt is not None
        work.edits.replace[id(binding.stmt)] = [f"{binding.target} = {alias} = ddpkit.prepare_model({alias})"]
    else:
        # (after an edit of the same node: ``nn.DataParallel(Net().to(device))``, undone to its module first)
        before = work.edits.expr.get(id(value), lambda node: node)
        work.edits.expr[id(value)] = lambda node: cst.parse_expression(
            f"ddpkit.prepare_model({work.facts.module.code_for_node(rules.without_moves(before(node)))}{extra})")
    trains = f"the optimizer at line {optimizer.line}" if optimizer is not None else "an optimizer in " \
        "another module of the project"
    if optimizer is not None and optimizer.last == "parameters":  # (``for p in model.parameters(): p -= ...``)
        trains = f"the update by hand at line {optimizer.line}"
    work.note(f"{binding.target} = ddpkit.prepare_model(...)", f"the model {trains} trains: prepare_model moves "
              "it to this rank's device, converts BatchNorm and wraps it in DDP", binding.line)
    return True

def _moved_alias(work: _Work, binding: Binding, value: cst.BaseExpression) -> str | None:
    """``model = MODEL.to(DEVICE)`` with ``MODEL`` read below (TextAugmentation-GPT2 hands ``MODEL`` to its
    loop): ``.to()`` returns the same module, so both names are the model; the wrap binds both."""
    inner = rules.without_moves(value)
    if inner is value or not isinstance(inner, cst.Name) or inner.value == binding.target or \
            binding.stmt is None or len(binding.stmt.body) != 1 or not isinstance(binding.stmt.body[0], cst.Assign):
        return None
    name = inner.value
    read = any(n == name and sc is binding.scope and line > binding.line for n, sc, line, _ in work.facts.reads)
    # (a module global read in a function: binding it there would make it local, UnboundLocalError)
    local = any(b.target == name and b.scope is binding.scope for b in work.facts.bindings)
    if read and not local:
        work.leave(binding.line, f"{binding.target} = {name}.to(...) is the same module as {name}, which is used "
                   f"below under that name: {name} stays unprepared (its forward outside DDP)", f"use "
                   f"{binding.target} below, or prepare {name} where it is built ({name} = "
                   f"ddpkit.prepare_model(...)), then convert again")
    return name if read and local else None

def _at_data_parallel(work: _Work, binding: Binding, until: int) -> bool:
    """The model built under an ``if`` and wrapped in DataParallel below it, on a line under no ``if``: that line
    reaches every path, so it becomes the wrap (random-erasing's ``if arch == 'wrn': ... elif ...:`` then
    ``model = torch.nn.DataParallel(model).cuda()``). Also below the optimizer (augmix builds SGD over the
    model, then wraps it): DDP keeps the parameters the optimizer holds; not in a loop."""
    first_loop = min((lp.line for lp in work.facts.loops if lp.scope is binding.scope and lp.line > binding.line),
                     default=None)  # (a wrap line below a loop came after training: not the wrap)
    wraps = [c for c in work.facts.calls if parallel.is_wrapper(c.name) and c.scope is binding.scope and
             binding.line < c.line and (c.line <= until or not c.loops and c.node.args and
                                        dotted(c.node.args[0].value) == binding.target and
                                        (first_loop is None or c.line < first_loop)) and
             c.stmt is not None and id(c.stmt) in work.edits.remove and not c.tests and
             work._guard(c.stmt) is None]
    if not wraps or work._guard(binding.stmt) is None:
        return False
    stmt, line = wraps[-1].stmt, wraps[-1].line
    work.edits.remove.discard(id(stmt))
    work.edits.replace[id(stmt)] = [f"{binding.target} = ddpkit.prepare_model({binding.target})"]
    work.log = [e for e in work.log if not (e.line == line and "DataParallel" in e.what)]
    work.note(f"{binding.target} = DataParallel({binding.target}) -> {binding.target} = ddpkit.prepare_model("
              f"{binding.target})", "the model is built in the branches of an if above: this line reaches every "
              "path; prepare_model wraps it once, from the launch (DataParallel or DDP)", line)
    return True

def _returns_device(work: _Work, binding: Binding) -> bool:
    """``self.device = self._acquire_device()``: a function of the script whose returned name is a device
    set-up converted here (Informer's experiment classes)."""
    made = next((c for c in work.facts.calls if c.node is binding.value), None)
    target = callee(work.facts, made) if made is not None else None
    if target is not None and any(s is target[0] for s in work.device_functions):  # (devicehelper.py)
        return True
    returned = [dotted(v) for s, v in work.facts.returns if target is not None and s is target[0]]
    return bool(returned) and all(any(d.target == r and d.scope is target[0] for d in work.devices)
                                  for r in returned if target is not None)

def _imported_device(work: _Work, binding: Binding) -> bool:
    """``device = utils.get_device()``: a function of another module of the project whose returned device that
    module's conversion makes ddpkit's (:attr:`.crossing.Crossing.devices`)."""
    called = dotted(binding.value.func) if isinstance(binding.value, cst.Call) else None
    origin = imported_from(work.facts, called) if called and work.crossing is not None else None
    full = f"{origin[0]}.{origin[1]}" if origin is not None else ""  # (``pkg.helpers.get_device`` inside pkg/)
    return bool(full) and any(full == d or full.endswith(f".{d}") for d in work.crossing.devices)


def _unread_device(work: _Work, nodes: list[cst.CSTNode], model: Binding) -> Binding | None:
    """The binding of a device the model is moved to (``.to(device)``) that the device rules did not
    convert: the data would still go there while prepare_model picks ddpkit's."""
    for node in nodes:
        while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            if node.func.attr.value == "to" and node.args:
                name = dotted(node.args[0].value)
                found = binding_of(work.facts, name, model.scope, model.line) if name else None
                if found is not None and found.value is not None and found not in work.devices and \
                        not (dotted(found.value) or "").endswith(".device") and not _returns_device(work, found) \
                        and not _imported_device(work, found) and not _handed_in(work, found):
                    return found
            node = node.func.value
    return None



def _handed_in(work: _Work, found: Binding) -> bool:
    """``self.device = device`` of a parameter (ts2vec's ``TS2Vec(device=device)``): the caller's device, which a
    converted caller makes ddpkit's; said as kept."""
    if not (isinstance(found.value, cst.Name) and found.value.value in found.scope.params):
        return False
    param = found.value.value
    node = found.scope.node
    made = [c for c in work.facts.calls if found.scope.cls and found.scope.name.endswith(".__init__") and
            dotted(c.node.func) == found.scope.cls]  # (``Trainer(device='cuda:0')`` in this file)
    for call in made:
        given = argument_for(call, param, found.scope, 1)  # (after ``self``)
        if given is None and isinstance(node, cst.FunctionDef):  # the default: ``device='cuda'``
            given = next((p.default for p in node.params.params if p.name.value == param), None)
        if given is None or _fixed(given) or dotted(given) is not None and \
                not any(d.target == dotted(given) for d in work.devices):
            return False  # a device the caller fixes (or one no device set-up here makes): as before, refused
    work.keep(found.line, f"{found.target} = {found.value.value}: the device the model and data move to is handed in "
              f"by the caller", "prepare_model puts the model on this rank's device: the caller should pass it "
              "(state.device; a device set-up ddpkit convert rewrites does)")
    return True


def _fixed(node: cst.BaseExpression) -> bool:
    """A literal device: ``'cuda:0'``, ``torch.device('cuda')``."""
    return isinstance(node, cst.SimpleString) or isinstance(node, cst.Call) and \
        any(isinstance(a.value, cst.SimpleString) for a in node.args)


def _handed_out(call: Call) -> bool:
    """``return torch.optim.Adam(self.parameters(), ...)``: a method that returns the optimizer it makes (one kept
    as ``self.opt`` in ``__init__`` is the class's own)."""
    first = call.stmt.body[0] if call.stmt is not None else None
    return isinstance(first, cst.Return) and first.value is call.node

def _reloaded(binding: Binding) -> bool:
    """The model bound again from a call handed the model itself (``model = load_model(model, path)``, ``self.model,
    lr, epoch = load_model(self.model, ...)``): the same model, loaded; its build is the binding before."""
    value = binding.whole if binding.whole is not None else binding.value
    name = (dotted(value.func) or "").rsplit(".", 1)[-1].lower() if isinstance(value, cst.Call) else ""
    # (a loader's name only: ``model = WithHead(model)``, ``torch.compile(model)`` make a new module, the build)
    return isinstance(value, cst.Call) and any(w in name for w in ("load", "restore", "resume")) and \
        any(dotted(a.value) == binding.target for a in value.args)


def _built(binding: Binding) -> bool:
    """The binding gives the name a value of the script's (``net = Net()``; ``net, name = get_network()``), not a
    parameter's or a loop variable's."""
    return binding.value is not None or binding.whole is not None


def within(stmt: cst.CSTNode | None, node: cst.CSTNode) -> bool:
    return stmt is not None and any(found is stmt for found in m.findall(node, m.SimpleStatementLine()))


def _prepared(value: cst.BaseExpression | None, aliases: dict[str, str]) -> bool:
    """``ddpkit.prepare_model(...)``, also as ``dk.prepare_model`` or an imported ``prepare_model``."""
    return isinstance(value, cst.Call) and resolve(dotted(value.func), aliases) == "ddpkit.prepare_model"
