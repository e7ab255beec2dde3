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
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Binding, Call, Facts

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
    """``cls`` and every base of it, in the order Python looks up an attribute for classes that share no base
    (depth first, left to right): those of this module are followed to their own bases."""
    seen: set[str] = set()
    stack = [cls]
    while stack:
        name = stack.pop(0)
        if name in seen:
            continue
        seen.add(name)
        yield name
        stack[:0] = bases(facts.module, name)


def builds(facts: Facts, cls: str, attr: str) -> list[Binding]:
    """Every binding of ``attr`` (``self.model``) with a value in class ``cls`` of this module (``self.model =
    None`` is no build)."""
    return [b for b in facts.bindings if b.target == attr and b.scope.cls == cls and b.value is not None
            and not (isinstance(b.value, cst.Name) and b.value.value == "None")]


def _at_init(facts: Facts, cls: str, attr: str) -> Binding | None:
    """The binding of ``attr`` that building an instance runs: the last one in ``__init__``, else in a method
    ``__init__`` calls (``self._setup()``); None when neither binds it."""
    bound = builds(facts, cls, attr)
    init = [b for b in bound if b.scope.name == f"{cls}.__init__"]
    if init:
        return init[-1]
    called = {c.last for c in facts.calls if c.scope.name == f"{cls}.__init__" and (c.name or "").startswith("self.")}
    setup = [b for b in bound if b.scope.name.split(".")[-1] in called]
    return setup[-1] if setup else None


def search(facts: Facts, cls: str, attr: str) -> Binding | list[tuple[str, str]] | None:
    """Where ``cls`` (or a base of it) builds ``attr``: the binding an instance's construction runs, in this
    module; else what to ask of the modules its imported bases come from (``[(module, 'Exp_Basic.self.model')]``,
    each: one of them builds it); else the one binding a method of them makes (two that do: None, not guessed)."""
    classes = list(ancestors(facts, cls))
    for name in classes:
        binding = _at_init(facts, name, attr)
        if binding is not None:
            return binding
    asks = [(origin[0], f"{origin[1]}{SEPARATOR}{attr}") for name in classes
            if (origin := imported_from(facts, name)) is not None and not builds(facts, name, attr)]
    if asks:
        return asks
    bound = [b for name in classes for b in builds(facts, name, attr)]
    return bound[0] if len(bound) == 1 else None


def inherited(facts: Facts, target: str, call: Call) -> Binding | list[tuple[str, str]] | None:
    """Where a base class of the optimizer's class builds ``target`` (:func:`search`); None when no base class of
    it is followed to a build."""
    attr = attribute(target)
    if attr is None or call.scope.cls is None:
        return None
    found = search(facts, call.scope.cls, attr)
    return None if isinstance(found, Binding) and found.scope.cls == call.scope.cls else found


def wanted(facts: Facts, name: str) -> Binding | list[tuple[str, str]] | None:
    """What another module's ask of ``Base.self.model`` finds here (:func:`search`); None for another name.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("class B:\\n    def __init__(self):\\n        self.model = make()\\n"))
    >>> wanted(facts, "B.self.model").line, wanted(facts, "model")
    (3, None)
    """
    cls, _, attr = name.partition(SEPARATOR)
    if not attr.startswith(f"self{SEPARATOR}") or not cls.isidentifier():
        return None
    return search(facts, cls, attr)


def rebuilt(facts: Facts, attr: str, binding: Binding | None) -> Binding | None:
    """Another binding of ``attr`` in this module that builds it from itself (``self.model =
    nn.Sequential(self.model, head)`` in a subclass's ``__init__``): wrapping both would nest one prepared model in
    another."""
    return next((b for b in facts.bindings if b.target == attr and b is not binding and b.value is not None and
                 b.scope.cls is not None and attr in names_in(b.value)), None)


def wrap(work: _Work, base: Binding | list[tuple[str, str]], call: Call, attr: str) -> None:
    """Wrap the model a base class builds (:func:`inherited`): here, or asked of the base classes' modules."""
    again = rebuilt(work.facts, attr, base if isinstance(base, Binding) else None)
    if again is not None:
        work.leave(call.line, f"{attr}, which a base class builds, is built again from itself at line {again.line}: "
                   "wrapping both would put one prepared model inside another", "wrap it once, yourself, where the "
                   f"model that is trained is finally built: {attr} = ddpkit.prepare_model(...)", blocks=True)
        return
    if isinstance(base, Binding):
        binding = work._unconditional(work._source(base))
        if all(b is not binding for b in work.models):
            work.models.append(binding)
            work._wrap(binding, call)
        return
    asks(work, base, call.line)
    done = [work.crossing.provided[key(m, n)] for m, n in base if key(m, n) in work.crossing.provided]
    if done:
        work.keep(call.line, "the optimizer over the model a base class builds left as it is", "it is prepared "
                  f"where a base class builds it, in {done[0]}")
        return
    shown = ", ".join(f"{n.split(SEPARATOR)[0]} (from {m})" for m, n in base)
    work.leave(call.line, f"the model this optimizer trains, {attr}, is built by a base class imported from another "
               f"module ({shown}), and no module converted with this one builds it", "convert them together (ddpkit "
               "convert --imports SCRIPT, or a folder), or wrap it where the base class builds it: "
               f"{attr} = ddpkit.prepare_model(...)")


def asks(work: _Work, found: list[tuple[str, str]], line: int) -> None:
    """Ask each module a base class comes from for the model (whatever the answer: settle asks in rounds)."""
    work.asks.extend(Ask(module, name, MODEL, line) for module, name in found)
