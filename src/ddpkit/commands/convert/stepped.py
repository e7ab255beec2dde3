"""A training step of another module: the loop over the loader is this file's, one step of training is a method
or function of the project's other file (Graph-WaveNet's ``engine.train(x, y)`` of ``engine.py``'s ``trainer``,
which runs the forward, the backward and the optimizer step on what it is handed).

The step's file finds a backward pass in a function no line of its own calls and no loop of its own holds: it asks
(:data:`~ddpkit.commands.convert.crossing.STEP`) every file that imports it. A file that calls the step in a loop
marks that call as training (:func:`marked`: ``Facts.steps``, read by :func:`.flow.trains`), so the loop's loader
becomes a training ``ddpkit.data_loader`` there, and answers done (:func:`answer`) when every loop that runs the step
reads such a loader. The step is then said fed by its callers (kept); converted alone, or run by a caller over
batches it makes itself, it is left to you as batches fed by hand.

Example::

    >>> from ddpkit.commands.convert.crossing import settle
    >>> from ddpkit.commands.convert.plan import plan
    >>> files = {"engine.py": "class Engine:\\n    def step(self, x):\\n        self.model(x).sum().backward()\\n"
    ...                       "        self.opt.step()\\n",
    ...          "main.py": "from torch.utils.data import DataLoader\\nfrom engine import Engine\\n"
    ...                     "eng = Engine()\\nfor x in DataLoader(ds, batch_size=8):\\n    eng.step(x)\\n"}
    >>> done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    >>> done["main.py"].text.splitlines()[4], done["engine.py"].left
    ('for x in ddpkit.data_loader(ds, global_batch_size=8, shuffle=False):', [])
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.crossing import EVAL, NOT_PASSED, STEP, TRAIN, Ask, Crossing, key, want_of
from ddpkit.commands.convert.scan import Call, Facts, Scope

_Work = Any  # the plan in the making (plan._Work)


def asks(work: _Work, backwards: list[Call]) -> bool:
    """The step's file: every backward runs in a function that no call here runs and no loop here holds, so its
    batches come from the callers of another module. Each step asked of them; kept when every caller runs it over
    a training ddpkit.data_loader, else left (with the fix). False: a backward that is no such step (batches fed by
    hand here)."""
    if not backwards or not all(_step(work, b) for b in backwards):
        return False
    for scope in {id(b.scope): b.scope for b in backwards}.values():
        _ask(work, scope, next(b for b in backwards if b.scope is scope))
    return True


def _step(work: _Work, backward: Call) -> bool:
    scope = backward.scope
    return bool(scope.name) and not backward.loops and not _live(work, flow.callers(work.facts, scope))


def _live(work: _Work, calls: list[Call]) -> list[Call]:
    """``calls`` less those of the module's ``if __name__ == "__main__":`` demo, where another file of the project
    imports it: that block never runs then (set 27's GCN module with a self-test; the after-fix re-run)."""
    if work.crossing is None or not work.crossing.imported:
        return calls
    return [c for c in calls if not any("__name__" in t and "__main__" in t for t in c.tests)]


def _ask(work: _Work, scope: Scope, backward: Call) -> None:
    name = f"{STEP}:{scope.name}"
    work.asks.append(Ask("", name, TRAIN, backward.line))  # (asked whatever the answer: crossing.settle's rounds)
    work.asks.extend(Ask("", f"{STEP}:{s.name}", EVAL, backward.line) for s in _evaluating(work, scope))
    built = work.crossing.provided.get(key("", name))
    if built:
        work.keep(backward.line, f"the training step {scope.name}() left as it is", f"its callers in {built} run it in "
                  "a loop over a ddpkit.data_loader for training: each rank steps on its own shard")
        return
    fix = "run it in a loop over a torch DataLoader of the batches (made a ddpkit.data_loader for training)"
    if unreached(work.facts, scope, work.crossing.elsewhere, work.crossing.imported):
        work.keep(backward.line, f"the training step {scope.name}() left as it is", "no file of the project runs it")
        return
    if work.crossing.own:  # converted together: a caller runs it over batches it makes itself
        work.leave(backward.line, f"the training step {scope.name}() is run by a caller in the project that does not "
                   "loop over a DataLoader converted for training: each rank would train on all of its batches",
                   f"{fix}, then convert again", blocks=True)
        return
    work.leave(backward.line, f"the training step {scope.name}() takes its batches from callers in another module: "
               "each rank would train on all of them unless their loader is sharded", "convert them together (ddpkit "
               f"convert --imports SCRIPT, or a folder), or {fix}", blocks=True)


def _evaluating(work: _Work, step: Scope) -> list[Scope]:
    """The methods of the step's class that evaluate what they are handed (Graph-WaveNet's ``trainer.eval``:
    ``self.model.eval()``, or a ``no_grad`` block), with no backward, called by no line of this file."""
    found = []
    for scope in work.facts.scopes.values():
        calls = [c for c in work.facts.calls if c.scope is scope]
        if scope is step or not step.cls or scope.cls != step.cls or flow.callers(work.facts, scope) or \
                any(c.last == "backward" for c in calls):
            continue
        if any(c.no_grad or c.last == "eval" and not c.node.args for c in calls):
            found.append(scope)
    return found


def marked(facts: Facts, crossing: Crossing | None, kind: str = TRAIN) -> set[int]:
    """The calling file: the calls here that run a step another module asked about as ``kind`` (``eng.train(x,
    y)`` trains; ``eng.eval(x, y)`` evaluates)."""
    found: set[int] = set()
    for _want, module, function in _wanted(crossing, kind):
        found |= {id(c.node) for c in facts.calls if flow.runs(facts, c, module, function)}
    return found


def answer(work: _Work) -> None:
    """The calling file, once its loaders are decided: each step asked of it and run here is done when every loop
    that runs it reads a DataLoader made a training ddpkit.data_loader here; not, when one does not."""
    trained = _trained_loops(work)
    for want, module, function in _wanted(work.crossing):
        sites = [c for c in work.facts.calls if flow.runs(work.facts, c, module, function)]
        if sites:
            every = all(any(id(loop.node) in trained for loop in c.loops) for c in sites)
            work.done.append(want if every else f"{want} {NOT_PASSED}")


def _wanted(crossing: Crossing | None, kind: str = TRAIN) -> list[tuple[str, str, str]]:
    """(the want, the step's module, its function) for each step asked of this file as ``kind``."""
    return [(want, w.module, w.function) for want, wanted in (crossing.wants.items() if crossing is not None else ())
            if wanted == kind and (w := want_of(want)) is not None and w.step]


def _trained_loops(work: _Work) -> set[int]:
    """The loops (their nodes' ids) over a DataLoader this file made a training ddpkit.data_loader, or one another
    module of the project made one (``for x, _ in data.dataloader``, ``Data`` of data.py)."""
    found: set[int] = set(work.fed)
    for binding in work.facts.bindings:
        if binding.value is not None and id(binding.value) in work.sharded:
            found |= {id(loop.node) for loop in flow.loops_reading(work.facts, binding.target, binding.scope,
                                                                  since=binding)}
    for loop in work.facts.loops:  # ``for x in DataLoader(...)``: the loader built in the loop's own line
        if isinstance(loop.node, cst.For) and any(id(n) in work.sharded for n in _calls_in(loop.node.iter)):
            found.add(id(loop.node))
    return found


def _calls_in(node: cst.CSTNode) -> list[cst.CSTNode]:
    return list(m.findall(node, m.Call()))


def unreached(facts: Facts, scope: Scope, elsewhere: frozenset[str] | None, imported: bool = False) -> bool:
    """No file of the project runs ``scope``: a method of a class no file names and this one never builds (a model
    module's old self-training class the script imports and never uses, set 27's GCN), or a function no file names
    and none here calls. False when the project's names are not read (``elsewhere`` None)."""
    if elsewhere is None:
        return False
    if scope.cls is not None:  # (named anywhere but its own line: a subclass's base, a registry's entry)
        demo = [n for top in facts.module.body if imported and isinstance(top, cst.If) and
                "__main__" in facts.code(top.test) for n in m.findall(top, m.Name(scope.cls))]  # (never runs)
        # (nor the class's own ``super(OldNet, self).__init__()``: review 43)
        own = [c.args[0].value for c in m.findall(facts.module, m.Call(func=m.Name("super")))
               if isinstance(c, cst.Call) and c.args]
        named = [n for n in m.findall(facts.module, m.Name(scope.cls)) if all(n is not d for d in demo + own)]
        return scope.cls not in elsewhere and len(named) <= 1
    return bool(scope.name) and scope.name not in elsewhere and not flow.callers(facts, scope)
