"""An object of the script's own class that a training loop feeds each batch's results, read after the loop (a
CIFAR recipe's ``evaluator.update_matrix(y, out.argmax(1))`` each step, then ``return evaluator.error()``): at N
processes it holds this rank's shard of the samples only, so what is read from it (an error rate, a confusion
matrix) is rank 0's where it is shown. Convert cannot tell what the object adds up: said where it is read.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nclass Conf:\\n"
    ...          "    def __init__(self):\\n        self.n = 0\\n    def add(self, y, p):\\n        self.n += 1\\n"
    ...          "m = torch.nn.Linear(2, 2)\\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\\nconf = Conf()\\n"
    ...          "for x, y in DataLoader(ds, batch_size=4):\\n    out = m(x)\\n    out.sum().backward()\\n"
    ...          "    opt.step()\\n    conf.add(y, out.argmax(1))\\nprint(conf.n)\\n")
    >>> [k.what for k in p.kept if k.what.startswith("conf")]
    ['conf is fed each training batch (conf.add(...)) and read here']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Loop

_Work = Any  # the plan in the making (plan._Work)
# objects that record, time or follow the step rather than add up its samples (a meter's mean: listmeans.py reduces
# it; a logger's loss has its own line; a timer, an EMA, an early stopper hold no samples: review 29, 30)
KEEPERS = ("meter", "log", "timer", "clock", "writer", "monitor", "record", "saver", "stop", "ema", "average")


def accumulated(work: _Work, loop: Loop) -> None:
    """Say, at its first read below ``loop``, each object of the script's own class the loop feeds its batches'
    results (see the module)."""
    facts = work.facts
    # (the script's classes, and those it imports from a module of the project: a recipe's ``utils.Evaluator``)
    classes = {s.cls for s in facts.scopes.values() if s.cls} | {
        name for name, _, _, _ in facts.reads if name[:1].isupper() and imported_from(facts, name) is not None}
    built = {b.target: dotted(v.func) or "" for b in facts.bindings if b.scope is loop.scope and b.line < loop.line
             and isinstance(v := b.value, cst.Call) and dotted(v.func) in classes}
    made = {t for t, cls in built.items() if not any(word in cls.lower() for word in KEEPERS)}
    # (a meter read whole, ``print("loss", losses)`` formatting itself by its ``__str__``: its mean is no ``.avg``
    # listmeans.py reduces; set 29's extra five, the ImageNet example's ProgressMeter)
    meters = {t for t, cls in built.items() if any(word in cls.lower() for word in ("meter", "average"))}
    # (what the step computes from its batch, ``out`` of ``out = model(x)``: not a step counter or the model, an
    # EMA's ``ema.update(model, i)``, nor the batch alone, a timer's ``timer.tick(x)``; review 29)
    computed = {b.target for b in facts.bindings if loop.line < b.line <= loop.end and b.value is not None}
    fed = {}
    for call in loop.calls:
        func = call.node.func
        holder = dotted(func.value) if isinstance(func, cst.Attribute) else None
        if holder in made | meters and holder not in fed and \
                any(names_in(a.value) & computed for a in call.node.args):
            fed[holder] = call.last
    for name, method in fed.items():
        whole = name in meters  # (a meter: read whole only; its ``.avg`` is listmeans.py's)
        read = next((line for n, scope, line, _ in facts.reads if scope is loop.scope and line > loop.end and
                     (n == name or not whole and n.startswith(f"{name}."))), None)
        if read is not None:
            work.keep(read, f"{name} is fed each training batch ({name}.{method}(...)) and read here",
                      "it holds this rank's shard of the samples only (rank 0's where it is shown): sum its counts "
                      "across ranks (ddpkit.reduce(...)) or ddpkit.gather(...) the batches' results to read every "
                      "rank's")

