"""Where ``prepare_model`` goes when every branch of an ``if`` / ``elif`` / ``else`` binds the model: below the
whole ``if``, not in the branch the optimizer's model was last bound in.

mixup-cifar10 and its kin build the model in one branch and restore it in the other (``if args.resume: net =
checkpoint['net'] else: net = Net()``); scripts that pick an architecture write ``if args.arch == 'vgg': model
= VGG() else: model = ResNet()``. A wrap in the last branch leaves the others unwrapped: a resumed run, or
another architecture, trains a copy of the model on each rank. Below the ``if`` the model is bound whichever
branch ran, and prepared once.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\nif resume:\\n    net = torch.load(p)\\nelse:\\n    net = Net()\\n"
    ...             "opt = torch.optim.SGD(net.parameters(), lr=1)\\n").text
    >>> text.splitlines()[-3:-1]
    ['    net = Net()', 'net = ddpkit.prepare_model(net)']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import inits
from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import names_in
from ddpkit.commands.convert.scan import Binding, Call
from ddpkit.commands.convert.waits import main_guard

# the plan in the making (plan._Work): facts, edits, note
_Work = Any


def place(work: _Work, binding: Binding, optimizer: Call | None) -> bool:
    """Wrap ``binding``'s model below the outermost ``if`` chain whose every branch binds it (and below the
    initialisations that follow it: :func:`ddpkit.commands.convert.inits.place`); False: no chain does, or the
    optimizer is inside it (None: an optimizer of another module)."""
    chain = _exhaustive(work, binding, optimizer)
    if chain is None:
        _one_path(work, binding, optimizer)
        return False
    if optimizer is not None and (optimizer.stmt is None or id(optimizer.stmt) in node_ids(chain)):
        return _at_move(work, binding, chain)
    if inits.place(work, binding, [], anchor=chain):
        return True
    target = binding.target
    work.edits.after.setdefault(id(chain), []).append(f"{target} = ddpkit.prepare_model({target})")
    word = "try" if isinstance(chain, cst.Try) else "if"
    work.note(f"{target} = ddpkit.prepare_model({target}) below the {word}, not in its branch (line {binding.line})",
              f"{target} is bound on every path through the {word}: prepared whichever path runs (a wrap in one "
              "branch leaves the model of the other paths a separate copy on each rank)", binding.line)
    return True


def _at_move(work: _Work, binding: Binding, chain: Any) -> bool:
    """The optimizer made inside the chain's branches, and the model moved below it (the image-captioning
    tutorial: ``if checkpoint is None: decoder = Decoder(); opt = Adam(decoder...)`` / ``else: decoder =
    checkpoint['decoder']``, then ``decoder = decoder.to(device)``): that move reaches every path and becomes
    the wrap (DDP keeps the parameters the optimizer holds). False: no such move before another use."""
    target = binding.target
    block = list(inits.block_of(chain, binding.scope) or [])
    index = next((i for i, s in enumerate(block) if s is chain), None)
    if index is None:
        return False
    for stmt in block[index + 1:]:
        if _move_of(stmt, target):
            if id(stmt) in work.edits.replace:  # another binding of the chain (the else's) placed it here
                return True
            work.edits.replace[id(stmt)] = [f"{target} = ddpkit.prepare_model({target})"]
            work.note(f"{target} = ddpkit.prepare_model({target}) at its move below the if (line "
                      f"{inits.line_of(work, stmt)}), not in its branch (line {binding.line})", f"{target} is bound "
                      "on every path through the if and moved here whichever ran: prepared once, for every path",
                      binding.line)
            return True
        if target in {n.value for n in m.findall(stmt, m.Name()) if isinstance(n, cst.Name)}:
            return False
    return False


def _move_of(stmt: cst.BaseStatement, target: str) -> bool:
    """``net = net.to(device)`` / ``net.to(device)`` / ``net.cuda()``, alone on its line."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    value = small.value if isinstance(small, (cst.Expr, cst.Assign)) else None
    if isinstance(small, cst.Assign) and not (len(small.targets) == 1 and isinstance(small.targets[0].target,
                                                                                      cst.Name)
                                              and small.targets[0].target.value == target):
        return False
    return isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in (
        "to", "cuda") and isinstance(value.func.value, cst.Name) and value.func.value.value == target


