"""Files every rank would write, made rank 0's by ``ddpkit convert``: figures (``plt.savefig``, ``fig.savefig``),
image grids (``torchvision.utils.save_image``), arrays (``np.save``), tables (``df.to_csv``) and text files opened
for writing (``with open(path, "w") as f:``). Every rank holds the same results, so N writers of one file race: a
CSV opened with ``"a"`` gets each row N times, a PNG may be cut off mid-write. ``torch.save`` is
:mod:`ddpkit.commands.convert.rules`'.

A write whose path names the rank, or lies under a temporary directory, is each rank's own and stays. So does a
``with`` block that does more than write (a collective, a backward, a loop over a DataLoader): guarding it would
keep the rest from the other ranks; it is left to you with its line.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import matplotlib.pyplot as plt\\nimport ddpkit\\nstate = ddpkit.init()\\nplt.savefig('loss.png')\\n")
    >>> p.text.splitlines()[-2:]
    ['if state.is_main:', "    plt.savefig('loss.png')"]
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert.rules import main_test
from ddpkit.commands.convert.scan import Call, dotted, names_in, resolve

_Work = Any  # the plan in the making (plan._Work)

WRITERS = {"matplotlib.pyplot.savefig": "the figure", "torchvision.utils.save_image": "the image",
           "numpy.save": "the array", "numpy.savetxt": "the array", "numpy.savez": "the arrays",
           "numpy.savez_compressed": "the arrays"}
METHODS = {"savefig": "the figure", "to_csv": "the table", "to_json": "the table", "to_parquet": "the table",
           "to_excel": "the table"}  # a figure's, a pandas DataFrame's
OPENERS = ("open", "io.open", "builtins.open")
WHY = "every rank holds the same results, and N writers of one file race (an appended row N times, a file cut off)"


def writes(work: _Work) -> None:
    """Guard each file write of the script that every rank would make (see the module's docstring)."""
    opened = {id(c.node): c for c in work.facts.calls if c.name in OPENERS and _writing(c.node)}
    for call in work.facts.calls:
        what = WRITERS.get(call.name or "") or (METHODS.get(call.last) if isinstance(call.node.func, cst.Attribute)
                                                 and not (call.name or "").startswith(("torch.", "ddpkit.")) else None)
        if what is None or _ranked(call) or _per_rank(work, call.node):
            continue
        if call.stmt is None or len(call.stmt.body) != 1:
            work.leave(call.line, f"{call.last}(...) inside a larger statement: every rank writes {what}",
                       "put it on a line of its own under `if state.is_main:`")
            continue
        if id(call.stmt) not in work.edits.guard:
            work.edits.guard[id(call.stmt)] = main_test(work, call.scope)
            work.note(f"{call.last} guarded: rank 0 writes {what}", WHY, call.line)
    for block in _with_blocks(work.facts.module):
        calls = [opened[id(i.item)] for i in block.items if id(i.item) in opened]
        if not calls or any(_ranked(c) or _per_rank(work, c.node) for c in calls):
            continue
        call = calls[0]
        if not _only_writes(work, block):
            work.leave(call.line, "a file opened for writing in a block that does more than write: every rank "
                       "writes it", "move the writing into a block of its own under `if state.is_main:`")
            continue
        work.edits.guard[id(block)] = main_test(work, call.scope)
        work.note("open(..., 'w') guarded: rank 0 writes the file", WHY, call.line)


def _writing(node: cst.Call) -> bool:
    """``open(path, "w")`` / ``"a"`` / ``"wb"`` / ``mode="x"``: a mode that writes, given as a string."""
    positional = [a for a in node.args if a.keyword is None]
    mode = positional[1].value if len(positional) > 1 else next(
        (a.value for a in node.args if a.keyword is not None and a.keyword.value == "mode"), None)
    return isinstance(mode, cst.SimpleString) and any(c in mode.evaluated_value for c in "wax")


def _ranked(call: Call) -> bool:
    return any(w in test.lower() for test in call.tests for w in RANK_WORDS)


def _per_rank(work: _Work, node: cst.Call) -> bool:
    """A path that names the rank, or one under a temporary directory (followed through the names it is built
    from): each rank's own file."""
    if any("rank" in work.facts.code(a.value).lower() for a in node.args):
        return True
    names: set[str] = set().union(*(names_in(a.value) for a in node.args)) if node.args else set()
    seen: set[str] = set()
    for _ in range(3):
        values = [b.value for b in work.facts.bindings if b.target in names - seen and b.value is not None]
        if any(isinstance(v, cst.Call) and (resolve(dotted(v.func), work.facts.aliases) or "").endswith(
                ("TemporaryDirectory", "mkdtemp", "gettempdir")) for v in values):
            return True
        seen |= names
        names = names.union(*(names_in(v) for v in values))
    return False


def _with_blocks(module: cst.Module) -> list[cst.With]:
    found: list[cst.With] = []

    class Blocks(cst.CSTVisitor):
        def visit_With(self, node: cst.With) -> None:
            found.append(node)

    module.visit(Blocks())
    return found


def _only_writes(work: _Work, block: cst.With) -> bool:
    """No collective, save, backward or optimizer step inside, and no loop over a DataLoader (an evaluation
    that writes its predictions: on a sharded loader rank 0 alone would write only its part). A loop over the
    results, or ``print(..., file=f)``, is writing: on the other ranks the open alone empties what rank 0 wrote."""
    inside: set[int] = set()

    class Nodes(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            inside.add(id(node))
            return True

    block.body.visit(Nodes())
    calls = [c for c in work.facts.calls if id(c.node) in inside]
    if any((c.name or "").startswith(("ddpkit.", "torch.distributed", "torch.save")) or c.last in
           ("barrier", "all_reduce", "reduce", "all_gather", "broadcast", "backward", "step") for c in calls):
        return False
    loaders = {b.target for b in work.facts.bindings if isinstance(b.value, cst.Call) and
               (resolve(dotted(b.value.func), work.facts.aliases) or "").endswith(("DataLoader", "data_loader"))}
    return not any(id(loop.node) in inside and loop.iter_names & loaders for loop in work.facts.loops)
