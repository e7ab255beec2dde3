"""A DataLoader drawn from once, before the loops (a fixed batch of images to show every epoch): no training step
reads it, so convert leaves it as it is, not sharded.

pytorch-vqvae writes ``fixed_images, _ = next(iter(test_loader))``; recurrent-visual-attention ``data_iter =
iter(sample_loader)`` then ``images, labels = data_iter.next()``. A loader read in a loop, or whose iterator is
stepped in one, feeds training: not this.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> kept = plan("import torch\\nfrom torch.utils.data import DataLoader\\nshown = DataLoader(ds, batch_size=9)\\n"
    ...             "it = iter(shown)\\nfixed = next(it)\\n").kept
    >>> [k.what.split(" left")[0] for k in kept]
    ['a DataLoader drawn from once (next(iter(shown)) outside any loop)']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Call

# the plan in the making (plan._Work): facts
_Work = Any


def drawn_once(work: _Work, binding: Any) -> bool:
    """Every read of the loader's name is ``next(iter(name))`` outside any loop (vqvae's fixed images)."""
    draws = {id(c.node.args[0].value) for c in work.facts.calls if c.last == "iter" and not c.loops and
             len(c.node.args) == 1 and dotted(c.node.args[0].value) == binding.target and c.scope is binding.scope}
    # (``fixed, _ = next(iter(loader))`` a statement of its own: not a lambda's body, called every step)
    nexts = {id(a.value) for c in work.facts.calls if c.last == "next" and _assigned(c) for a in c.node.args}
    iters = [c for c in work.facts.calls if c.last == "iter" and id(c.node.args[0].value) in draws]
    reads = [node for name, scope, line, node in work.facts.reads
             if name == binding.target and scope is binding.scope and line >= binding.line]
    return bool(reads) and all(id(node) in draws for node in reads) and \
        all(id(c.node) in nexts or _stepped_once(work, c) for c in iters)


def _stepped_once(work: _Work, call: Call) -> bool:
    """``it = iter(loader)`` then only ``next(it)`` / ``it.next()`` outside any loop (recurrent-visual-attention's
    sample of images to show)."""
    first = call.stmt.body[0] if call.stmt is not None else None
    if not (isinstance(first, cst.Assign) and first.value is call.node and len(first.targets) == 1 and
            isinstance(first.targets[0].target, cst.Name)):
        return False
    name = first.targets[0].target.value
    # each step a statement of its own (``x, y = next(it)``: not a comprehension's, a lambda's or a return's, which
    # may run many times), in the same function
    steps = [c for c in work.facts.calls if c.scope is call.scope and c.line > call.line and _assigned(c) and (
        c.last == "next" and len(c.node.args) == 1 and dotted(c.node.args[0].value) == name or
        c.last in ("next", "__next__") and isinstance(c.node.func, cst.Attribute) and
        dotted(c.node.func.value) == name)]
    # every read of the name, in any function (a helper stepping the same iterator: ``return next(it)``)
    used = [node for read, scope, line, node in work.facts.reads
            if (scope is not call.scope or line > call.line) and read.split(".")[0] == name]
    stepped = {id(c.node.args[0].value) if c.node.args else id(c.node.func) for c in steps}
    stepped |= {id(c.node.func.value) for c in steps if isinstance(c.node.func, cst.Attribute)}
    return bool(steps) and not any(c.loops for c in steps) and all(id(node) in stepped for node in used)


def _assigned(call: Call) -> bool:
    """``call`` is the whole value of an assignment statement."""
    first = call.stmt.body[0] if call.stmt is not None else None
    return isinstance(first, cst.Assign) and first.value is call.node


def drawing_loops(work: _Work, binding: Any) -> list[Any]:
    """The loops that draw a batch from the loader by hand each pass (``seq, target = next(iter(dl))`` in the
    epoch loop: rasbt's character RNN): the innermost loop around each ``iter(name)``. What they size from the
    batch size is read as a training loop's is (:mod:`ddpkit.commands.convert.batch`)."""
    if binding is None:
        return []
    found = [c.loops[-1] for c in work.facts.calls if c.last == "iter" and c.loops and len(c.node.args) == 1 and
             dotted(c.node.args[0].value) == binding.target and c.scope is binding.scope]
    return list({id(loop): loop for loop in found}.values())



def peeked(work: _Work, bindings: list[Any]) -> list[int]:
    """The lines of ``next(iter(loader))`` outside any loop, for the loader these bind, where its value goes (the
    ways of :func:`~ddpkit.commands.convert.flow.loops_reading`): a DCGAN's ``real_batch = next(iter(dataloader))``,
    whose images it saves. Sharded for training, that batch is this rank's part of one.

    >>> from ddpkit.commands.convert.plan import plan
    >>> kept = plan("import torch\\nfrom torch.utils.data import DataLoader\\nm = torch.nn.Linear(2, 1)\\n"
    ...             "o = torch.optim.SGD(m.parameters(), lr=1)\\nld = DataLoader(ds, batch_size=8)\\nfor x in ld:\\n"
    ...             "    m(x).sum().backward()\\n    o.step()\\nshown = next(iter(ld))\\n").kept
    >>> [k.line for k in kept if "rank 0's part" in k.what]
    [9]
    """
    iters = {id(c.node.args[0].value): c for c in work.facts.calls if c.last == "iter" and not c.loops and
             len(c.node.args) == 1}
    nexts = {id(a.value) for c in work.facts.calls if c.last == "next" and not c.loops for a in c.node.args[:1]}

    stepped = {b.target for b in work.facts.bindings if id(b.value) in {id(c.node) for c in iters.values()}}

    def pick(facts: Any, name: str, scope: Any, reached: Any) -> list[Any]:
        # (``next(iter(loader))``, or ``it = iter(loader)`` then ``images, labels = next(it)``: a tutorial's peek)
        return [read for read in facts.reads if read[0] == name and (
            id(read[3]) in iters and id(iters[id(read[3])].node) in nexts or name in stepped and id(read[3]) in nexts)
            and flow.visible(facts, name, scope, read[1]) and reached(read[1], read[2])]
    return sorted({read[2] for b in bindings for read in flow.reading(work.facts, b.target, b.scope, pick, since=b)})


def said_peeked(work: _Work, bindings: list[Any]) -> None:
    """Each :func:`peeked` line of a loader sharded for training, said (built here, or in another module of the
    project: an InfoGAN's ``next(iter(get_data(...)))`` picture of the training images)."""
    for line in peeked(work, bindings):
        work.keep(line, "next(iter(...)) takes one batch of this rank's shard: its part of one (B/N samples at N "
                  "processes), so what is shown or saved from it is rank 0's part", "to keep a whole batch: "
                  "ddpkit.gather(t) each of its tensors (on every rank), or draw it from the dataset")
