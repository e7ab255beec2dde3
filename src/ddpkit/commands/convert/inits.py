"""Where ``prepare_model`` goes when the script initialises its model after building it (DCGAN's ``netG =
Generator(); netG.apply(weights_init)``, ``nn.init.xavier_uniform_(model.fc.weight)``, a ``for m in
model.modules():`` init loop, ``model.load_state_dict(...)``): below the last of those lines, not at the build.

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

from ddpkit.commands.convert import parallel
from ddpkit.commands.convert.rules import without_moves
from ddpkit.commands.convert.scan import Binding, Call, dotted

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

WALKS = ("modules", "named_modules", "children", "named_children", "parameters", "named_parameters")
RANDOM = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_")
HARMLESS = ("print", "ddpkit.print")  # a read that cannot tell a wrapped model from a plain one


def place(work: _Work, binding: Binding, moves: list[Call]) -> bool:
    """Wrap ``binding``'s model below the initialisations that follow its build; False (nothing done): there
    are none, or a move to the device below them already becomes the wrap."""
    block = _block(binding)
    if block is None:
        return False
    start = next(i for i, s in enumerate(block) if s is binding.stmt) + 1
    target, last, stop = binding.target, None, len(block)
    allowed = _removed(work) | {i for c in moves for i in node_ids(c.node)}
    for index in range(start, len(block)):
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
    value = binding.value
    if value is not None and dotted(without_moves(value)) == target and binding.stmt is not None and \
            len(binding.stmt.body) == 1:  # ``net = net.to(device)``: prepare_model moves it, the line goes
        work.edits.remove.add(id(binding.stmt))
    elif value is not None and without_moves(value) is not value:  # ``Net().to(device)``: the same
        work.edits.expr[id(value)] = lambda node: without_moves(node)
    for move in moves:  # ``net.to(device)`` above the init: prepare_model moves it below
        work.edits.remove.add(id(move.stmt))
    work.edits.after.setdefault(id(block[last]), []).append(f"{target} = ddpkit.prepare_model({target})")
    line = _line(work, block[last])
    _late(work, target, block[stop:], line)
    work.note(f"{target} = ddpkit.prepare_model({target}) below line {line}, not at its build (line "
              f"{binding.line})", f"{target} is initialised at line {line}: DDP copies rank 0's weights when it "
              "wraps, so an init after the wrap would give each rank its own", line)
    return True


def _statement(work: _Work, target: str, stmt: cst.BaseStatement, allowed: set[int]) -> str | None:
    """"init": the statement initialises ``target`` and reads it no other way; "use": it reads it otherwise (or
    binds the name again); None: it does not read it."""
    inside = node_ids(stmt)
    reads = [r for r in work.facts.reads if id(r[3]) in inside and _of(r[0], target)]
    if not reads:
        return None
    if any(b.target == target and id(b.stmt) in inside and id(b.stmt) not in allowed for b in work.facts.bindings):
        return "use"  # a new model under the old name
    calls = [c for c in work.facts.calls if id(c.node) in inside]
    inits = [c for c in calls if _init(c, target, loading=True)] + _walks(stmt, target)
    fine = allowed | {i for c in inits for i in node_ids(c.node)} | \
        {i for c in calls if c.name in HARMLESS for i in node_ids(c.node)}
    if any(id(r[3]) not in fine for r in reads):
        return "use"
    return "init" if inits else None


def _late(work: _Work, target: str, rest: Sequence[cst.BaseStatement], wrapped_at: int) -> None:
    """An ``apply`` / ``nn.init`` of ``target`` below its first other use: listed, the wrap cannot pass that use."""
    loop = next((i for i, s in enumerate(rest) if isinstance(s, (cst.For, cst.While))), len(rest))
    inside = {i for s in rest[:loop] for i in node_ids(s)}  # (once training starts, an apply is no init)
    for call in work.facts.calls:
        if id(call.node) in inside and _init(call, target, loading=False):
            work.leave(call.line, f"{target} is initialised here, after prepare_model (line {wrapped_at}"
                       f"): unless every rank draws the same random numbers, each trains its own model", "move "
                       f"the initialisation up to where {target} is built (above the optimizer and any other use of "
                       "it), then convert again")


def _init(call: Call, target: str, loading: bool) -> bool:
    """``target.apply(f)``, ``target.x.weight.data.normal_()`` (an in-place method), ``nn.init.*(target.x...)``,
    and with ``loading`` ``target.load_state_dict(...)`` and any in-place method; without, the random draws only
    (below other uses, a load every rank makes or a ``requires_grad_`` is no per-rank init)."""
    func = call.node.func
    base = dotted(func.value) if isinstance(func, cst.Attribute) else None
    if call.last in ("apply", "load_state_dict") and base is not None and _of(base, target):
        return call.last == "apply" or loading
    if call.last.endswith("_") and not call.last.startswith("_") and base is not None and _of(base, target):
        return loading or call.last in RANDOM
    first = call.node.args[0].value if call.node.args else None
    fixed = call.last in ("zeros_", "ones_", "constant_", "eye_", "dirac_")  # the same on every rank
    return (call.name or "").startswith("torch.nn.init.") and (dotted(first) or "").startswith(f"{target}.") and \
        (loading or not fixed)


def _walks(stmt: cst.BaseStatement, target: str) -> list[Any]:
    """``for m in target.modules(): ... nn.init.kaiming_normal_(m.weight)``: the loop's iterable, as an init
    call (its reads of ``target`` are the init's)."""
    if not isinstance(stmt, cst.For) or not isinstance(stmt.iter, cst.Call):
        return []
    func = stmt.iter.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in WALKS and _of(dotted(func.value) or "", target)):
        return []
    in_place = [n for n in _nodes(stmt.body) if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute)
                and n.func.attr.value.endswith("_") and not n.func.attr.value.startswith("_")]
    return [_Node(stmt.iter)] if in_place else []


class _Node:
    def __init__(self, node: cst.CSTNode):
        self.node = node


def _of(name: str, target: str) -> bool:
    return name == target or name.startswith(f"{target}.")


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


def _block(binding: Binding) -> Sequence[cst.BaseStatement] | None:
    """The statements the binding's line is one of (a function's body, an ``if``'s, the module's)."""
    stmt = binding.stmt
    if stmt is None:
        return None
    for node in _nodes(binding.scope.node):
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


def _line(work: _Work, stmt: cst.BaseStatement) -> int:
    """The last line of ``stmt`` the scan recorded (a read or a simple statement in it): the wrap goes below it."""
    inside = node_ids(stmt)
    lines = [line for s, _scope, line in work.facts.statements if id(s) in inside]
    lines += [r[2] for r in work.facts.reads if id(r[3]) in inside]
    return max(lines, default=0)
