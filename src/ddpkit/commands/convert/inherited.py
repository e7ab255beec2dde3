"""A model its base class builds: an optimizer in ``Exp_Main.train`` over ``self.model``, which
``Exp_Basic.__init__`` sets (``self.model = self._build_model().to(self.device)``, the experiment classes of the
time-series forecasting repositories). The model is wrapped where the base class builds it: in this file, or,
for a base class imported from another module of the project, asked of that module as ``Exp_Basic.self.model``
(:mod:`.crossing`), whose plan wraps it there.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nclass Base:\\n    def __init__(self):\\n        self.model = torch.nn.Linear(2, 2)\\n"
    ...         "class Exp(Base):\\n    def train(self, ld):\\n"
    ...         "        opt = torch.optim.SGD(self.model.parameters(), lr=1)\\n")
    >>> plan(text).text.splitlines()[4].strip()
    'self.model = ddpkit.prepare_model(torch.nn.Linear(2, 2))'
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert.crossing import MODEL, Ask, key
from ddpkit.commands.convert.scan import Binding, Call, Facts, dotted, imported_from

_Work = Any  # the plan in the making (plan._Work)

SEPARATOR = "."  # an ask's name for a class's attribute: ``Exp_Basic.self.model``


def attribute(target: str) -> str | None:
    """``self.model`` of ``self.model`` or ``self.model.encoder`` (what a base class binds); None for another name.

    >>> attribute("self.model.fc"), attribute("model")
    ('self.model', None)
    """
    parts = target.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "self" else None


def bases(module: cst.Module, cls: str) -> list[str]:
    """The dotted names of the bases of the module's class ``cls`` (``object`` and keywords left out).

    >>> import libcst as cst
    >>> bases(cst.parse_module("class A(b.Base, object, metaclass=M):\\n    pass\\n"), "A")
    ['b.Base']
    """
    for node in m.findall(module, m.ClassDef()):
        if isinstance(node, cst.ClassDef) and node.name.value == cls:
            return [d for a in node.bases if a.keyword is None and (d := dotted(a.value)) and d != "object"]
    return []


def ancestors(facts: Facts, cls: str) -> Iterator[str]:
    """Every base of ``cls``, nearest first: those of this module are followed to their own bases."""
    seen: set[str] = {cls}
    queue = bases(facts.module, cls)
    while queue:
        base = queue.pop(0)
        if base in seen:
            continue
        seen.add(base)
        yield base
        queue += bases(facts.module, base)


def built_in(facts: Facts, cls: str, attr: str) -> Binding | None:
    """The binding of ``attr`` (``self.model``) that class ``cls`` of this module makes with a value, ``__init__``'s
    last one first (``self.model = None`` is no build); None when it makes none."""
    bound = [b for b in facts.bindings if b.target == attr and b.scope.cls == cls and b.value is not None
             and not (isinstance(b.value, cst.Name) and b.value.value == "None")]
    init = [b for b in bound if b.scope.name.endswith(".__init__")]
    return (init or bound)[-1] if bound else None


def inherited(facts: Facts, target: str, call: Call) -> Binding | tuple[str, str] | None:
    """Where a base class of the optimizer's class builds ``target``: its binding when that class is in this
    module; (the module, ``Base.self.model``, the name to ask of it) when it is imported from one; None when no
    base class builds it."""
    attr = attribute(target)
    if attr is None or call.scope.cls is None:
        return None
    for base in ancestors(facts, call.scope.cls):
        binding = built_in(facts, base, attr)
        if binding is not None:
            return binding
        origin = imported_from(facts, base)
        if origin is not None:
            return origin[0], f"{origin[1]}{SEPARATOR}{attr}"
    return None


def wanted(facts: Facts, name: str) -> Binding | None:
    """The binding another module asks to be wrapped by the name ``Base.self.model``; None for another name.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("class B:\\n    def __init__(self):\\n        self.model = make()\\n"))
    >>> wanted(facts, "B.self.model").line, wanted(facts, "model")
    (3, None)
    """
    cls, _, attr = name.partition(SEPARATOR)
    if not attr.startswith(f"self{SEPARATOR}") or not cls.isidentifier():
        return None
    return built_in(facts, cls, attr)


def wrap(work: _Work, base: Binding | tuple[str, str], call: Call) -> None:
    """Wrap the model a base class builds (:func:`inherited`): here, or asked of the base class's module."""
    if isinstance(base, Binding):
        binding = work._unconditional(work._source(base))
        if all(b is not binding for b in work.models):
            work.models.append(binding)
            work._wrap(binding, call)
        return
    module, name = base
    cls, attr = name.split(SEPARATOR, 1)
    work.asks.append(Ask(module, name, MODEL, call.line))  # whatever the answer: settle asks in rounds
    if key(module, name) in work.crossing.provided:
        work.keep(call.line, "the optimizer over the model a base class builds left as it is", f"it is prepared "
                  f"where {cls} builds it, in {work.crossing.provided[key(module, name)]}")
        return
    work.leave(call.line, f"the model this optimizer trains is built by {cls}, a base class imported from {module}, "
               "and convert does not follow a name from one module to another outside a project", "convert them "
               f"together (ddpkit convert --imports SCRIPT, or a folder), or wrap it in {module} where it is built: "
               f"{attr} = ddpkit.prepare_model(...)")
