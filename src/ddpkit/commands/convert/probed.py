"""A name chosen by probing the file system: ``while os.path.exists(d): run += 1; d = f"logs/run-{run}"`` (kefth's
``logs/<model>/run-N``). Each rank probes on its own while another may have made its folder already, so the ranks can
pick different names: rank 0 writes under one, the others leave empty folders behind. The names the loop binds are
made rank 0's right after it, ``run, d = ddpkit.broadcast([run, d])`` (JSON between ranks: strings and numbers);
every rank then makes rank 0's folder, ``exist_ok`` (:mod:`.folders`). Only where every rank runs the loop once: the
module's top level or its main block, below ``ddpkit.init()``; elsewhere listed.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import os\\nrun = 0\\nd = 'run-0'\\nwhile os.path.exists(d):\\n    run += 1\\n"
    ...             "    d = 'run-{}'.format(run)\\nos.mkdir(d)\\n").text
    >>> [line for line in text.splitlines() if "broadcast" in line]
    ['d, run = ddpkit.broadcast([d, run])']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.waits import in_main_block

_Work = Any  # the plan in the making (plan._Work)
EXISTS = ("os.path.exists", "os.path.isdir", "os.path.isfile", "os.path.lexists")


def probed(work: _Work) -> None:
    """``ddpkit.broadcast`` of what each probing ``while`` loop binds (see the module)."""
    facts = work.facts
    for loop in facts.loops:
        node = loop.node
        if not isinstance(node, cst.While) or not _probes(facts, node.test):
            continue
        names = sorted({b.target for b in facts.bindings if b.scope is loop.scope and loop.line < b.line <= loop.end
                        and "." not in b.target} |
                       {a.target.value for a in m.findall(node.body, m.AugAssign(target=m.Name()))})  # type: ignore
        if not names:
            continue
        once = any(top is node for top in facts.module.body) or in_main_block(facts.module, node)
        later = [first for sid, (first, _) in work.init_lines.items() if sid != id(loop.scope) or first > loop.line]
        if not once or later:
            work.leave(loop.line, f"{', '.join(names)} chosen by testing which files exist: each rank tests on its "
                       "own while another may have made its folder, so the ranks can pick different names",
                       f"take rank 0's where every rank passes, below ddpkit.init(): {', '.join(names)} = "
                       "ddpkit.broadcast(...) right after the loop")
            continue
        line = f"{names[0]} = ddpkit.broadcast({names[0]})" if len(names) == 1 else \
            f"{', '.join(names)} = ddpkit.broadcast([{', '.join(names)}])"
        work.edits.after.setdefault(id(node), []).append(line)
        work.note(line, "a name chosen by testing which files exist: each rank tests on its own while another may "
                  "have made its folder; rank 0's on every rank", loop.line)


def _probes(facts: Any, test: cst.BaseExpression) -> bool:
    """The test asks whether a path exists: ``os.path.exists(d)``, ``Path(d).exists()``, ``p.is_dir()``."""
    for call in m.findall(test, m.Call()):
        assert isinstance(call, cst.Call)
        if resolve(dotted(call.func), facts.aliases) in EXISTS or \
                isinstance(call.func, cst.Attribute) and call.func.attr.value in ("exists", "is_dir", "is_file"):
            return True
    return False
