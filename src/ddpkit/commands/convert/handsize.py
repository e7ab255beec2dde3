"""A batch size one module hands to a loader another module builds, and its own training loop reads as well
(improved-wgan-pytorch's ``load_data(..., batch_size=batch_size)`` in training_utils.py, beside
``gen_rand_noise(batch_size)`` and ``calc_gradient_penalty(..., batch_size, ...)`` in train.py's loop).

Made the loader's global batch, each rank would take B/N while the loop sized its noise and its penalty's ``alpha``
for B: a crash at the first step, or a silent mismatch. The loop's file asks the loader's module
(:data:`~ddpkit.commands.convert.crossing.SIZED`: which argument of which function its training loop reads, where),
and the loader keeps its batch per process there, listed (:func:`read_elsewhere`), as a loop in its own file would.

Example::

    >>> import json
    >>> want = json.dumps(["load_data", "batch_size", "", "batch_size", 11, "train.py"])
    >>> read_elsewhere({want: SIZED}, "load_data", ["root", "batch_size"], {"batch_size"})
    'the training loop in train.py reads batch_size at line 11 (handed to load_data() as batch_size)'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.bysplit import base
from ddpkit.commands.convert.crossing import SIZED, Ask, key
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Call, Loop

_Work = Any  # the plan in the making (plan._Work)


def ask(work: _Work, read_in: Callable[[set[str], list[Loop], Call], tuple[str, int] | None]) -> None:
    """Ask the module of each function imported from the project and called above (or in) a training loop of its
    scope, its value held (``loader = load_data(root, batch_size=batch_size)``), about each argument the loop reads
    too (``read_in(names, loops, call)``: the read and its line, outside prints and the call itself); the asked
    module keeps a loader's batch per process where that argument is its batch size."""
    if work.per_process_batch or not work.crossing.own:  # (a project's files only: a lone script asks no one)
        return
    held = {id(b.whole) for b in work.facts.bindings if b.whole is not None}
    for made in work.facts.calls:
        func = dotted(made.node.func)
        origin = imported_from(work.facts, func) if func and id(made.node) in held else None
        loops = [lp for lp in work.facts.loops if lp.scope is made.scope and lp.end >= made.line and
                 flow.trains(work.facts, lp)] if origin is not None else []
        if origin is None or "." in origin[1] or not loops:
            continue
        # (the loops over what it returns, as a loader's own loops are read in one file: not the epoch loop around
        # them, whose ``torch.randn(args.batch_size, z_dim)`` draws a picture's latents, a VAE's)
        bound = {b.target for b in work.facts.bindings if b.whole is made.node}
        loops = [lp for lp in loops if lp.iter_names & bound] or loops
        position = 0
        for arg in made.node.args:
            if arg.star:
                break  # positions after ``*args`` cannot be told
            where = arg.keyword.value if arg.keyword is not None else f"#{position}"
            position += arg.keyword is None
            subscript = isinstance(arg.value, cst.Subscript)
            written = dotted(arg.value) or (work.facts.code(arg.value) if subscript else None)
            for name, suffix in _named(work, written):  # (``cfg['batch_size']``: DeepConvGAN's, read as written)
                read = read_in({name}, loops, made)
                if read is not None:
                    asked = json.dumps([origin[1], where, suffix, read[0], read[1]])
                    work.asks.append(Ask(origin[0], asked, SIZED, made.line))


def _named(work: _Work, held: str | None) -> list[tuple[str, str]]:
    """(name, suffix) of an argument ``held``: itself, and each attribute of it the script reads that may name a
    batch size (``args.batch_size`` of ``args``, suffix ``.batch_size``)."""
    if held is None:
        return []
    found = {r for r, _scope, _line, _node in work.facts.reads if r.startswith(held + ".") and
             any(w in r.rsplit(".", 1)[-1].lower() for w in ("batch", "bs"))}
    return [(held, "")] + [(r, r[len(held):]) for r in sorted(found)]


def kept(work: _Work, origin: tuple[str, str]) -> bool:
    """Whether ``origin``'s module (``(module, 'load_data()')``) answered that it kept a batch size per process for
    one of this file's asks about that function (the loop's own sizes then hold)."""
    function = base(origin[1]).split("(")[0]
    return any(a.kind == SIZED and a.module == origin[0] and json.loads(a.name)[0] == function and
               key(a.module, a.name) in work.crossing.provided for a in work.asks)


def read_elsewhere(wants: dict[str, str], function: str, params: list[str], names: set[str]) -> str | None:
    """Why a loader built in ``function`` (its ``params``, ``self`` left out) with a batch size going by ``names``
    keeps it per process: another file's training loop reads what it hands in as that batch size (``wants``, the
    asks of this file); None when none does."""
    for want, kind in wants.items():
        if kind != SIZED:
            continue
        called, where, suffix, read, line, rel = json.loads(want)
        index = int(where[1:]) if where.startswith("#") else -1
        param = params[index] if 0 <= index < len(params) else where if where in params else None
        if called == function and param is not None and param + suffix in names:
            return f"the training loop in {rel} reads {read} at line {line} (handed to {function}() as {param})"
    return None


def answered(wants: dict[str, str], function: str, params: list[str], names: set[str]) -> list[str]:
    """The wants :func:`read_elsewhere` found (said done, so the asking file knows the batch stayed per process)."""
    return [w for w in wants if wants[w] == SIZED and read_elsewhere({w: SIZED}, function, params, names)]
