"""A folder wiped at start-up (``if os.path.exists(out): shutil.rmtree(out)`` then ``os.makedirs(out)``): rank 0
wipes it, and every rank waits for that before going on.

On every rank the wipe races: one rank tests that the folder exists, another removes it first
(FileNotFoundError), or a late rank removes the folder the others have made and written into. The whole ``if``
that holds only the removal is guarded, and a barrier follows it where every rank passes.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import os, shutil\\nif os.path.exists('out'):\\n    shutil.rmtree('out')\\n"
    ...             "os.makedirs('out')\\n").text
    >>> text.splitlines()[2:6]
    ['if ddpkit.init().is_main:', "    if os.path.exists('out'):", "        shutil.rmtree('out')", 'ddpkit.barrier()']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert.rules import called_in_branch, main_guard, main_test
from ddpkit.commands.convert.scan import Call

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

REMOVALS = ("shutil.rmtree",)


def removals(work: _Work) -> None:
    """Every removal of a folder the script makes on every rank (not one under a rank test already)."""
    for call in work.facts.calls:
        if call.name in REMOVALS and not any(w in test.lower() for test in call.tests for w in RANK_WORDS):
            remove(work, call)


def remove(work: _Work, call: Call) -> None:
    """Guard the removal (with the ``if`` that holds only it) on rank 0, then a barrier; where a barrier could be
    skipped by one rank (under another ``if``, in a loop), the guard alone, and the wait listed."""
    if call.stmt is None or len(call.stmt.body) != 1:
        work.leave(call.line, f"{call.name} on a line with other statements: every rank removes it", "put it on a "
                   "line of its own, then convert again")
        return
    holder: cst.BaseStatement = call.stmt
    tests = list(call.tests)
    outer = _sole_if(work.facts.module, call.stmt)
    if outer is not None:
        holder = outer
        tests.remove(work.facts.code(outer.test))
    work.edits.guard[id(holder)] = main_test(work, call.scope)
    if any(not main_guard(t) for t in tests) or call.loops or called_in_branch(work, call.scope):
        work.leave(call.line, f"{call.name} guarded (rank 0 removes), but under an if or in a loop: no barrier "
                   "was put after it, and another rank may go on before the folder is gone", "put ddpkit."
                   "barrier() after it where every rank passes")
        return
    work.edits.after.setdefault(id(holder), []).append("ddpkit.barrier()")
    work.note(f"{call.name} guarded: rank 0 removes, then every rank waits for it (barrier)", "on every rank the "
              "removal races: one removes what another has just tested or made (FileNotFoundError, or files lost)",
              call.line)


def _sole_if(module: cst.Module, stmt: cst.BaseStatement) -> cst.If | None:
    """The ``if`` (no ``elif`` / ``else``) whose body is ``stmt`` alone: ``if os.path.exists(d): shutil.rmtree(d)``."""
    return next((node for node in m.findall(module, m.If()) if isinstance(node, cst.If) and node.orelse is None
                 and isinstance(node.body, cst.IndentedBlock) and len(node.body.body) == 1
                 and node.body.body[0] is stmt), None)
