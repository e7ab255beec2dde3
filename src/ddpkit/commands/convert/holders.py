"""A model kept by a plain object: ``analyzer = Analyzer()`` whose ``__init__`` builds ``self.model``, then
``Adam(analyzer.model.parameters())`` (SentimentAnalysis's analyzer, the trainers and solvers that hold a model).
The object is no ``nn.Module``: ``prepare_model(analyzer)`` would fail, so the model is wrapped where the class
builds it, in this file or, for a class imported from a module of the project, asked of that module as
``Analyzer().model`` (:mod:`.crossing`). A class that derives from a Module (or from a class convert cannot see)
keeps the old way: the object itself is the model.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nclass Holder:\\n    def __init__(self):\\n        self.model = torch.nn.Linear(2, 2)\\n"
    ...         "h = Holder()\\nopt = torch.optim.SGD(h.model.parameters(), lr=1)\\n")
    >>> plan(text).text.splitlines()[4].strip()
    'self.model = ddpkit.prepare_model(torch.nn.Linear(2, 2))'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import inherited
from ddpkit.commands.convert.crossing import MODEL, Ask, key
from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Binding, Call, Facts

_Work = Any  # the plan in the making (plan._Work)


def plain(facts: Facts, cls: str) -> bool:
    """Class ``cls`` of this module derives from no Module: none of its bases, followed through this module's
    classes, names one (``nn.Module``, ``pl.LightningModule``) or comes from elsewhere (which may be one)."""
    for base in list(inherited.ancestors(facts, cls))[1:]:
        if "Module" in base or not inherited.bases(facts.module, base) and not _defined(facts, base):
            return False
    return _defined(facts, cls)


def _defined(facts: Facts, cls: str) -> bool:
    return any(s.cls == cls for s in facts.scopes.values()) or f"class {cls}" in facts.module.code


def holder(work: _Work, target: str, call: Call) -> bool:
    """Wrap ``analyzer.model`` (``target``) where the class of ``analyzer`` builds it (:mod:`.holders`); False
    when ``target`` is no attribute of an object of the script's own plain class, or of a project class whose
    module answers no."""
    parts = target.split(".")
    if len(parts) < 2 or parts[0] == "self":
        return False
    held = binding_of(work.facts, parts[0], call.scope, call.line)
    made = held.value if held is not None else None
    cls = dotted(made.func) if isinstance(made, cst.Call) else None
    if cls is None:
        return False
    attr = f"self.{parts[1]}"
    if "." not in cls and plain(work.facts, cls):
        found = inherited.search(work.facts, cls, attr)
        if not isinstance(found, Binding):
            return False
        again = built_anew(work.facts, cls, attr, found)
        if again is not None:  # ``warm_start()`` builds it anew: the wrapped one would not be the one trained
            work.leave(call.line, f"{parts[0]}.{parts[1]} is built as {cls} is made (line {found.line}) and again "
                       f"in {again.scope.name}() (line {again.line}): which one this optimizer trains cannot be told",
                       f"wrap the model yourself where the one that trains is built: {attr} = "
                       "ddpkit.prepare_model(...), then convert again", blocks=True)
            return True
        binding = work._unconditional(work._source(found))
        if all(b is not binding for b in work.models):
            work.models.append(binding)
            work._wrap(binding, call)
        return True
    origin = imported_from(work.facts, cls)
    if origin is None or origin[0].split(".")[0] not in work.facts.own:
        return False
    name = f"{origin[1]}().{parts[1]}"
    work.asks.append(Ask(origin[0], name, MODEL, call.line))  # whatever the answer: settle asks in rounds
    where = work.crossing.provided.get(key(origin[0], name))
    if where is None:
        return False
    work.keep(call.line, f"the optimizer over {parts[0]}.{parts[1]} left as it is", f"{parts[1]} is prepared where "
              f"{origin[1]} builds it, in {where}")
    return True


def wanted(facts: Facts, name: str) -> Binding | None:
    """The binding another module's ask of ``Analyzer().model`` finds here: the model its plain class builds."""
    cls, _, attr = name.partition("().")
    if not attr or not cls.isidentifier() or not attr.isidentifier() or not plain(facts, cls):
        return None
    found = inherited.search(facts, cls, f"self.{attr}")
    return found if isinstance(found, Binding) and built_anew(facts, cls, f"self.{attr}", found) is None else None


def built_anew(facts: Facts, cls: str, attr: str, found: Binding) -> Binding | None:
    """A binding of ``attr`` in a method of ``cls`` other than the one that builds it as an instance is made (and
    what ``__init__`` calls): a model built anew later (``warm_start()``, a reload), which a wrap of the first would
    miss."""
    made = {found.scope.name, f"{cls}.__init__"}
    return next((b for b in inherited.builds(facts, cls, attr) if b.scope.name not in made), None)