def _one_path(work: _Work, binding: Binding, optimizer: Call | None) -> None:
    """A model built in a branch of an ``if`` that does not bind it on every path (an ``elif`` with no ``else``),
    trained below that ``if``: wrapped in its branch, and listed (the other paths' model would be a copy per rank;
    the first optimizer step stops them, ddpkit.data.unprepared)."""
    holder = _holding(_tops(work), binding.stmt) if binding.stmt is not None else None
    if holder is None or optimizer is None or optimizer.stmt is None or id(optimizer.stmt) in node_ids(holder):
        return
    if isinstance(holder, cst.If) and main_guard(work.facts.code(holder.test)):
        return  # ``if __name__ == "__main__":``: every rank runs the script as its main module
    inside = node_ids(holder)
    # (a rebinding from the model itself, ``netG, ... = load(..., netG=netG)``, needs it bound first: no other source)
    alone = all(id(b.stmt) in inside for b in work.facts.bindings
                if b.target == binding.target and b.scope is binding.scope and
                not (b.whole is not None and binding.target in names_in(b.whole)))
    if isinstance(holder, cst.Try) and alone:
        return  # ``try: model = Net(); ... except KeyboardInterrupt: ...``: a path that skips it has no model at all
    # the GAN lesson's ``def train(args):`` ... ``if network == "DCGAN":`` with no else (its argparse ``choices=
    # ["DCGAN"]``): a local name only that branch binds, in no loop: a path that skips it stops at the optimizer
    # (UnboundLocalError), so the one that trains runs the branch (at a module's level a star import may bind it)
    declared = {item.name.value for g in m.findall(binding.scope.node, m.Global() | m.Nonlocal())
                for item in getattr(g, "names", ())} if binding.scope.name else set()  # (review: ``global model``)
    if isinstance(holder, cst.If) and alone and binding.scope.name and "." not in binding.target and \
            binding.target not in {*binding.scope.params, *declared} and not any(
                id(binding.stmt) in node_ids(lp.node) for lp in work.facts.loops if lp.scope is binding.scope):
        return
    work.leave(binding.line, f"{binding.target} is built in one branch of an if that does not bind it on every "
               f"path, and prepared there: on the other paths it is not (each rank would train its own copy; the "
               "first optimizer step stops it)", f"bind {binding.target} on every path (an else), or wrap it "
               f"below the if yourself: {binding.target} = ddpkit.prepare_model({binding.target})")


def _exhaustive(work: _Work, binding: Binding, optimizer: Call | None = None) -> Any:
    """The outermost ``if`` chain that holds ``binding`` in one of its branches and leaves its target bound on
    every path: each branch binds it (or raises, or returns), or a statement before the chain in its own block
    did. None when that chain itself sits in a branch of an ``if`` that does not (a path that never binds it),
    unless the optimizer is in that branch too (makemore's ``if __name__ == "__main__":`` around it all: the
    paths that skip the branch train nothing)."""
    tops = _tops(work)
    bound = {id(b.stmt) for b in work.facts.bindings
             if b.target == binding.target and b.scope is binding.scope and (b.value is not None or b.whole)}
    found: Any = None
    node: cst.BaseStatement | None = binding.stmt
    while node is not None:
        chain = _holding(tops, node)
        if chain is None:
            return found
        if found is not None and optimizer is not None and optimizer.stmt is not None and \
                id(optimizer.stmt) in node_ids(chain):
            return found
        if not (all(_binds(block, bound, tops) for block in _paths(chain)) or _before(work, chain, bound, binding)
                or _selects(work, chain, bound, tops, binding)):
            return None  # ``if resume: (if ema: net = A else: net = B)``: not bound when resume is false
        found = node = chain
    return found


def _tops(work: _Work) -> list[Any]:
    """Every ``if`` of the script that is no ``elif`` of another (the heads of its chains), and every ``try``
    (``try: model = torch.load(p)`` / ``except FileNotFoundError: model = Net()`` binds it on every path too)."""
    ifs = [node for node in m.findall(work.facts.module, m.If()) if isinstance(node, cst.If)]
    elifs = {id(node.orelse) for node in ifs if isinstance(node.orelse, cst.If)}
    tries = [node for node in m.findall(work.facts.module, m.Try()) if isinstance(node, cst.Try)]
    return [node for node in ifs if id(node) not in elifs] + tries


def _holding(tops: list[Any], node: cst.BaseStatement) -> Any:
    """The ``if`` chain (or ``try``) one of whose blocks has ``node`` as a statement of its own."""
    return next((top for top in tops if any(s is node for block in _blocks(top) for s in block.body)), None)


def _blocks(top: Any) -> list[cst.IndentedBlock]:
    """Every block of an ``if`` chain or a ``try`` (its handlers', its ``else``'s and ``finally``'s too)."""
    if isinstance(top, cst.If):
        return _branches(top)
    found = [top.body, *(h.body for h in top.handlers), *(b.body for b in (top.orelse, top.finalbody) if b)]
    return [b for b in found if isinstance(b, cst.IndentedBlock)]


