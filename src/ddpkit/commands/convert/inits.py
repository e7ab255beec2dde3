"""Where ``prepare_model`` goes when the script initialises its model after building it (DCGAN's ``netG =
Generator(); netG.apply(weights_init)``, ``nn.init.xavier_uniform_(model.fc.weight)``, ``model[3].bias.fill_(0)``,
a ``for m in model.modules():`` init loop, ``init_params(model)`` / ``model.reset_parameters()``,
``model.load_state_dict(...)``, also after a ``;`` on the build's own line): below the last of those lines, not at
the build.

DDP copies rank 0's weights to every rank when it wraps; an initialisation after the wrap runs on each rank with
its own random numbers (a script that seeds per process, or not at all, trains a different model on each rank).
The wrap moves down only over lines that touch the model in ways that cannot see the difference (the
initialisations, ``print(model)``, a move to the device, a DataParallel wrap convert deletes); at the first
other use (the optimizer over its parameters, a call that keeps it) it stays where it is, and an ``apply`` /
``nn.init`` below that use is listed for the user.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nnet = Net().to(dev)\\nnet.apply(init)\\n"
    ...             "opt = torch.optim.SGD(net.parameters(), lr=1)\\n").text
    >>> text.splitlines()[-4:-1]
    ['net = Net()', 'net.apply(init)', 'net = ddpkit.prepare_model(net)']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import parallel
from ddpkit.commands.convert.flow import argument_for, callee, scope_trains
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Binding, Call

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

WALKS = ("modules", "named_modules", "children", "named_children", "parameters", "named_parameters")
RANDOM = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_")
HARMLESS = ("print", "ddpkit.print")  # a read that cannot tell a wrapped model from a plain one
INIT_METHODS = ("reset_parameters", "init_weights", "_init_weights", "initialize_weights", "_initialize_weights",
                "reset_weights", "init_params")  # a model's own (re-)initialisation
# a model's own method of another module that sets weights (a sequence-labelling tutorial's
# ``model.init_word_embeddings(embeddings)``, whose unknown words' rows are drawn at random on each rank)
STATES = ("hidden", "state", "memory", "cache")  # what an ``init_*`` method makes rather than sets
# torch's quantization set-up that swaps a model's layers in place (fake-quantised ones, a Conv+BN+ReLU fused)
QUANTIZING = ("prepare_qat", "prepare", "fuse_modules", "fuse_modules_qat")
MODES = ("train", "eval")  # ``model.train()`` before the wrap or after: the same (DDP's passes it on)
INIT_PREFIXES = ("init_", "_init_", "initialize_", "load_pretrained", "load_embedding", "load_weights")


def place(work: _Work, binding: Binding, moves: list[Call], anchor: cst.If | None = None) -> bool:
    """Wrap ``binding``'s model below the initialisations that follow its build; False (nothing done): there
    are none, or a move to the device below them already becomes the wrap. ``anchor``: the ``if`` whose every
    branch builds the model (:mod:`ddpkit.commands.convert.branches`): the initialisations that follow it."""
    stmt = anchor or binding.stmt
    block = block_of(stmt, binding.scope)
    if block is None or stmt is None:
        return False
    start = next(i for i, s in enumerate(block) if s is stmt) + 1
    target, last, stop = binding.target, None, len(block)
    allowed = _removed(work) | {i for c in moves for i in node_ids(c.node)} | _guarded_moves(work, binding)
    # ``model = Net(); model.apply(init)``: one line
    after = _after_assignment(stmt, binding.value) if isinstance(stmt, cst.SimpleStatementLine) else []
    states = [_statement(work, target, small, allowed) for small in after]
    if "use" in states:  # the wrap stays at the build: an init on its line is listed
        _late(work, target, after, binding.line)
        stop = start
    elif "init" in states:
        last = start - 1
    for index in range(start, stop):
        state = _statement(work, target, block[index], allowed)
        if state == "init":
            last = index
        elif state == "use":
            stop = index
            break
    moved = [c for c in moves if last is not None and any(id(c.stmt) in node_ids(s) for s in block[last + 1:stop])]
    if last is None or moved:  # the wrap stays at the build, or at a move below the inits
        _late(work, target, block[stop:], moves[-1].line if moves else binding.line)
        return False
    value = None if anchor is not None else binding.value  # (a build in a branch stays as it is)
    inside = {i for st in [stmt, *block[start:last + 1]] for i in node_ids(st)}
    if any(id(c.node) in inside and sized_by(work, c, target) for c in work.facts.calls):
        value, moves = None, []  # (a forward on a sample on the device sizes it: the model must be there first)
    if value is not None and dotted(without_moves(value)) == target and binding.stmt is not None and \
            len(binding.stmt.body) == 1:  # ``net = net.to(device)``: prepare_model moves it, the line goes
        work.edits.remove.add(id(binding.stmt))
    elif value is not None and without_moves(value) is not value:  # ``Net().to(device)``: the same
        work.edits.expr[id(value)] = lambda node: without_moves(node)
    for move in moves:  # ``net.to(device)`` above the init: prepare_model moves it below
        work.edits.remove.add(id(move.stmt))
    work.edits.after.setdefault(id(block[last]), []).append(f"{target} = ddpkit.prepare_model({target})")
    line = line_of(work, block[last])
    _late(work, target, block[stop:], line)
    build = "in its build, before the ; of that line" if line == binding.line else \
        f"at its build (line {binding.line})"
    work.note(f"{target} = ddpkit.prepare_model({target}) below line {line}, not {build}", f"{target} is "
              f"initialised at line {line}: DDP copies rank 0's weights when it wraps, so an init after the wrap "
              "would give each rank its own", line)
    return True


def _guarded_moves(work: _Work, binding: Binding) -> set[int]:
    """``if cuda: generator.cuda()`` on a line of its own: a move the wrap may pass (prepare_model moves the model
    to this rank's device anyway), also under its own ``if`` (PyTorch-GAN's: the init below it comes first)."""
    return {i for c in work.facts.calls if c.scope is binding.scope and c.last in ("to", "cuda") and c.stmt is not None
            and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == binding.target
            and len(c.stmt.body) == 1 and isinstance(c.stmt.body[0], cst.Expr) and c.stmt.body[0].value is c.node
            for i in node_ids(c.node)}


def _statement(work: _Work, target: str, stmt: cst.CSTNode, allowed: set[int]) -> str | None:
    """"init": the statement initialises ``target`` and reads it no other way; "use": it reads it otherwise (or
    binds the name again); None: it does not read it."""
    inside = node_ids(stmt)
    reads = [r for r in work.facts.reads if id(r[3]) in inside and _of(r[0], target)]
    if not reads:
        return None
    if any(b.target == target and id(b.stmt) in inside and id(b.stmt) not in allowed for b in work.facts.bindings):
        return "use"  # a new model under the old name
    calls = [c for c in work.facts.calls if id(c.node) in inside]
    inits = [c for c in calls if _init(c, target, loading=True, facts=work.facts)] + _walks(work, stmt, target) + \
        [_Node(t) for t in _set_parts(stmt, target)] + [c for c in calls if sized_by(work, c, target)]
    fine = allowed | {i for c in inits for i in node_ids(c.node)} | \
        {i for c in calls if c.name in HARMLESS or _mode(c, target) for i in node_ids(c.node)} | \
        _peeks(reads, calls, target) | _sizes(stmt)
    if any(id(r[3]) not in fine for r in reads):
        return "use"
    return "init" if inits else None


def _mode(call: Call, target: str) -> bool:
    """``target.train()`` / ``target.eval()`` alone: a mode the wrapped model passes on as the plain one would."""
    func = call.node.func
    return call.last in MODES and not call.node.args and isinstance(func, cst.Attribute) and \
        dotted(func.value) == target


def sized_by(work: _Work, call: Call, target: str) -> bool:
    """``model(sample)`` in a file that builds a lazy layer (``nn.LazyLinear``): a forward that sizes its weights,
    which prepare_model needs sized (an init, as the wrap's place goes)."""
    return dotted(call.node.func) == target and \
        any((c.name or "").startswith("torch.nn.Lazy") for c in work.facts.calls)


def _late(work: _Work, target: str, rest: Sequence[cst.CSTNode], wrapped_at: int) -> None:
    """An ``apply`` / ``nn.init`` / init loop / init helper of ``target`` below its first other use: listed, the
    wrap cannot pass that use (an optimizer built over the plain model's parameters would miss SyncBatchNorm's)."""
    # (a loop that reads the model: one over the settings, ``for k, v in config.items(): print(k, v)``, is no
    # training; set 29)
    loop = next((i for i, s in enumerate(rest) if isinstance(s, (cst.For, cst.While)) and
                 not _walks(work, s, target, drawing=True) and _reads(work, s, target)), len(rest))
    inside = {i for s in rest[:loop] for i in node_ids(s)}  # (once training starts, an apply is no init)
    lines = [c.line for c in work.facts.calls if id(c.node) in inside and _init(c, target, False, work.facts)]
    lines += [lp.line for lp in work.facts.loops if id(lp.node) in inside and _walks(work, lp.node, target, True)]
    parts = {i for s in rest[:loop] for t in _set_parts(s, target) for i in node_ids(t)}  # a new head, too late
    lines += [line for _s, _scope, line in work.facts.statements if id(_s) in parts or node_ids(_s) & parts]
    for line in sorted(set(lines)):
        work.leave(line, f"{target} is initialised here, after prepare_model (line {wrapped_at}"
                   f"): unless every rank draws the same random numbers, each trains its own model", "move "
                   f"the initialisation up to where {target} is built (above the optimizer and any other use of "
                   "it), then convert again")


def _reads(work: _Work, stmt: cst.CSTNode, target: str) -> bool:
    """``stmt`` reads ``target`` (or a part of it) somewhere inside, or calls a function of the script, which may
    (``for epoch in range(2): train(epoch)`` training the global model: review 45)."""
    inside = node_ids(stmt)
    return any(id(r[3]) in inside and _of(r[0], target) for r in work.facts.reads) or \
        any(id(c.node) in inside and callee(work.facts, c) is not None for c in work.facts.calls)


def _init(call: Call, target: str, loading: bool, facts: Any = None, depth: int = 0) -> bool:
    """``target.apply(f)``, ``target.x.weight.data.normal_()`` / ``target[3].bias.fill_(0)`` (an in-place method),
    ``nn.init.*(target.x...)``, ``target.reset_parameters()``, a helper of the script's that initialises what it is
    passed (``init_params(target)``), and with ``loading`` ``target.load_state_dict(...)`` and any in-place
    method; without, the random draws only (below other uses, a load every rank makes or a ``requires_grad_`` is
    no per-rank init)."""
    func = call.node.func
    base = func.value if isinstance(func, cst.Attribute) else None
    if call.last in ("apply", "load_state_dict") and _refers(base, target):
        return call.last == "apply" or loading
    if call.last.endswith("_") and not call.last.startswith("_") and _refers(base, target):
        return loading or call.last in RANDOM
    if call.last in INIT_METHODS and _refers(base, target):
        return True
    if call.last in QUANTIZING and (call.name or "").startswith(("torch.quantization.", "torch.ao.quantization.")) \
            and call.node.args and dotted(call.node.args[0].value) == target:
        return loading  # (``prepare_qat(model, inplace=True)`` swaps its layers: the wrap goes below; set 26's QAT)
    if call.last.startswith(INIT_PREFIXES) and _refers(base, target):  # (``hidden = model.init_hidden(bsz)``: a
        return _bare(call) or not any(w in call.last for w in STATES)  # state it makes, no weight it sets)
    first = call.node.args[0].value if call.node.args else None
    # (a helper imported from another module that initialises what it is handed: the GAN lessons' util.py
    # ``init_weights(netG, init_type='normal')``, model.py's ``init_net(netG, ...)``; its body is not read here)
    # (or named for an init anyhow: DCGAN-CIFAR10's ``weight_init(netg)`` of dcgan.py)
    # (and, right below the build, one named for a load: the pytorch-gan lesson's ``load_model(disc, path,
    # device)``, which draws an init when the file is not there; a load before the wrap is right anyhow)
    if base is None and dotted(first) == target and (call.last in INIT_METHODS or call.last.startswith(
            INIT_PREFIXES) or "init" in call.last.lower() or loading and any(
            w in call.last.lower() for w in ("load", "restore", "resume"))) and \
            not any(w in call.last for w in STATES) and (facts is None or callee(facts, call) is None):
        return True
    fixed = call.last in ("zeros_", "ones_", "constant_", "eye_", "dirac_")  # the same on every rank
    if (call.name or "").startswith("torch.nn.init."):
        return _refers(first, target) and dotted(first) != target and (loading or not fixed)
    return facts is not None and depth < 2 and _helper(call, target, loading, facts, depth)


def _bare(call: Call) -> bool:
    """The call is a statement of its own, its value unused (``model.init_weights()``)."""
    return isinstance(call.stmt, cst.SimpleStatementLine) and \
        any(isinstance(small, cst.Expr) and small.value is call.node for small in call.stmt.body)


def _helper(call: Call, target: str, loading: bool, facts: Any, depth: int) -> bool:
    """``init_params(net)`` / ``net.init_weights()``: a function or method of the script's that initialises the
    parameter it is passed ``target`` as (``self`` for a method called on it)."""
    own = callee(facts, call)
    if own is None:
        return False
    scope, skip = own
    if scope_trains(facts, scope):  # ``train(model, ...)`` that reloads its best weights at the end: it trains
        return False
    func = call.node.func
    params = [p for p in scope.params if dotted(argument_for(call, p, scope, skip)) == target]
    if skip and isinstance(func, cst.Attribute) and dotted(func.value) == target and scope.params:
        params.append(scope.params[0])  # ``net.reset_weights()``: its ``self``
    return any(c.scope is scope and _init(c, p, loading, facts, depth + 1) for c in facts.calls for p in params) or \
        any(loop.scope is scope and _walks(None, loop.node, p, drawing=not loading, facts=facts)
            for loop in facts.loops for p in params)


def _walks(work: _Work, stmt: cst.CSTNode, target: str, drawing: bool = False, facts: Any = None) -> list[Any]:
    """``for m in target.modules(): ... nn.init.kaiming_normal_(m.weight)``: the loop's iterable, as an init
    call (its reads of ``target`` are the init's); ``drawing``: only a loop that draws random numbers."""
    if not isinstance(stmt, cst.For) or not isinstance(stmt.iter, cst.Call):
        return []
    func = stmt.iter.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in WALKS and _of(dotted(func.value) or "", target)):
        return []
    in_place: list[cst.CSTNode] = [n for n in _nodes(stmt.body) if isinstance(n, cst.Call) and isinstance(
        n.func, cst.Attribute) and n.func.attr.value.endswith("_") and not n.func.attr.value.startswith("_")]
    if not drawing:  # ``for p in model.parameters(): p.requires_grad = False``: a freeze before a new head
        in_place += [n for n in _nodes(stmt.body) if isinstance(n, cst.Assign) and all(
            isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad" for t in n.targets)]
    if drawing:
        inside = node_ids(stmt.body)
        calls = (facts or work.facts).calls
        in_place = [n for n in in_place if n.func.attr.value in RANDOM]  # type: ignore[attr-defined]
        in_place += [c.node for c in calls if id(c.node) in inside and (c.name or "").startswith("torch.nn.init.")
                     and c.last not in ("zeros_", "ones_", "constant_", "eye_", "dirac_")]
    return [_Node(stmt.iter)] if in_place else []


def _set_parts(stmt: cst.CSTNode, target: str) -> list[cst.BaseExpression]:
    """The parts of ``target`` the statement assigns (``model.fc = nn.Linear(512, 2)``, a new head on a pretrained
    network; ``model.classifier[6] = ...``; also in a tuple, and under an ``if``): a change to the model, which must
    come before the wrap (after it, the assignment lands on the wrapper, and the wrapped network keeps its old
    part)."""
    lines = [stmt] if isinstance(stmt, cst.SimpleStatementLine) else \
        [n for n in m.findall(stmt, m.SimpleStatementLine()) if isinstance(n, cst.SimpleStatementLine)] \
        if isinstance(stmt, cst.If) else []
    found: list[cst.BaseExpression] = []
    for small in (s for line in lines for s in line.body):
        targets: list[cst.BaseExpression] = [t.target for t in small.targets] if isinstance(small, cst.Assign) \
            else [small.target] if isinstance(small, (cst.AnnAssign, cst.AugAssign)) else []
        targets = [e.value for t in targets for e in (t.elements if isinstance(t, (cst.Tuple, cst.List)) else [])] \
            + targets
        setting = _setting(getattr(small, "value", None))  # ``model.verbose = False``: a flag, no part (resnet1d);
        # not a freeze (``model.features.weight.requires_grad = False``), nor a literal set deeper in the model
        found += [t for t in targets if isinstance(t, (cst.Attribute, cst.Subscript)) and _refers(t, target)
                  and dotted(t) != target and not (setting and isinstance(t, cst.Attribute) and
                                                   dotted(t.value) == target and t.attr.value != "requires_grad")]
    return found


def _setting(value: cst.BaseExpression | None) -> bool:
    """A literal: a number, a text, ``True`` / ``False`` / ``None``."""
    if isinstance(value, cst.UnaryOperation):
        value = value.expression
    return isinstance(value, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)) or \
        isinstance(value, cst.Name) and value.value in ("True", "False", "None")


def _peeks(reads: list[Any], calls: list[Call], target: str) -> set[int]:
    """Reads of an attribute of the model that call nothing (``model.fc.in_features``, sizing a new head): the
    same before the wrap and after it, so no use that keeps the wrap above them."""
    called = {id(c.node.func) for c in calls}
    return {i for name, _where, _line, node in reads if name.startswith(f"{target}.") and id(node) not in called
            and not name.endswith((".parameters", ".named_parameters", ".state_dict", ".modules", ".children"))
            for i in node_ids(node)}


_SIZES = ("in_features", "out_features", "in_channels", "out_channels", "num_features", "embedding_dim",
          "num_embeddings", "hidden_size", "shape")


def _sizes(stmt: cst.CSTNode) -> set[int]:
    """Values of ``n = ...`` that end in a layer's size (``next(l for l in model.classifier.children() if
    isinstance(l, nn.Linear)).in_features``; ``list(model.fc.modules())[-1].weight.shape[1]``): a walk of the old
    head that sizes the new one reads the model as a peek does, whatever it calls on the way."""
    lines = [stmt] if isinstance(stmt, cst.SimpleStatementLine) else \
        [n for n in m.findall(stmt, m.SimpleStatementLine()) if isinstance(n, cst.SimpleStatementLine)] \
        if isinstance(stmt, cst.If) else []
    found: set[int] = set()
    for small in (s for line in lines for s in line.body):
        value = small.value if isinstance(small, cst.Assign) and all(
            isinstance(t.target, cst.Name) for t in small.targets) else None
        while isinstance(value, cst.Subscript):
            value = value.value
        if isinstance(value, cst.Attribute) and value.attr.value in _SIZES:
            found |= node_ids(value)
    return found


class _Node:
    def __init__(self, node: cst.CSTNode):
        self.node = node


def _of(name: str, target: str) -> bool:
    return name == target or name.startswith(f"{target}.")


def _refers(node: cst.CSTNode | None, target: str) -> bool:
    """``node`` is ``target`` or a part of it: ``target.fc.weight``, ``target[3].bias``, ``target.layers[0].w``."""
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if dotted(node) == target:
            return True
        node = node.value
    return node is not None and dotted(node) == target


def _after_assignment(stmt: cst.SimpleStatementLine, value: cst.BaseExpression | None) -> list[cst.CSTNode]:
    """The small statements after the assignment of ``value`` on its own line (``m = Net(); m.apply(init)``)."""
    index = next((i for i, small in enumerate(stmt.body) if getattr(small, "value", None) is value), len(stmt.body))
    return list(stmt.body[index + 1:])


def _removed(work: _Work) -> set[int]:
    """The nodes of statements convert deletes (``net = nn.DataParallel(net)``) and of DataParallel calls."""
    found: set[int] = set()
    for stmt, _scope, _line in work.facts.statements:
        if id(stmt) in work.edits.remove:
            found |= node_ids(stmt)
    for call in work.facts.calls:
        if parallel.single_process(call.name):
            found |= node_ids(call.node)
    return found


def block_of(stmt: cst.BaseStatement | None, scope: Any) -> Sequence[cst.BaseStatement] | None:
    """The statements ``stmt`` is one of (a function's body, an ``if``'s, the module's)."""
    if stmt is None:
        return None
    for node in _nodes(scope.node):
        if isinstance(node, (cst.Module, cst.IndentedBlock)) and any(s is stmt for s in node.body):
            return node.body
    return None


def _nodes(root: cst.CSTNode) -> list[cst.CSTNode]:
    found: list[cst.CSTNode] = []

    class Every(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            found.append(node)
            return True

    root.visit(Every())
    return found


def node_ids(root: cst.CSTNode) -> set[int]:
    """The identities of ``root`` and every node under it (what a statement holds, for the scan's records)."""
    return {id(n) for n in _nodes(root)}


def line_of(work: _Work, stmt: cst.BaseStatement) -> int:
    """The last line of ``stmt`` the scan recorded (a read or a simple statement in it): the wrap goes below it."""
    inside = node_ids(stmt)
    lines = [line for s, _scope, line in work.facts.statements if id(s) in inside]
    lines += [r[2] for r in work.facts.reads if id(r[3]) in inside]
    return max(lines, default=0)
