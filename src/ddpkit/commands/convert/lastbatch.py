"""A size the training loop takes from its batch and the code after the loop reads (a GAN's ``batch_size =
real.shape[0]`` in the loop, then ``netG(torch.randn(batch_size, nz))`` for the epoch's sample grid): with the
global batch kept, each rank's batch is B/N, so what is sized after the loop is this rank's share of the last
batch, half the original's grid at 2 processes. Said where it is read (a size, not a result: nothing to reduce).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> kept = plan("import torch\\nfrom torch.utils.data import DataLoader\\nG = torch.nn.Linear(2, 2)\\n"
    ...             "opt = torch.optim.Adam(G.parameters())\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...             "    n = x.shape[0]\\n    G(x).mean().backward()\\n    opt.step()\\n"
    ...             "grid = G(torch.randn(n, 2))\\n").kept
    >>> [(k.line, k.what) for k in kept if "last batch" in k.why]
    [(9, 'n, bound in the training loop from its batch (line 6), is read after it')]
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow, sizes
from ddpkit.commands.convert.names import measured

_Work = Any  # the plan in the making (plan._Work): facts, log, keep


def last_batch_size(work: _Work) -> None:
    """Each such size, said once, at its first read after the loop (see the module)."""
    if not sizes.global_batch_kept(work):
        return
    for loop in (lp for lp in work.facts.loops if isinstance(lp.node, cst.For) and flow.trains(work.facts, lp)):
        for bound in work.facts.bindings:
            if bound.scope is not loop.scope or not loop.line < bound.line <= loop.end or bound.value is None or \
                    measured(bound.value) not in loop.targets:
                continue
            again = min((b.line for b in work.facts.bindings if b.target == bound.target and b.scope is loop.scope
                         and b.line > loop.end), default=1 << 30)
            read = next((line for name, scope, line, _ in work.facts.reads if name == bound.target and
                         scope is loop.scope and loop.end < line < again), None)
            if read is not None:
                work.keep(read, f"{bound.target}, bound in the training loop from its batch (line {bound.line}), is "
                          "read after it", "this rank's share of the last batch: B/N at N processes (the original "
                          "sized it B), as what it sizes here (a sample, a grid) is")
                return

