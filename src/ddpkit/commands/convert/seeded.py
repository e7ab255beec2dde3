"""Noise a training step draws from torch's own generator and feeds a model, in a script that seeds that generator
(a GAN's ``torch.manual_seed(999)`` at the top, then ``netG(torch.randn(b, nz))`` each step): every rank seeds it
alike, so every rank draws the same noise, and the global batch of fakes holds N copies of B/N draws, not B
distinct ones. Nothing fails and ``verify`` (which matches the draws) passes: listed, with the fix. Unseeded, each
process starts from its own seed and draws its own noise; a draw given its own ``generator=`` is the script's.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> left = plan("import torch\\ntorch.manual_seed(1)\\nG = torch.nn.Linear(2, 2)\\n"
    ...             "opt = torch.optim.Adam(G.parameters())\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...             "    z = torch.randn(x.size(0), 2)\\n    G(z).mean().backward()\\n    opt.step()\\n").left
    >>> [x.line for x in left if "same noise" in x.what]
    [6]
"""

from __future__ import annotations

from typing import Any

import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, names_in, resolve

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

SEEDS = ("torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
         "pytorch_lightning.seed_everything", "lightning.seed_everything", "lightning.pytorch.seed_everything")
DRAWS = ("torch.randn", "torch.rand", "torch.randint", "torch.normal", "torch.randn_like", "torch.rand_like",
         "torch.randint_like", "torch.multinomial", "torch.bernoulli")


def seeded_noise(work: _Work) -> None:
    """The first such draw of a training loop, listed once (see the module)."""
    aliases = work.facts.aliases
    seed = next((c for c in work.facts.calls if resolve(dotted(c.node.func), aliases) in SEEDS), None)
    models = {b.target for b in work.models}
    if seed is None or not models:
        return
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        fed = [c for c in loop.calls if dotted(c.node.func) in models]
        for draw in loop.calls:
            if resolve(dotted(draw.node.func), aliases) not in DRAWS or \
                    any(a.keyword is not None and a.keyword.value == "generator" for a in draw.node.args):
                continue
            bound = {b.target for b in work.facts.bindings if b.value is draw.node}
            inside = {id(n) for c in fed for a in c.node.args for n in m.findall(a.value, m.Call())}
            into = next((c for c in fed if id(draw.node) in inside or
                         any(names_in(a.value) & bound for a in c.node.args)), None)
            if into is not None:
                name, drawn = dotted(into.node.func), dotted(draw.node.func)
                work.leave(draw.line, f"{drawn}(...) draws the noise {name} is fed from torch's generator, "
                           f"seeded alike on every rank (line {seed.line}): every rank draws the same noise, so "
                           "the global batch holds N copies of B/N draws, not B distinct ones", "draw it from a "
                           "generator of this rank's, made once above the loop: gen = torch.Generator(device="
                           "device).manual_seed(SEED + ddpkit.init().rank), then "
                           f"{drawn}(..., generator=gen)")
                return

