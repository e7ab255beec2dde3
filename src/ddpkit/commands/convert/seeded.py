"""Noise a training step draws from torch's own generator and feeds a model, in a script that seeds that generator
(a GAN's ``torch.manual_seed(999)`` at the top, then ``netG(torch.randn(b, nz))`` each step): every rank seeds it
alike, so every rank draws the same noise, and the global batch of fakes holds N copies of B/N draws, not B
distinct ones. Nothing fails, and ``verify`` passes (it matches the draws). The draw is given this rank's generator,
``generator=ddpkit.rank_generator(device)`` (:mod:`ddpkit.runtime.rankgen`: the script's seed plus the rank, made
once per process): torch's own stream, and whatever else draws from it, stays as it was, and ``verify`` matches
these draws as it does torch's. Listed instead for a ``*_like`` draw (no generator in every torch).
Unseeded, each process starts from its own seed and draws its own noise; a draw given a ``generator=`` is the
script's.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\ntorch.manual_seed(1)\\n"
    ...          "G = torch.nn.Linear(2, 2)\\n"
    ...          "opt = torch.optim.Adam(G.parameters())\\nfor (x,) in DataLoader(ds, batch_size=8):\\n"
    ...          "    z = torch.randn(x.size(0), 2)\\n    G(z).mean().backward()\\n    opt.step()\\n")
    >>> [line.strip() for line in p.text.splitlines() if "rank_generator" in line]
    ['z = torch.randn(x.size(0), 2, generator=ddpkit.rank_generator())']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow, returns, splits
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.flagged import argument_for
from ddpkit.commands.convert.gradpen import double_grads
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.origins import imported_from

_Work = Any  # the plan in the making (plan._Work): facts, models, leave

SEEDS = ("torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
         "pytorch_lightning.seed_everything", "lightning.seed_everything", "lightning.pytorch.seed_everything")
DRAWS = ("torch.randn", "torch.rand", "torch.randint", "torch.normal", "torch.randn_like", "torch.rand_like",
         "torch.randint_like", "torch.multinomial", "torch.bernoulli")


# draws made where their first argument (a tensor) is: ``torch.normal(mu, 1.0)``, ``torch.bernoulli(p)``
TENSOR_DRAWS = ("normal", "bernoulli", "multinomial", "poisson")
# a tensor filled in place from torch's generator (InfoGAN's ``torch.zeros(b, 2).normal_()``, ``z.uniform_(-1, 1)``)
IN_PLACE = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "geometric_", "log_normal_")


# torch's factories whose ``device=`` says where the tensor filled in place lives
FACTORIES = ("torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.randn", "torch.rand", "torch.tensor",
             "torch.zeros_like", "torch.ones_like", "torch.empty_like")


def _number(value: Any) -> bool:
    """A number made from a draw (``int(torch.randint(1, 4, (1,)).item())``: a decision, alike on every rank), not
    noise."""
    numbers = m.Call(func=m.Name("int") | m.Name("float") | m.Name("bool") | m.Name("round")) | \
        m.Call(func=m.Attribute(attr=m.Name("item") | m.Name("tolist")))
    return bool(m.findall(value, numbers))


def _in_place(call: Any) -> bool:
    return isinstance(call.node.func, cst.Attribute) and call.node.func.attr.value in IN_PLACE


def _filled_device(work: _Work, tensor: Any) -> str | None:
    """Where the tensor a draw fills in place lives, as code for ``rank_generator(...)``: ``z.device`` of a name
    bound in the script (not a module: ``nn.init.normal_(w)``), the ``.to(d)`` last in its chain, or the ``device=``
    of one of torch's factories (none written: the CPU, ""); None when it cannot be told (a ``Tensor(b, n)`` of
    ``Tensor = torch.cuda.FloatTensor``, a ``.cuda()``)."""
    if isinstance(tensor, cst.Name):
        bound = any(b.target == tensor.value for b in work.facts.bindings)
        return f"{tensor.value}.device" if bound and tensor.value not in work.facts.aliases else None
    if isinstance(tensor, cst.Call) and isinstance(tensor.func, cst.Attribute) and tensor.func.attr.value == "to":
        device = next((a.value for a in tensor.args if a.keyword is None or a.keyword.value == "device"), None)
        # (not a dtype: ``.to(torch.half)``)
        dtype = isinstance(device, cst.Attribute) and (dotted(device) or "").startswith("torch.")
        return work.facts.code(device) if device is not None and not dtype else None
    if isinstance(tensor, cst.Call) and resolve(dotted(tensor.func), work.facts.aliases) in FACTORIES:
        device = next((a.value for a in tensor.args if a.keyword is not None and a.keyword.value == "device"), None)
        return work.facts.code(device) if device is not None else ""
    return None


def seeded_noise(work: _Work) -> None:
    """Each such draw of a training loop given ``generator=ddpkit.rank_generator(...)``, or listed (see the
    module)."""
    aliases = work.facts.aliases
    # (not a seed given a fresh one below it, around a dataset drawn at random: randomdata.py)
    seed = next((c for c in work.facts.calls if resolve(dotted(c.node.func), aliases) in SEEDS and
                 not splits.unseeded_after(work, c, 1 << 30)), None)
    where = f"line {seed.line}" if seed is not None else _seeded_by_import(work)
    models = {b.target for b in work.models} | _imported_models(work)
    penalties = _penalties(work)
    if where is None or not models and not work.crossing.seeded and not penalties:
        return
    done: set[int] = set()
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        # (a module's training function called with the models, seeded by the script that calls it: its params)
        handed = set(loop.scope.params) if work.crossing.seeded else set()
        _draws_fed(work, [c for c in loop.calls if not _after_steps(work, c)], models | handed, done, where)
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        _helper_draws(work, loop, models, done, where)
    if work.crossing.seeded:  # (a module's training step, no loop of its own, called by the seeded script's loop:
        # niccolot's ``train_step(g, d, g_opt, x)`` drawing ``z = torch.randn(...)``)
        for scope in (s for s in work.facts.scopes.values() if s.name and flow.scope_trains(work.facts, s)):
            # (a function with loops of its own draws per step in them only: MonoFlow's ``main`` draws its picture's
            # ``fixed_noise`` once above the epoch loop, the same on every rank as in one process; set 26)
            # (a loop of its own that trains over data: a WGAN step's weight-clipping ``for p in d.parameters()`` is
            # none, nor its critic's ``for _ in range(5)``: a step, each of whose draws is per step)
            looped = any(lp.scope is scope and flow.trains(work.facts, lp) and not lp.over_count()
                         for lp in work.facts.loops)
            _draws_fed(work, [c for c in work.facts.calls if c.scope is scope and (not looped or any(
                flow.trains(work.facts, lp) for lp in c.loops))], set(scope.params) | models, done, where)
    for scope, handed in _step_helpers(work, models):  # (a step of this file's, handed the models by the loop:
        # MonoFlow-like ``train(x, netG, netD, optD, optG, device)`` drawing ``z`` itself; set 26)
        _draws_fed(work, [c for c in work.facts.calls if c.scope is scope], handed | models, done, where)
    for scope in penalties:  # a gradient penalty's interpolation weights, drawn in a helper of its own
        _draws_fed(work, [c for c in work.facts.calls if c.scope is scope], set(scope.params) | models, done, where)
    for draw in _forward_draws(work, done):  # (a VAE's ``eps = torch.randn_like(mu)`` in the trained model's forward)
        done.add(id(draw.node))  # listed, not rewritten: the same forward evaluates too (every rank its own noise
        # would part their validation losses), and a draw may decide the network's shape (review 32)
        work.leave(draw.line, f"{dotted(draw.node.func)}(...) in {draw.scope.name}() draws from torch's generator, "
                   f"seeded alike on every rank ({where}): in training every rank draws the same noise for its part "
                   "of the batch", "if it is noise over the batch, draw it from this rank's generator in training "
                   "only: generator=ddpkit.rank_generator(x.device) when self.training")


def _after_steps(work: _Work, call: Any) -> bool:
    """A draw in a loop over a count (an epoch's ``for epoch in range(n)``) below the training loops it holds: once
    an epoch, after its steps, under no_grad: a picture's samples (a GAN's ``z = torch.randn(10, nz)``; set 26's
    re-run), alike on every rank as in one process; not a WGAN's generator step after its critic's loop."""
    loop = call.loops[-1] if call.loops else None
    if loop is None or not loop.over_count() or not call.no_grad:  # (a picture's, under no_grad: not a WGAN's
        return False  # generator step after its critic loop in ``for it in range(N)``, review 41)
    inner = [lp for lp in work.facts.loops if loop in lp.outer and flow.trains(work.facts, lp)]
    return bool(inner) and call.line > max(lp.end for lp in inner)


def _step_helpers(work: _Work, models: set[str]) -> list[tuple[Any, set[str]]]:
    """The functions of this file a training loop calls with models (its step), each with the parameters the
    models are handed as (every call passing a model there, from a training loop)."""
    found = []
    # (one that trains: a preview helper ``show(netG, i)`` drawing a fixed-size z under no_grad is none; review 40)
    for scope in (s for s in work.facts.scopes.values() if s.name and not s.cls and flow.scope_trains(work.facts, s)):
        sites = flow.callers(work.facts, scope)
        if not sites or not all(site.loops and flow.trains(work.facts, site.loops[-1]) for site in sites):
            continue
        handed = set()
        for param in scope.params:
            given = [argument_for(site, param, scope, (flow.callee(work.facts, site) or (None, 0))[1])
                     for site in sites]
            if all(dotted(g) in models for g in given if g is not None) and any(g is not None for g in given):
                handed.add(param)
        if handed:
            found.append((scope, handed))
    return found


def _helper_draws(work: _Work, loop: Any, models: set[str], done: set[int], where: str) -> None:
    """Noise a helper returns to the training loop, which feeds it to a model (InfoGAN's ``z = noise_sample(...)``):
    a helper of this file has its draws given this rank's generator; one imported, whose body this file cannot
    rewrite, is listed when its name says noise."""
    fed = {n for c in loop.calls if dotted(c.node.func) in models for a in c.node.args for n in names_in(a.value)}
    for call in loop.calls:
        bound = {b.target for b in work.facts.bindings if call.node in (b.value, b.whole)}
        if not bound & fed:
            continue
        target = flow.callee(work.facts, call)
        # (only a helper no other line calls outside training: one that also builds a fixed validation set, or
        # data, must draw alike on every rank there)
        if target is not None and not target[0].cls and all(
                site.loops and flow.trains(work.facts, site.loops[-1]) for site in flow.callers(work.facts, target[0])):
            returned = {id(n) for whole in returns.at(work.facts, target[0], -1)
                        for value in returns.through(work.facts, target[0], whole) for n in m.findall(value, m.Call())}
            for draw in (c for c in work.facts.calls if c.scope is target[0] and id(c.node) in returned):
                if id(draw.node) in done or resolve(dotted(draw.node.func), work.facts.aliases) not in DRAWS or \
                        any(a.keyword is not None and a.keyword.value == "generator" for a in draw.node.args):
                    continue
                done.add(id(draw.node))
                _own_generator(work, draw, "the model", where)
            continue
        name = dotted(call.node.func) or ""
        origin = imported_from(work.facts, name) if target is None else None
        if origin is not None and origin[0].split(".")[0] in work.facts.own and id(call.node) not in done and \
                any(w in name.rsplit(".", 1)[-1].lower() for w in ("noise", "latent", "random")):
            done.add(id(call.node))
            work.leave(call.line, f"{name}() of another module likely draws the noise the model is fed from torch's "
                       f"generator, seeded alike on every rank ({where}): every rank would draw the same noise",
                       "give its draws this rank's generator: generator=ddpkit.rank_generator(device) there")


def _forward_draws(work: _Work, done: set[int]) -> list[Any]:
    """The draws made in the ``forward`` of a class of the script's whose instance an optimizer trains here: every
    training step makes them, for the batch."""
    classes = {s.cls for s in work.facts.scopes.values() if s.cls}
    trained = {dotted(c.func) for b in work.models if b.value is not None for c in m.findall(b.value, m.Call())
               if isinstance(c, cst.Call)} & classes
    # (or in a method ``forward`` calls on ``self``: a VAE's ``eps = self.reparameterize(x)``; the after-fix re-run)
    called = {f"{c.scope.cls}.{c.last}" for c in work.facts.calls if c.scope.cls in trained and
              c.scope.name.endswith(".forward") and dotted(c.node.func) == f"self.{c.last}"}
    return [c for c in work.facts.calls if c.scope.cls in trained and (c.scope.name.endswith(".forward") or
                                                                       c.scope.name in called) and
            id(c.node) not in done and resolve(dotted(c.node.func), work.facts.aliases) in DRAWS and
            not any(a.keyword is not None and a.keyword.value == "generator" for a in c.node.args)]


def _draws_fed(work: _Work, calls: list[Any], models: set[str], done: set[int], where: str) -> None:
    """Each draw among ``calls`` fed to a call of one of ``models``: in its arguments, or through names bound to it
    and to what is made from it (a GP's ``alpha``, then ``x = alpha * real + (1 - alpha) * fake``, then ``D(x)``)."""
    aliases = work.facts.aliases
    # (or a helper handed a model with it: ``d_loss_fn(netD, real, torch.randn(b, nz), crit)``)
    fed = [c for c in calls if dotted(c.node.func) in models or any(dotted(a.value) in models for a in c.node.args)]
    inside = {id(n) for c in fed for a in c.node.args for n in m.findall(a.value, m.Call())}
    for draw in calls:
        if id(draw.node) in done or resolve(dotted(draw.node.func), aliases) not in DRAWS and not _in_place(draw) or \
                any(a.keyword is not None and a.keyword.value == "generator" for a in draw.node.args):
            continue
        # (bound to it, or to what is made of it on that line: ``noise = (torch.rand(b, 8) - 0.5) / 0.5``)
        bound = {b.target for b in work.facts.bindings if b.value is draw.node or b.scope is draw.scope and
                 b.line == draw.line and b.value is not None and not _number(b.value) and
                 any(n is draw.node for n in m.findall(b.value, m.Call()))}
        filled = dotted(draw.node.func.value) if _in_place(draw) else None  # (``z.normal_()``: z is the noise)
        bound |= {filled} if filled else set()
        for _ in range(2):  # (two steps of names made from it, in its function)
            bound |= {b.target for b in work.facts.bindings if b.scope is draw.scope and b.value is not None and
                      b.line > draw.line and names_in(b.value) & bound}
        into = next((c for c in fed if id(draw.node) in inside or
                     any(names_in(a.value) & bound for a in c.node.args)), None)
        if into is not None:
            done.add(id(draw.node))
            _own_generator(work, draw, str(dotted(into.node.func)), where)


def _penalties(work: _Work) -> list[Any]:
    """The functions that differentiate a model's output with respect to its input (``torch.autograd.grad(...,
    create_graph=True)``: a WGAN-GP's gradient penalty, :func:`.gradpen.double_grads`)."""
    return [c.scope for c in double_grads(work.facts) if c.scope.name]


def _own_generator(work: _Work, draw: Any, fed: str, seeded: str) -> None:
    """The draw made from this rank's generator, or listed where it cannot take one (see the module)."""
    if _in_place(draw):  # (drawn where the tensor it fills is)
        method = draw.node.func.attr.value
        device = _filled_device(work, draw.node.func.value)
        if device is None:
            work.leave(draw.line, f".{method}() fills the noise {fed} is fed from torch's generator, seeded alike on "
                       f"every rank ({seeded}): every rank draws the same noise", f"draw it from this rank's "
                       f"generator: .{method}(..., generator=ddpkit.rank_generator(device)), the tensor's device")
            return
        made = f"ddpkit.rank_generator({device})"
        work.edits.expr[id(draw.node)] = lambda node: add_keyword(node, "generator", made)
        work.note(f".{method}() -> .{method}(generator={made})", f"the noise {fed} is fed: the script seeds torch's "
                  f"generator alike on every rank ({seeded}), so each would draw the same noise; this rank's generator "
                  "(torch's seed plus the rank, made once) draws its own", draw.line)
        return
    drawn = str(dotted(draw.node.func))
    if drawn.endswith("_like"):  # (``*_like`` take no generator in every torch)
        work.leave(draw.line, f"{drawn}(...) draws the noise {fed} is fed from torch's generator, seeded alike on "
                   f"every rank ({seeded}): every rank draws the same noise, so the global batch holds N "
                   "copies of B/N draws, not B distinct ones", f"draw it from this rank's generator: "
                   f"{drawn.removesuffix('_like')}(x.shape, device=x.device, generator=ddpkit.rank_generator("
                   "x.device))")
        return
    device = next((a.value for a in draw.node.args if a.keyword is not None and a.keyword.value == "device"), None)
    where = work.facts.code(device) if device is not None else ""
    first = draw.node.args[0].value if draw.node.args and draw.node.args[0].keyword is None else None
    if device is None and drawn.rsplit(".", 1)[-1] in TENSOR_DRAWS and first is not None:
        where = _device_of(work, first)  # (``torch.bernoulli(p)``: drawn where ``p`` is)
    made = f"ddpkit.rank_generator({where})"
    work.edits.expr[id(draw.node)] = lambda node: add_keyword(node, "generator", made)
    work.note(f"{drawn}(...) -> {drawn}(..., generator={made})", f"the noise {fed} is fed: the script seeds "
              f"torch's generator alike on every rank ({seeded}), so each would draw the same noise; this rank's "
              "generator (torch's seed plus the rank, made once) draws its own", draw.line)


def _device_of(work: _Work, tensor: Any) -> str:
    """Where a tensor argument is: ``mu.device`` of ``mu.expand(b, 4)``; the ``device=`` it is made with
    (``torch.full(..., device=device)``); "" (the CPU) when neither is written."""
    root = tensor
    while isinstance(root, (cst.Call, cst.Attribute, cst.Subscript)):
        root = root.func if isinstance(root, cst.Call) else root.value
    if isinstance(root, cst.Name) and root.value not in ("torch", "np", "numpy", "F"):
        return f"{root.value}.device"
    made = next((a.value for a in m.findall(tensor, m.Arg(keyword=m.Name("device"))) if isinstance(a, cst.Arg)),
                None)
    return work.facts.code(made) if made is not None else ""


def _imported_modules(work: _Work) -> set[str]:
    """The modules this file imports, or imports names from (``config`` of ``from config import *``)."""
    return set(work.facts.modules.values()) | {full.rsplit(".", 1)[0] for full in work.facts.aliases.values()
                                               if "." in full}


def _seeded_by_import(work: _Work) -> str | None:
    """``in config.py``: a module of the project this file imports from seeds torch's generator (a DCGAN's
    ``from config import *`` whose config.py calls ``torch.manual_seed(0)`` at import); None otherwise."""
    found = sorted(_imported_modules(work) & set(work.crossing.seeded)) or sorted(work.crossing.seeded)
    # (or a seeding module that imports this one, or shares an importer with it (crossing.py): the main script's
    # ``torch.manual_seed(999)`` seeds the process's generator before it calls this module's training function)
    return f"in {found[0].replace('.', '/')}.py" if found else None


def _imported_models(work: _Work) -> set[str]:
    """The names this file reads from a module of the project, where torch's generator is seeded by one (a
    ``generator`` of ``from config import *`` that config.py builds and prepares): what the noise may be fed to."""
    if not work.crossing.seeded:
        return set()
    return {name for name, _, _, _ in work.facts.reads if "." not in name and imported_from(work.facts, name)}
