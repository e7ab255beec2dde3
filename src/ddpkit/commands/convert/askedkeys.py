"""A DataLoader of a function whose returned dict another module of the project reads by key
(``fetch_dataloader(...)['train']``): which key a loader is stored under, so the one asked for training is
converted where it is built and the others kept whole.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> from ddpkit.commands.convert.crossing import Crossing
    >>> text = ("from torch.utils.data import DataLoader\\ndef get(b):\\n    te = DataLoader(c, batch_size=b)\\n"
    ...         "    return {'tr': DataLoader(a, batch_size=b, shuffle=True), 'te': te}\\n")
    >>> done = plan(text, crossing=Crossing(wants={"get()['te']": "evaluation loader",
    ...                                           "get()['tr']": "training loader"}))
    >>> print(*done.text.splitlines()[3:], sep="\\n")
        te = DataLoader(c, batch_size=b)
        return {'tr': ddpkit.data_loader(a, global_batch_size=b, shuffle=True), 'te': te}
"""

from __future__ import annotations

import ast
from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.crossing import EVAL, TRAIN
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work)


def keyed(work: _Work, call: Call, built: list[Call]) -> tuple[str, str] | None:
    """(what is asked, its kind; "": cannot be told) for a DataLoader of a function whose returned dict another
    module reads by key (cs230's ``fetch_dataloader(...)['train']``): the string key it is stored under, where
    the function writes one out; else (``dataloaders[split] = dl``) the one DataLoader written with shuffle=True,
    when it is built in the body of an ``if`` whose test names the training key (``if split == 'train':``), for
    that key, the others for the evaluation keys; None when nothing asks by key.

    >>> from ddpkit.commands.convert.plan import plan
    >>> from ddpkit.commands.convert.crossing import Crossing
    >>> text = ("from torch.utils.data import DataLoader\\ndef get(b):\\n    tr = DataLoader(a, batch_size=b, "
    ...         "shuffle=True)\\n    te = DataLoader(c, batch_size=b)\\n    return {'tr': tr, 'te': te}\\n")
    >>> print(plan(text, crossing=Crossing(wants={"get()['tr']": "training loader"})).text.splitlines()[3])
        tr = ddpkit.data_loader(a, global_batch_size=b, shuffle=True)
    """
    function = call.scope.name
    asked = {n: kind for n, kind in work.crossing.wants.items() if n.startswith(f"{function}()[") and
             n.endswith("]") and n[len(function) + 3] in "'\"" and function}
    train = [n for n, kind in asked.items() if kind == TRAIN]
    if len(train) != 1:
        return None
    keys = [f"{function}()[{k!r}]" for k in _stored_keys(work, call)]
    if keys:  # written out (``{"train": train, "val": val}``, ``loaders["val"] = dl``): the key tells
        return (train[0], TRAIN) if train[0] in keys else (keys[0], EVAL)
    mine = [c for c in built if c.scope is call.scope]
    shuffles = {id(c): _shuffle(c) for c in mine}
    shuffling = [c for c in mine if shuffles[id(c)]]
    if None in shuffles.values() or len(shuffling) != 1 or \
            not _tested_for(work, shuffling[0], ast.literal_eval(train[0][len(function) + 2:][1:-1])):
        return train[0], ""  # asked by key, and which loader that is cannot be told
    if shuffles[id(call)]:
        return train[0], TRAIN
    return f"{function}()[...]", EVAL


def _stored_keys(work: _Work, call: Call) -> list[str]:
    """The string keys its function stores ``call``'s loader under: ``{"train": DataLoader(...)}``, ``{"val":
    val}`` or ``loaders["val"] = val`` with ``val = DataLoader(...)``."""
    found = []
    pairs: list[tuple[cst.BaseExpression, cst.BaseExpression, int]] = []
    lines = {id(b): n for stmt, _, n in work.facts.statements for b in stmt.body}
    for node in m.findall(call.scope.node, m.Dict() | m.Assign()):
        if isinstance(node, cst.Dict):
            pairs += [(e.key, e.value, 1 << 30) for e in node.elements if isinstance(e, cst.DictElement)]
        elif isinstance(node, cst.Assign):
            pairs += [(t.target.slice[0].slice.value, node.value, lines.get(id(node), 0)) for t in node.targets
                      if isinstance(t.target, cst.Subscript) and len(t.target.slice) == 1
                      and isinstance(t.target.slice[0].slice, cst.Index)]
    for key_node, value, line in pairs:
        # the binding the name has where it is stored (``dl = DataLoader(val)`` reused after ``loaders["train"] =
        # dl``: the later key is the other loader's); in a dict display, the name's last binding
        held = flow.binding_of(work.facts, dotted(value) or "", call.scope, line) if dotted(value) else None
        if (value is call.node or held is not None and held.value is call.node) and \
                isinstance(key_node, cst.SimpleString):
            found.append(str(key_node.evaluated_value))
    return found


def _tested_for(work: _Work, call: Call, key_: str) -> bool:
    """``call`` is in the body (not the ``else``) of an ``if`` of its function whose test names ``key_`` (cs230's
    ``if split == 'train':``): the loader built for that key."""
    for node in m.findall(call.scope.node, m.If()):
        assert isinstance(node, cst.If)
        inside = any(c is call.node for c in m.findall(node.body, m.Call()))
        if inside and any(isinstance(s, cst.SimpleString) and s.evaluated_value == key_
                          for s in m.findall(node.test, m.SimpleString())):
            return True
    return False


def _shuffle(call: Call) -> bool | None:
    """A DataLoader's ``shuffle`` when it is written out as True or False or left out (False); None otherwise."""
    given = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
    if given is None:
        return False if not any(a.star for a in call.node.args) else None
    return {"True": True, "False": False}.get(given.value) if isinstance(given, cst.Name) else None
