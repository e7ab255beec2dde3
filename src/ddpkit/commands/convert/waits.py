"""Where every rank passes: a barrier after a write rank 0 makes, before the ranks read it back, goes only where
no rank can route around it (not under an ``if`` other than the main guard, not in a loop, not in a function
called under one); a write and a read no function runs both owe none.

:mod:`ddpkit.commands.convert.rules` and :mod:`ddpkit.commands.convert.writes` guard the writes; this module says
where the wait goes.

Example::

    >>> main_guard("__name__ == '__main__'"), main_guard("args.save")
    (True, False)
"""

from __future__ import annotations

import sys
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert import calledorder, order
from ddpkit.commands.convert.flow import callers, in_body, scope_trains, visible
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Scope

_Work = Any  # the plan in the making (plan._Work)

BARRIER_FIX = "put ddpkit.barrier() after the save where every rank passes (outside rank- or data-dependent branches)"


def main_test(work: _Work, scope: Scope, line: int = 0, said: bool = True) -> str:
    """An expression for "this is rank 0" in ``scope``: ``state.is_main`` where the init's state is seen (not on
    a ``line`` of that scope above the init: a ``pprint`` before the device set-up)."""
    at, args = work.init_lines.get(id(scope), (0, ""))
    if line and line < at:
        if said and args and not any(x.line == line and "before the device set-up" in x.what for x in work.left):
            work.leave(line, f"this line, guarded for rank 0, comes before the device set-up at line {at}: it starts "
                       f"ddpkit with the defaults, and the set-up's ddpkit.init({args}) comes too late to choose",
                       "move it below the device set-up, then convert again")
        return "ddpkit.init().is_main"
    if any(visible(work.facts, work.state, s, scope) for s in work.inits) or \
            any(b.target == work.state and visible(work.facts, work.state, b.scope, scope)
                for b in work.facts.bindings):
        return f"{work.state}.is_main"
    return "ddpkit.init().is_main"


def unwaited(work: _Work, call: Any, line: int) -> None:
    """A save rank 0 makes with a load below and no barrier: said as the first conversion said it when the save
    is also inside a branch or a loop (a second conversion of its output says nothing new)."""
    others = [t for t in call.tests if not any(w in t.lower() for w in RANK_WORDS)]
    if others or call.loops or called_in_branch(work, call.scope):
        work.leave(call.line, f"a file is read at line {line} (maybe the one saved here), and the save is inside an "
                   "if or a loop: the other ranks may read it before rank 0 has written it", BARRIER_FIX)
        return
    work.leave(call.line, f"rank 0 saves here, and a file is read at line {line} with no barrier between: the "
               "other ranks may read it before it is written", "put ddpkit.barrier() after the save where every "
               "rank passes")


def callers_apart(work: _Work, write: Any, read: Any) -> bool:
    """Two functions no function of this file runs both (:func:`.order.apart_functions`), and, in a project, no
    other file names a runner of each (main.py calling ``save_model`` then ``load_model`` of utils.py owes a barrier
    there, so does one building a second ``Solver`` after ``train()``): a file converted alone cannot know its
    callers, said as kept."""
    if not order.apart_functions(work.facts, write, read):
        return False
    crossing = work.crossing
    if crossing is None or not crossing.own:
        return True
    writing, reading = order.runner_names(work.facts, write), order.runner_names(work.facts, read)
    # (a second ``Solver(...)`` after ``train()`` reads in ``__init__`` what the first one saved); a file that
    # names both may have told the order it runs them in (a load before the epochs' saves: calledorder.py)
    return crossing.others is not None and calledorder.apart(crossing.wants, list(crossing.others), writing, reading)


def read_back(work: _Work, save: Any, loads: list[Any]) -> list[Any]:
    """The loads that may read what ``save`` wrote: below it, or in a function (defined above, it may run after
    the save); a load above in the same block ran before (a resume at the start), and so did one in a function
    that runs once and reaches the save only through a call below the load (``main()`` loads ``--resume``, then
    calls ``train()``, which saves). The loads below the save come first (the line said is the likeliest)."""
    found = [c for c in loads if (c.line > save.line or c.scope is not save.scope and c.scope.name) and
             not order.read_first(work.facts, c, save)]
    return sorted(found, key=lambda c: (c.line < save.line, c.line))


