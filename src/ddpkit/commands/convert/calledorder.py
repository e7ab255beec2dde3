"""The order in which a project's file runs the functions it imports from another of its modules, told to that
module: a UNet lesson's train.py calls util.py's ``load`` before its epochs (a resume) or in its test mode, and
``save`` in the epochs, so no run reads a checkpoint after a save; util.py alone cannot know, and left a barrier to
the user (:func:`.waits.callers_apart`).

Each file that calls two functions of one module says, per ordered pair, whether a call of the second may run
after a call of the first (:data:`~ddpkit.commands.convert.crossing.ORDER`); the module owes no barrier between a
write in the first and a read in the second when every file that names both said no.

Example::

    >>> import json
    >>> told = {json.dumps(["save", "load", False, "train.py"]): ORDER}
    >>> apart(told, [frozenset({"save", "load"})], {"save"}, {"load"}), apart({}, [frozenset({"save", "load"})],
    ...                                                                        {"save"}, {"load"})
    (True, False)
"""

from __future__ import annotations

import json
from typing import Any

import libcst as cst

from ddpkit.commands.convert import order
from ddpkit.commands.convert.crossing import ORDER, Ask
from ddpkit.commands.convert.instances import instance_class
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work)


def tell(work: _Work) -> None:
    """Tell each module of the project two or more of whose functions this file calls whether the second of a
    pair may run after the first here (a project's files only)."""
    if not work.crossing.own:
        return
    called: dict[tuple[str, str], list[Call]] = {}  # (module, function) -> its calls here
    for call in work.facts.calls:
        origin = imported_from(work.facts, dotted(call.node.func) or "") or _method_of(work, call)
        if origin is not None and "." not in origin[1]:
            called.setdefault(origin, []).append(call)
    for (module, first), firsts in called.items():
        for (other, second), seconds in called.items():
            if other == module and second != first:
                may = any(_may_follow(work, later, earlier) for earlier in firsts for later in seconds)
                work.asks.append(Ask(module, json.dumps([first, second, may]), ORDER, seconds[0].line))


def _method_of(work: _Work, call: Call) -> tuple[str, str] | None:
    """(module, method) for ``model.save_to(...)`` where ``model`` is bound here to an instance of a class that
    module defines (``model = Model(...)``, ``from build_gan import Model``): named by the method alone, as
    :func:`.order.runner_names` names it there."""
    func = call.node.func
    if not isinstance(func, cst.Attribute) or not isinstance(func.value, (cst.Name, cst.Attribute)):
        return None
    origin = instance_class(work.facts, func.value, call.scope, call.line)
    return (origin[0], func.attr.value) if origin is not None else None


def _may_follow(work: _Work, later: Call, earlier: Call) -> bool:
    """``later`` may run after ``earlier`` in one run: below it, in another function, or in a loop around both;
    not when it runs first in every run or never in the same run (:func:`.order.read_first`)."""
    around = any(lp is other for lp in later.loops for other in earlier.loops)
    # (a function that runs both may run twice, called from elsewhere: SCINet's ``Exp.train``, a second experiment's
    # resume reading the first one's save; the module's own lines, or a function called once here, run once)
    again = later.scope is earlier.scope and bool(later.scope.name) and (
        not order.called_once_or_top(work.facts, later.scope) or _named_elsewhere(work, later.scope.name))
    placed = later.line > earlier.line or later.scope is not earlier.scope and bool(later.scope.name) or around or \
        again
    return placed and (around or not order.read_first(work.facts, later, earlier))


def _named_elsewhere(work: _Work, function: str) -> bool:
    """Another file of the project may call ``function`` (its names, when known; unknown: it may): review, a
    sweep.py that runs train.py's ``main()`` twice, its second run reading the first one's save."""
    names = work.crossing.elsewhere
    if "." not in function and not work.crossing.imported:  # (a function of a file no other file imports: no one
        return False  # else calls it, whatever the name means there, DiscoGAN's ``self.main`` of models.py)
    return names is None or function.rsplit(".", 1)[-1] in names


def apart(wants: dict[str, str], others: list[frozenset[str]], writing: set[str], reading: set[str]) -> bool:
    """No file runs a function named in ``reading`` after one named in ``writing``: every file that names one of
    each (``others``, each other file's names) told so (``wants``, the asks of this module)."""
    naming = [names for names in others if writing & names and reading & names]
    told = [json.loads(w) for w, kind in wants.items() if kind == ORDER]
    pairs = [t for t in told if t[0] in writing and t[1] in reading]
    return len({t[3] for t in pairs}) >= len(naming) and not any(t[2] for t in pairs)