def _paths(top: Any) -> list[cst.IndentedBlock]:
    """The blocks one of which every path runs to its end: an ``if``'s branches; a ``try``'s body, or one of its
    handlers (a handler that raises is no path on)."""
    if isinstance(top, cst.If):
        return _branches(top)
    return [b for b in (top.body, *(h.body for h in top.handlers)) if isinstance(b, cst.IndentedBlock)]


def _before(work: _Work, chain: Any, bound: set[int], binding: Binding) -> bool:
    """A statement before ``chain`` in its own block binds the name (``net = Net()`` above ``if resume:``), or
    an ``if`` chain before it binds it on every path (``if arch == 'a': model = A()`` / ``elif ...``, then ``if
    args.cuda: model = model.cuda()``)."""
    block = inits.block_of(chain, binding.scope) or []
    index = next((i for i, s in enumerate(block) if s is chain), 0)
    tops: list[Any] = [s for s in block[:index] if isinstance(s, (cst.If, cst.Try))]
    return any(id(s) in bound for s in block[:index]) or any(
        all(_binds(b, bound, tops) for b in _paths(top)) or _selects(work, top, bound, tops, binding) for top in tops)


def _selects(work: _Work, chain: Any, bound: set[int], tops: list[Any], binding: Binding) -> bool:
    """An ``if`` / ``elif`` chain with no ``else`` that picks the model by name, each branch binding it, and no
    line above it binding it: the path through no branch is the script's own NameError at the name's first
    use, whatever ddpkit does, so the chain counts as binding it on every path. Not in a loop: there that path
    keeps the last pass's model (prepared already)."""
    branches = _branches(chain)[:-1] if isinstance(chain, cst.If) and not isinstance(chain.orelse, cst.Else) else []
    inside, end = node_ids(chain), inits.line_of(work, chain)
    # (a binding in another branch of an ``if`` around this chain runs on no path through it: set 27's extra five,
    # each dataset's branch picking the model by name)
    for top in _tops(work):
        held = next((blk for blk in _blocks(top) if id(chain) in node_ids(blk)), None)
        if held is not None:
            inside |= node_ids(top) - node_ids(held)
    looped = any(id(chain) in node_ids(loop) for loop in m.findall(binding.scope.node, m.For() | m.While()))
    return len(branches) > 1 and not looped and all(_binds(b, bound, tops) for b in branches) and not any(
        b.target == binding.target and b.scope is binding.scope and b.line <= end and id(b.stmt) not in inside
        for b in work.facts.bindings)


def _branches(top: cst.If) -> list[cst.IndentedBlock]:
    """The bodies of an ``if``, its ``elif``s and its ``else``; one without an ``else`` ends with an empty list's
    stand-in (a path that runs no branch)."""
    blocks: list[cst.IndentedBlock] = []
    node: cst.If | cst.Else | None = top
    while isinstance(node, cst.If):
        blocks.append(node.body if isinstance(node.body, cst.IndentedBlock) else cst.IndentedBlock(body=[]))
        node = node.orelse
    blocks.append(node.body if isinstance(node, cst.Else) and isinstance(node.body, cst.IndentedBlock)
                  else cst.IndentedBlock(body=[]))
    return blocks


def _jumps(block: cst.IndentedBlock) -> bool:
    """A ``break`` / ``continue`` of the block itself: that path leaves the loop from there, with the model
    bound and below it no wrap (``try: model = torch.load(p); break``)."""
    return any(isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(small, (cst.Break, cst.Continue))
                                                                 for small in stmt.body) for stmt in block.body)


def _binds(block: cst.IndentedBlock, bound: set[int], tops: list[cst.If]) -> bool:
    """A statement of the block itself binds the name (not one nested in a loop or a ``try``) or leaves (``else:
    raise ValueError(arch)``: no path below the ``if`` from there), or an ``if`` chain of the block binds it in
    every branch."""
    return not _jumps(block) and any(id(stmt) in bound or _leaves(stmt) or (isinstance(stmt, (cst.If, cst.Try)) and
                                                      any(stmt is top for top in tops) and
                                                      (all(_binds(b, bound, tops) for b in _paths(stmt)) or
                                                       _picks(stmt, bound, tops)))
               for stmt in block.body)


def _picks(stmt: Any, bound: set[int], tops: list[Any]) -> bool:
    """A nested ``if`` / ``elif`` chain with no ``else`` whose every branch binds the name, as :func:`_selects` takes
    one at the top (``if arch == 'a': ... elif arch == 'b': ...`` inside each dataset's branch: set 27's extra five)."""
    branches = _branches(stmt)[:-1] if isinstance(stmt, cst.If) and not isinstance(stmt.orelse, cst.Else) else []
    return len(branches) > 1 and all(_binds(b, bound, tops) for b in branches)


def _leaves(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(small, (cst.Raise, cst.Return))
                                                             for small in stmt.body)