def wait_before(work: _Work, write: Any, reads: list[Any]) -> bool:
    """A write rank 0 makes in an ``if`` or a loop, read back below at the top of the same function (``torch.load``
    of the best model after the epochs): every rank reaches that read, so a barrier just before it is one all
    ranks pass, after rank 0's last write. False, with nothing done, where the read is itself in a branch or a
    loop, in another function, or in a function called under an ``if``."""
    read = min(reads, key=lambda c: c.line)
    # (or a write in a function this one calls only above the read: ``save_checkpoint(path, model)`` under the
    # epoch loop's ``if``, then the load after the loop)
    sites = [write] if read.scope is write.scope else \
        [c for c in callers(work.facts, write.scope) if c.scope is read.scope] if write.scope.name else []
    if not sites or len(sites) < len(callers(work.facts, write.scope)) and read.scope is not write.scope:
        return False
    # the read's own line a statement of the function's body: not under a ``with`` (open's header runs first),
    # not in a block of rank 0's own (guarded: the others would never meet the barrier)
    if any(r.scope is not read.scope or [t for t in r.tests if not main_guard(t)] or r.loops or r.stmt is None
           or any(r.line <= site.line for site in sites) for r in reads) or called_in_branch(work, read.scope) or \
            not (in_body(read.stmt, read.scope) or in_main_block(work.facts.module, read.stmt)) or \
            id(read.stmt) in work.edits.guard:
        return False
    waits = [c for c in work.facts.calls if c.scope is read.scope and max(s.line for s in sites) < c.line <= read.line
             and c.stmt is not None and "ddpkit.barrier()" in work.edits.before.get(id(c.stmt), ())]
    if not waits:  # (one barrier, before the first read, does for every write above it)
        work.edits.before.setdefault(id(read.stmt), []).append("ddpkit.barrier()")
    work.note("guarded: rank 0 writes, and every rank waits for it before the read (barrier)",
              f"the file is read at line {read.line}, which every rank reaches", write.line)
    return True


def called_in_branch(work: _Work, scope: Scope, depth: int = 0) -> bool:
    """A function some call of which sits under an ``if`` (or any call of which cannot be found): a barrier in it
    would be a collective that one rank may skip."""
    if not scope.name or depth > 3:
        return False
    sites = callers(work.facts, scope)
    return not sites or any([t for t in c.tests if not main_guard(t)] or called_in_branch(work, c.scope, depth + 1)
                            for c in sites)


def branched(work: _Work, call: Any) -> bool:
    """The call is under an ``if`` (not ``if __name__ == "__main__":``), in a loop, or in a function called under
    one: a barrier beside it is a collective that one rank may skip."""
    return any(not main_guard(t) for t in call.tests) or bool(call.loops) or called_in_branch(work, call.scope)


def branch_said(work: _Work, call: Any) -> str:
    """Where :func:`branched` found ``call``, in words: under an ``if`` or a loop, or in a function no line of this
    file calls (a scaler's ``save()`` method, its callers in other files: one may call it under an ``if``)."""
    scope, sites = call.scope, [call]
    for _ in range(4):  # (up the callers: the first function no line calls, or the first call under a test)
        if any(any(not main_guard(t) for t in c.tests) or c.loops for c in sites):
            return "inside an if or a loop" if sites[0] is call else f"in {scope.name}(), called inside an if or a loop"
        if not scope.name:
            break
        sites = callers(work.facts, scope)
        if not sites:
            return f"in {scope.name}(), which no line of this file calls (a caller elsewhere may skip a barrier)"
        scope = sites[0].scope
    return "inside an if or a loop"


def in_main_block(module: cst.Module, stmt: Any) -> bool:
    """``stmt`` is a statement of the module's own ``if __name__ == "__main__":`` block (every rank runs it)."""
    return any(isinstance(top, cst.If) and top.orelse is None and main_guard(module.code_for_node(top.test)) and
               isinstance(top.body, cst.IndentedBlock) and any(s is stmt for s in top.body.body)
               for top in module.body)


def main_guard(test: str) -> bool:
    """``if __name__ == "__main__":``: every rank runs the script as its main module, so passes it."""
    return test.replace("'", '"').replace(" ", "") in ('__name__=="__main__"', '"__main__"==__name__')


def read_elsewhere(work: _Work, call: Any) -> str | None:
    """The function of another module of the project called next after the save, in the same loop (an epoch loop
    over ``range``) under no ``if``: it may load what was saved (DANN's ``test(dataset, epoch)``). None where a
    barrier after the save could be skipped by one rank (:func:`skipped_read` then names it)."""
    return _called_next(work, call) if _counted(work, call) and not any(leaves_early(lp.node) for lp in call.loops) \
        else None


def skipped_read(work: _Work, call: Any) -> str | None:
    """The function :func:`read_elsewhere` would name, where a ``continue``, ``break`` or ``return`` of the epoch
    loop may take one rank around the save (``if loss.item() > 5: continue``): a barrier there could hang, so it
    is listed instead."""
    return _called_next(work, call) if _counted(work, call) and any(leaves_early(lp.node) for lp in call.loops) \
        else None


def _counted(work: _Work, call: Any) -> bool:
    """Under no ``if`` but the main guard, in a function no line calls under one, in loops over ``range`` only."""
    return not [t for t in call.tests if not main_guard(t)] and not called_in_branch(work, call.scope) and \
        all(isinstance(lp.node, cst.For) and isinstance(lp.node.iter, cst.Call) and
            dotted(lp.node.iter.func) == "range" for lp in call.loops)


