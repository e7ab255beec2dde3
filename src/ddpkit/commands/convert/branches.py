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
from ddpkit.commands.convert.scan import Binding, Call

# the plan in the making (plan._Work): facts, edits, note
_Work = Any


def place(work: _Work, binding: Binding, optimizer: Call) -> bool:
    """Wrap ``binding``'s model below the outermost ``if`` chain whose every branch binds it (and below the
    initialisations that follow it: :func:`ddpkit.commands.convert.inits.place`); False: no chain does, or the
    optimizer is inside it."""
    chain = _exhaustive(work, binding)
    if chain is None or optimizer.stmt is None or id(optimizer.stmt) in node_ids(chain):
        return False
    if inits.place(work, binding, [], anchor=chain):
        return True
    target = binding.target
    work.edits.after.setdefault(id(chain), []).append(f"{target} = ddpkit.prepare_model({target})")
    work.note(f"{target} = ddpkit.prepare_model({target}) below the if/else, not in one branch (line "
              f"{binding.line})", f"every branch of the if binds {target}: prepared whichever branch runs (a "
              "wrap in one branch leaves the model of the others a separate copy on each rank)", binding.line)
    return True


def _exhaustive(work: _Work, binding: Binding) -> cst.If | None:
    """The outermost ``if`` chain that holds ``binding`` in one of its branches and binds its target in all."""
    ifs = [node for node in m.findall(work.facts.module, m.If()) if isinstance(node, cst.If)]
    elifs = {id(node.orelse) for node in ifs if isinstance(node.orelse, cst.If)}
    tops = [node for node in ifs if id(node) not in elifs]
    bound = {id(b.stmt) for b in work.facts.bindings
             if b.target == binding.target and b.scope is binding.scope and b.value is not None}
    found: cst.If | None = None
    node: cst.BaseStatement | None = binding.stmt
    while node is not None:
        chain = next((top for top in tops if any(s is node for block in _branches(top) for s in block.body)), None)
        if chain is None or not all(_binds(block, bound, tops) for block in _branches(chain)):
            break
        found = node = chain
    return found


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


def _binds(block: cst.IndentedBlock, bound: set[int], tops: list[cst.If]) -> bool:
    """A statement of the block itself binds the name (not one nested in a loop or a ``try``), or an ``if`` chain
    of the block binds it in every branch."""
    return any(id(stmt) in bound or (isinstance(stmt, cst.If) and any(stmt is top for top in tops)
                                     and all(_binds(b, bound, tops) for b in _branches(stmt)))
               for stmt in block.body)
