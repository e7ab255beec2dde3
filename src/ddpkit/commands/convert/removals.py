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
from ddpkit.commands.convert import readback
from ddpkit.commands.convert.flow import in_body
from ddpkit.commands.convert.readback import writing
from ddpkit.commands.convert.rules import per_rank
from ddpkit.commands.convert.scan import Call
from ddpkit.commands.convert.waits import called_in_branch, in_main_block, main_guard, main_test

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

REMOVALS = ("shutil.rmtree",)


def removals(work: _Work) -> None:
    """Every removal of a folder the script makes on every rank (not one under a rank test already)."""
    for call in work.facts.calls:
        if call.name in REMOVALS and not any(w in test.lower() for test in call.tests for w in RANK_WORDS):
            remove(work, call)


def remove(work: _Work, call: Call) -> None:
    """Guard the removal (with the ``if`` / ``try`` / ``with`` that holds only it) on rank 0, then a barrier; where
    a barrier could be skipped by one rank (under another ``if``, in a loop), the guard alone, and the wait
    listed. A folder of each rank's own (a temporary directory) is each rank's to remove: left as it is."""
    small = call.stmt.body[0] if call.stmt is not None and len(call.stmt.body) == 1 else None
    if not (isinstance(small, cst.Expr) and small.value is call.node) or call.stmt is None:
        work.leave(call.line, f"{call.name} inside an expression or on a line with other statements (a lambda, a "
                   "return): every rank removes it", "put it on a line of its own, then convert again")
        return
    if call.node.args and per_rank(work, [call.node.args[0].value]):
        return
    holder: cst.BaseStatement = call.stmt
    while (outer := _sole_holder(work.facts.module, holder)) is not None:  # ``try: rmtree(d) except ...: pass``
        holder = outer
    work.edits.guard[id(holder)] = main_test(work, call.scope, call.line)
    read = _read_before(work, call)
    top = holder if _passed(work, holder, call) else _top_if(work, holder, call, read)
    if top is None or called_in_branch(work, call.scope):
        work.leave(call.line, f"{call.name} guarded (rank 0 removes), but under an if, in a loop or in a try: no "
                   "barrier was put after it, and another rank may go on before the folder is gone", "put ddpkit."
                   "barrier() after it where every rank passes")
        return
    if read is not None:  # (a clean-up after the reads: a slower rank may still be reading what rank 0 removes)
        work.edits.before.setdefault(id(top), []).append("ddpkit.barrier()")
    work.edits.after.setdefault(id(top), []).append("ddpkit.barrier()")
    work.note(f"{call.name} guarded: rank 0 removes, " + ("once every rank has read what it holds, " if read else "")
              + "then every rank waits for it (barrier)", "on every rank the removal races: one removes what "
              "another has just tested, made" + (f" or still reads (line {read})" if read else "") +
              " (FileNotFoundError, or files lost)", call.line)


def _passed(work: _Work, stmt: cst.BaseStatement, call: Call) -> bool:
    """Every rank that runs the removal's function passes ``stmt``: a statement of its own body, or of the
    module's ``if __name__ == "__main__":`` block."""
    return in_body(stmt, call.scope) or in_main_block(work.facts.module, stmt)


def _top_if(work: _Work, holder: cst.BaseStatement, call: Call, read: int | None) -> cst.BaseStatement | None:
    """The ``if`` every rank passes that holds the removal with other lines (``if os.path.exists(d):
    shutil.rmtree(d); print("cleaned")``): the barriers go around it. None for a loop or a ``try`` (a rank may
    leave it part way), or one that holds the ``read`` line the removal must wait for."""
    found = None
    for node in m.findall(work.facts.module, m.If()):  # (outer first: the last found is the innermost)
        if isinstance(node, cst.If) and _passed(work, node, call) and not main_guard(
                work.facts.module.code_for_node(node.test)) and \
                any(n is holder for n in m.findall(node, m.SimpleStatementLine())) and \
                not m.findall(node, m.For() | m.While() | m.Try() | m.Return() | m.Break() | m.Continue()):
            found = node
    inside = {id(n) for n in m.findall(found, m.Call())} if found is not None else set()
    if read is not None and any(c.line == read and id(c.node) in inside for c in work.facts.calls):
        return None  # (the read it must wait for is inside that if: no barrier before it waits for the read)
    return found


READS = (*readback.READS, "load_state_dict")  # (a checkpoint loaded into a model: its file read)


def _read_before(work: _Work, call: Call) -> int | None:
    """The line of a file read in the removal's function above it (``torch.load``, ``np.load``, ``open`` to
    read): a slower rank may still be reading there when rank 0 removes."""
    return next((c.line for c in work.facts.calls if c.scope is call.scope and c.line < call.line and
                 (c.last in READS or c.name == "open" and not writing(c.node))), None)


def _sole_holder(module: cst.Module, stmt: cst.BaseStatement) -> cst.BaseStatement | None:
    """The ``if`` (no ``elif`` / ``else``), ``try`` or ``with`` whose body is ``stmt`` alone: ``if
    os.path.exists(d): shutil.rmtree(d)``, ``try: shutil.rmtree(d)`` / ``except FileNotFoundError: pass``."""
    for node in m.findall(module, m.If() | m.Try() | m.With()):
        if isinstance(node, cst.If) and node.orelse is not None:
            continue
        body = getattr(node, "body", None)
        if isinstance(body, cst.IndentedBlock) and len(body.body) == 1 and body.body[0] is stmt:
            return node  # type: ignore[return-value]
    return None
