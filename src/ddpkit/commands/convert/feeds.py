"""Where an evaluation loop's loader comes from, when a call hands its function one (``evaluate(self.val_loader)``):
followed through the names that copy it (a trainer's ``self.val_loader = val_loader``) and the functions that
return it, to the ``DataLoader(...)`` it was built by. A loop whose sums are reduced across ranks must be fed only
sharded loaders: one left whole would count N times.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nfrom torch.utils.data import DataLoader\\nfrom data import other\\n"
    ...         "def ev(dl):\\n    n = 0\\n    with torch.no_grad():\\n        for x in dl:\\n            n += 1\\n"
    ...         "    return n\\ntest_dl = DataLoader(ds, batch_size=4)\\nprint(ev(test_dl), ev(other))\\n")
    >>> [x.what[:40] for x in plan(text).left if x.blocks]
    ['the evaluation loop here also runs over ']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow, handedin, returns
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Binding, Loop

_Work = Any  # the plan in the making (plan._Work)

LOADER = "torch.utils.data.DataLoader"


def unsharded_feed(work: _Work, loop: Loop) -> tuple[str, int, str | None, str] | None:
    """(the argument, its line, the function of this file that built it with the training loader's line, why a
    ``ddpkit.data_loader`` there is no fix: kept whole for another loop's results, or one already) of a call that
    hands the loop's function, as the parameter it loops over, something other than a DataLoader built in this file
    (one imported from another module, say): a loader this plan does not shard."""
    scope = loop.scope
    params = handedin.reads(work, loop) & set(scope.params)
    built = {id(c.node) for c in work.facts.calls if c.name == LOADER}
    by_hand = {id(c.node) for c in work.facts.calls if c.name == "ddpkit.data_loader"}
    for call in work.facts.calls if params else ():
        target = flow.callee(work.facts, call)
        if target is None or target[0] is not scope:
            continue
        for param in params:
            arg = flow.argument_for(call, param, scope, target[1])
            # ``valid_loader if valid_loader else test_loader``: each name it may pass
            options = [arg.body, arg.orelse] if isinstance(arg, cst.IfExp) else [arg]
            for option in options:
                name = dotted(option) if option is not None else None
                bound = _followed(work, flow.binding_of(work.facts, name, call.scope, call.line) if name else None)
                made = _made(work, bound)
                if bound is None or id(made) not in built or id(made) in work.plain or \
                        id(made) in work.sharded and bound.value is None:  # (the builder's training line: char-cnn)
                    why = "a loader kept whole (another loop keeps results of it that cannot be summed)" if \
                        id(made) in work.plain else "a ddpkit.data_loader written in (its other loops convert does " \
                        "not follow)" if id(made) in by_hand else ""
                    return (name or "an expression", call.line, _builder(work, bound), why)
    return None


def _followed(work: _Work, bound: Binding | None) -> Binding | None:
    """``bound`` through the names it copies (a trainer's ``self.val_loader = val_loader``, a parameter of its
    ``__init__``, to the loader its one caller passes): the binding of what it holds."""
    for _ in range(flow.DEPTH):
        name = dotted(bound.value) if bound is not None and bound.value is not None else None
        further = flow.binding_of(work.facts, name, bound.scope, bound.line) if bound is not None and name else None
        if further is None or further is bound:
            break
        bound = further
    return bound


def _made(work: _Work, bound: Binding | None) -> cst.BaseExpression | None:
    """The DataLoader call ``bound`` holds: its value, or the element a function of this file returns for it
    (``train_dl, val_dl = get_loaders(args)``: ``val_dl = DataLoader(...)`` in ``get_loaders``, returned second)."""
    if bound is None or bound.value is not None or not isinstance(bound.whole, cst.Call):
        return bound.value if bound is not None else None
    made = next((c for c in work.facts.calls if c.node is bound.whole), None)
    target = flow.callee(work.facts, made) if made is not None else None
    if target is None:
        return None
    for element in returns.at(work.facts, target[0], bound.index):
        held = flow.binding_of(work.facts, dotted(element) or "", target[0], 1 << 30) if dotted(element) else None
        return held.value if held is not None else element
    return None


def _builder(work: _Work, bound: Binding | None) -> str | None:
    """The function of this file that returned ``bound`` when it builds a training DataLoader too (char-cnn's
    ``make_data_loader()`` for both the training and the validation loader): one DataLoader line, two roles."""
    made = next((c for c in work.facts.calls if bound is not None and c.node is bound.whole), None)
    target = flow.callee(work.facts, made) if made is not None else None
    if target is None or not any(c.name == LOADER and c.scope is target[0] and id(c.node) not in work.plain
                                 for c in work.facts.calls):
        return None
    return target[0].name
