"""Noise a training step draws from torch's own generator and feeds a model, in a script that seeds that generator
(a GAN's ``torch.manual_seed(999)`` at the top, then ``netG(torch.randn(b, nz))`` each step): every rank seeds it
alike, so every rank draws the same noise, and the global batch of fakes holds N copies of B/N draws, not B
distinct ones. Nothing fails and ``verify`` (which matches the draws) passes. The draw is given a generator of this
rank's, made above the training loop from the script's seed plus the rank (``torch.Generator(device=device)
.manual_seed(torch.initial_seed() + ddpkit.init().rank)``): the script's own stream, and whatever else draws from
it, stays as it was. Listed instead where that cannot be written (a ``*_like`` draw, a device the loop makes).
Unseeded, each process starts from its own seed and draws its own noise; a draw given a ``generator=`` is the
script's.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\ntorch.manual_seed(1)\\n"
    ...          "G = torch.nn.Linear(2, 2)\\n"
    ...          "opt = torch.optim.Adam(G.parameters())\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...          "    z = torch.randn(x.size(0), 2)\\n    G(z).mean().backward()\\n    opt.step()\\n")
    >>> [line.strip() for line in p.text.splitlines() if "noise_generator" in line]
    ['noise_generator = torch.Generator().manual_seed(torch.initial_seed() + ddpkit.init().rank)', \
'z = torch.randn(x.size(0), 2, generator=noise_generator)']
"""

from __future__ import annotations

from typing import Any

import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import imported_from

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

SEEDS = ("torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
         "pytorch_lightning.seed_everything", "lightning.seed_everything", "lightning.pytorch.seed_everything")
DRAWS = ("torch.randn", "torch.rand", "torch.randint", "torch.normal", "torch.randn_like", "torch.rand_like",
         "torch.randint_like", "torch.multinomial", "torch.bernoulli")


def seeded_noise(work: _Work) -> None:
    """The first such draw of a training loop, listed once (see the module)."""
    aliases = work.facts.aliases
    seed = next((c for c in work.facts.calls if resolve(dotted(c.node.func), aliases) in SEEDS), None)
    where = f"line {seed.line}" if seed is not None else _seeded_by_import(work)
    models = {b.target for b in work.models} | _imported_models(work)
    if where is None or not models:
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
                _own_generator(work, loop, draw, str(dotted(into.node.func)), where)
                return


def _own_generator(work: _Work, loop: Any, draw: Any, fed: str, seeded: str) -> None:
    """The draw made from a generator of this rank's, or listed (see the module)."""
    drawn = str(dotted(draw.node.func))
    top = (loop.outer or [loop])[0]
    device = next((a.value for a in draw.node.args if a.keyword is not None and a.keyword.value == "device"), None)
    made_in_loop = device is not None and (dotted(device) is None or any(
        b.target == str(dotted(device)).split(".")[0] and top.line <= b.line <= top.end and b.scope is loop.scope
        for b in work.facts.bindings))
    if drawn.endswith("_like") or made_in_loop:
        work.leave(draw.line, f"{drawn}(...) draws the noise {fed} is fed from torch's generator, seeded alike on "
                   f"every rank ({seeded}): every rank draws the same noise, so the global batch holds N "
                   "copies of B/N draws, not B distinct ones", "draw it from a generator of this rank's, made once "
                   "above the loop: gen = torch.Generator(device=device).manual_seed(torch.initial_seed() + "
                   f"ddpkit.init().rank), then {drawn}(..., generator=gen)")
        return
    taken = {b.target for b in work.facts.bindings}
    name = next(n for n in ("noise_generator", *(f"noise_generator{k}" for k in range(2, 99))) if n not in taken)
    where = f"device={work.facts.code(device)}" if device is not None else ""
    library = drawn.rsplit(".", 1)[0]
    work.edits.before.setdefault(id(top.node), []).append(
        f"{name} = {library}.Generator({where}).manual_seed({library}.initial_seed() + ddpkit.init().rank)")
    work.edits.expr[id(draw.node)] = lambda node: add_keyword(node, "generator", name)
    work.note(f"{drawn}(...) -> {drawn}(..., generator={name})", f"the noise {fed} is fed: the script seeds torch's "
              f"generator alike on every rank ({seeded}), so each would draw the same noise; {name}, made "
              "above the training loop from that seed plus the rank, draws this rank's own", draw.line)


def _imported_modules(work: _Work) -> set[str]:
    """The modules this file imports names from, or itself (``config`` of ``from config import *``)."""
    starred = {m for k, m in work.facts.modules.items()}
    return starred | {full.rsplit(".", 1)[0] for full in work.facts.aliases.values() if "." in full}


def _seeded_by_import(work: _Work) -> str | None:
    """``in config.py``: a module of the project this file imports from seeds torch's generator (a DCGAN's
    ``from config import *`` whose config.py calls ``torch.manual_seed(0)`` at import); None otherwise."""
    found = sorted(_imported_modules(work) & set(work.crossing.seeded))
    return f"in {found[0].replace('.', '/')}.py" if found else None


def _imported_models(work: _Work) -> set[str]:
    """The names this file reads from a module of the project, where torch's generator is seeded by one (a
    ``generator`` of ``from config import *`` that config.py builds and prepares): what the noise may be fed to."""
    if not work.crossing.seeded:
        return set()
    return {name for name, _, _, _ in work.facts.reads if "." not in name and imported_from(work.facts, name)}