def leaves_early(loop: cst.CSTNode) -> bool:
    """A ``continue``, ``break`` or ``return`` of this loop itself (not of a loop or function inside it): a rank may
    leave a pass before its end.

    >>> import libcst as cst
    >>> leaves_early(cst.parse_statement("for e in range(3):\\n    for b in d:\\n        break\\n    f()\\n"))
    False
    >>> leaves_early(cst.parse_statement("for e in range(3):\\n    if e > 1:\\n        continue\\n    f()\\n"))
    True
    """
    def walk(node: cst.CSTNode, inner: bool) -> bool:
        if isinstance(node, cst.Return):
            return True
        if isinstance(node, (cst.Continue, cst.Break)):
            return not inner  # (an inner loop's own continue / break ends that loop's pass only)
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        inner = inner or isinstance(node, (cst.For, cst.While))
        return any(walk(child, inner) for child in node.children)

    body = getattr(loop, "body", None)
    return body is not None and walk(body, False)


def _called_next(work: _Work, call: Any) -> str | None:
    for later in work.facts.calls:
        name = dotted(later.node.func)
        # (a function: ``test(...)``, ``evaluate.test(...)``; not a method of an object another module made,
        # ``generator.eval()`` of ``from config import *``)
        objects = {read.split(".")[0] for read, _, _, _ in work.facts.reads if "." in read}  # (``generator.eval()``)
        function = "." not in name and name not in objects if name else False
        function = function or bool(name) and str(name).rsplit(".", 1)[0] in work.facts.modules
        origin = imported_from(work.facts, name) if name else None
        if later.scope is call.scope and later.line > call.line and name and later.loops == call.loops and \
                not [t for t in later.tests if not main_guard(t)] and function and origin is not None and \
                origin[0].split(".")[0] not in sys.stdlib_module_names:  # (``json.dump(opt, f)``: no module of ours)
            return name
    return None


def loaded_elsewhere(work: _Work, call: Any) -> str | None:
    """Another file of the project beside this one loads a file (``torch.load``), and the save is a statement of
    its training function's own body (after its loops, under no test, no ``return`` above it), a function no line
    here calls: its caller runs it on every rank, as a training function is. A barrier after it keeps a rank from
    reading the file before rank 0 has written it (set 27's VAE: train.py saves, then main.py calls test.py, which
    loads it: rank 1 read a half-written file). The file's name; None otherwise (a save helper a caller may run
    under its own rank's test, a save in a loop a ``continue`` may route around: review 42)."""
    loads = work.crossing.loads if work.crossing is not None else frozenset()
    scope = call.scope
    # (in epoch loops over ``range`` that nothing skips or ends early: every rank passes each save; review 43)
    looped = all(isinstance(lp.node, cst.For) and lp.over_count() and not leaves_early(lp.node) for lp in call.loops)
    outer = call.loops[0].node if call.loops else call.stmt
    if not loads or not scope.name or scope.cls or callers(work.facts, scope) or call.tests or not looped or \
            not in_body(outer, scope) or not scope_trains(work.facts, scope):
        return None
    if any(sc is scope and line < call.line and m.findall(stmt, m.Return())
           for stmt, sc, line in work.facts.statements):
        return None
    return sorted(loads)[0]


def barrier_between(work: _Work, call: Any, reads: list[Any]) -> bool:
    """The script's own ``ddpkit.barrier()`` stands before each read, in the read's function, on a line every rank
    reaching the read passes, below the write or below every call of the write's function there (a best checkpoint
    saved by ``save_checkpoint(path, model)`` under an ``if`` in the epoch loop, the barrier after the loop, then
    the load: the fix convert names, written in)."""
    def after_write(barrier: Any) -> bool:
        if barrier.scope is call.scope:
            return barrier.line > call.line
        sites = [c for c in callers(work.facts, call.scope) if c.scope is barrier.scope]
        return bool(sites) and all(site.line < barrier.line for site in sites)

    return bool(reads) and all(any(
        c.name == "ddpkit.barrier" and c.scope is r.scope and c.line < r.line and set(c.tests) <= set(r.tests) and
        all(any(lp is o for o in r.loops) for lp in c.loops) and after_write(c) for c in work.facts.calls)
        for r in reads)


def own_barrier(work: _Work, call: Any, reads: list[Any]) -> bool:
    """The script's own ``ddpkit.barrier()`` follows the write in its function, at the level of the write's own
    branch or above (marinepal's ``save()``: the file written, then the barrier): whatever the read, rank 0's
    write is waited for there; where that function runs is the script's choice, as it wrote it (a training
    function's epoch loop: the best model saved under an ``if``, then the barrier)."""
    return any(c.scope is call.scope and c.name == "ddpkit.barrier" and c.line > call.line and
               set(c.tests) <= set(call.tests) and len(c.loops) <= len(call.loops) and
               not any(r.scope is call.scope and call.line < r.line < c.line for r in reads)  # (read before it)
               for c in work.facts.calls)
