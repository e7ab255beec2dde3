"""Batch-sized draws from numpy's global generator that a training step feeds a model, in a script that seeds numpy
alike on every rank (``np.random.seed(69)``, then a conditional GAN's ``fake_labels = np.random.randint(0, 10, b)``
each step): every rank draws the same labels for its part of the batch, so the global batch holds N copies of B/N
draws, not B distinct ones. Nothing fails. torch's draws take this rank's generator (:mod:`.seeded`); numpy has no
such generator in ddpkit, so the draw is listed with the torch spelling that has one. A scalar draw (``random.
uniform(0.7, 1.2)``, one soft label for the step) is alike on every rank as in one process: not listed.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import numpy as np\\nimport torch\\nfrom torch.utils.data import DataLoader\\nnp.random.seed(1)\\n"
    ...          "G = torch.nn.Embedding(10, 4)\\nopt = torch.optim.Adam(G.parameters())\\n"
    ...          "for x in DataLoader(ds, batch_size=8):\\n    c = torch.tensor(np.random.randint(0, 10, len(x)))\\n"
    ...          "    G(c).mean().backward()\\n    opt.step()\\n")
    >>> print(*[x.what.split(":")[0] for x in p.left])
    np.random.randint(...) draws what G is fed from numpy's generator, seeded alike on every rank (line 4)
"""

from __future__ import annotations

from typing import Any

import libcst.matchers as m

from ddpkit.commands.convert import flow, splits
from ddpkit.commands.convert.names import dotted, names_in

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

# numpy's draws and where their size is: (its position, keyword); the batch-sized ones (a size given)
SIZED = {"randint": 2, "normal": 2, "uniform": 2, "choice": 1, "binomial": 2, "poisson": 1, "beta": 2,
         "exponential": 1, "rand": 0, "randn": 0, "random": 0, "random_sample": 0}
TORCH = {"randint": "torch.randint(low, high, (b,), generator=ddpkit.rank_generator())",
         "normal": "torch.normal(mean, std, (b, n), generator=ddpkit.rank_generator())",
         "uniform": "torch.empty(b, n).uniform_(low, high, generator=ddpkit.rank_generator())"}


def numpy_draws(work: _Work) -> None:
    """List each batch-sized numpy draw a training loop feeds a model (see the module)."""
    seed = next((c for c in work.facts.calls if c.name == "numpy.random.seed" and c.node.args and
                 not splits.unseeded_after(work, c, 1 << 30)), None)
    models = {b.target for b in work.models}
    if seed is None or not models:
        return
    said: set[int] = set()
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        fed = [c for c in loop.calls if dotted(c.node.func) in models]
        for draw in loop.calls:
            name = draw.name or ""
            # (not a sample picture's labels under no_grad; a permutation, mixup's, reorders the rank's own rows)
            if id(draw.node) in said or not name.startswith("numpy.random.") or not _sized(draw) or draw.no_grad:
                continue
            bound = {b.target for b in work.facts.bindings if b.scope is draw.scope and b.line == draw.line and
                     b.value is not None and any(n is draw.node for n in m.findall(b.value, m.Call()))}
            for _ in range(2):  # (two steps of names made from it)
                bound |= {b.target for b in work.facts.bindings if b.scope is draw.scope and b.value is not None
                          and b.line > draw.line and names_in(b.value) & bound}
            into = next((c for c in fed if any(names_in(a.value) & bound or any(
                n is draw.node for n in m.findall(a.value, m.Call())) for a in c.node.args)), None)
            if into is None:
                continue
            said.add(id(draw.node))
            spelled = f"np.random.{draw.last}"
            work.leave(draw.line, f"{spelled}(...) draws what {dotted(into.node.func)} is fed from numpy's generator, "
                       f"seeded alike on every rank (line {seed.line}): every rank draws the same values for its "
                       "part of the batch, so the global batch holds N copies of B/N draws, not B distinct ones",
                       "draw it with torch from this rank's generator: "
                       f"{TORCH.get(draw.last, 'torch.rand(..., generator=ddpkit.rank_generator())')}, or seed "
                       "numpy per rank in training: np.random.seed(seed + ddpkit.init().rank)")


def _sized(draw: Any) -> bool:
    """The draw is given a size (``randint(0, 10, b)``, ``rand(b, 3)``, ``normal(0, 1, size=(b, n))``)."""
    at = SIZED.get(draw.last)
    args = draw.node.args
    return at is not None and (len([a for a in args if a.keyword is None and not a.star]) > at or any(
        a.keyword is not None and a.keyword.value == "size" and not m.matches(a.value, m.Name("None")) for a in args))
