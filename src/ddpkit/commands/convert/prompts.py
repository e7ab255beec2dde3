"""A script that asks the terminal (``name = input('name: ')``): under ``ddpkit launch`` only rank 0 reads the
terminal, and every other rank's ``input()`` ends at once with EOFError (a forecasting repository's model name,
asked before training, killed rank 1). Listed where it is asked, with the way to share rank 0's answer; not
rewritten: the answer may be needed before ``ddpkit.init()`` can run.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> done = plan("import torch\\nfrom torch.utils.data import DataLoader\\nname = input('name: ')\\n"
    ...             "net = torch.nn.Linear(2, 1)\\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\\n"
    ...             "for x, y in DataLoader(ds, batch_size=8):\\n    net(x).sum().backward()\\n    opt.step()\\n")
    >>> [(x.line, x.what[:40]) for x in done.left if "input" in x.what]
    [(3, 'input() reads the terminal, which under ')]
"""

from __future__ import annotations

from typing import Any

import libcst.matchers as m

from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

ASKS = ("input", "builtins.input", "getpass.getpass")


def prompts(work: _Work) -> None:
    """Leave a line at the first question a file that prepares a model asks the terminal."""
    call = next((c for c in work.facts.calls if c.name in ASKS and not _guarded(work, c) and not _shared(work, c)),
                None)
    if call is None or not work.models:
        return
    work.leave(call.line, f"{call.last}() reads the terminal, which under ddpkit launch only rank 0 has: every other "
               "rank's ends at once with EOFError", f"take the answer from a command-line argument, or ask rank 0 "
               f"alone and share it: answer = ddpkit.broadcast({call.last}(...) if ddpkit.init().is_main else None)")


def _guarded(work: _Work, call: Call) -> bool:
    """The question sits in a block the plan made rank 0's (cs-kd's ``if os.path.isdir(logdir): input(...)``,
    guarded with the folder it asks about): only rank 0 asks."""
    guarded = [node for node in m.findall(work.facts.module, m.If() | m.SimpleStatementLine() | m.With() | m.For())
               if id(node) in work.edits.guard]
    return any(node is call.node for block in guarded for node in m.findall(block, m.Call()))


def _shared(work: _Work, call: Call) -> bool:
    """Asked by rank 0 alone already: under a test of ``is_main``, or inside ``ddpkit.broadcast(...)`` (the fix
    this line names, applied)."""
    inside = call.stmt is not None and any(
        c.name == "ddpkit.broadcast" and any(n is call.node for n in m.findall(c.node, m.Call()))
        for c in work.facts.calls if c.stmt is call.stmt)
    return inside or any("is_main" in t or "rank == 0" in t for t in call.tests)
