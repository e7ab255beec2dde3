"""Where a name the script reads comes from: one of the project's own modules (``from Arch.model import model as
net``), a library, or the script itself. Convert follows a name to its module only in the first case.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> imported_from(scan(parse("from data import train_loader\\n")), "train_loader")
    ('data', 'train_loader')
"""

from __future__ import annotations

from ddpkit.commands.convert.names import BUILTINS, LIBRARIES
from ddpkit.commands.convert.scan import Facts


def imported_from(facts: Facts, name: str) -> tuple[str, str] | None:
    """(the module, the name there) a name (or its head: ``model`` of ``model.fc``) comes from, when the script
    imports it from a module of its own (``from Arch.model import model as net``; ``import Arch.model as am`` then
    ``am.model``) and never binds it itself; None otherwise (bound here, not imported, or from a library: torch,
    torchvision, ...).

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from Arch.model import model as net\\nimport torch, data.sets as ds\\n"))
    >>> imported_from(facts, "net.fc"), imported_from(facts, "torch.nn"), imported_from(facts, "ds.train_loader")
    (('Arch.model', 'model'), None, ('data.sets', 'train_loader'))
    """
    parts = name.split(".")
    if any(b.target == parts[0] for b in facts.bindings):
        return None
    for k in range(len(parts) - 1, 0, -1):  # ``import pkg.data``: ``pkg.data.train_loader`` is data's
        module = facts.modules.get(".".join(parts[:k]))
        if module is not None:  # (``tr.Trainer`` of ``from . import trainer as tr``: where its init takes it from)
            module, _, name = facts.exported.get(f"{module}.{parts[k]}", f"{module}.{parts[k]}").rpartition(".")
            return None if _library(facts, module) else (module, name)
    full = facts.aliases.get(parts[0])
    starred = [m for k, m in facts.modules.items() if k.startswith("* ")]
    named = {m.split(".")[-1] for k, m in facts.modules.items() if k.startswith("** ")}  # (``tqdm`` of tqdm's star)
    # (not a library the star-imported module imports and so hands on: ``torch.save`` of ``from config import *``
    # whose config.py imports torch is torch's)
    handed_on = len(parts) > 1 and (_library(facts, parts[0]) or parts[0] in STAR_ALIASES)
    if full is None and len(starred) == 1 and parts[0] not in BUILTINS and parts[0] not in named and not handed_on:
        return starred[0], parts[0]  # ``from params import *``: a name read and never bound here is its (not len)
    defining = [m for m in starred if f"*{m}.{parts[0]}" in facts.exported]  # (packages.exports: which defines it)
    if full is None and defining and parts[0] not in BUILTINS:
        return defining[-1], parts[0]  # (the last star import that defines it binds it, as Python does)
    if full is None or "." not in full or parts[0] in facts.modules:
        return None
    module, remote = full.rsplit(".", 1)
    # a relative import (``from .model import net``) is not followed: its module is its package's
    return None if not module or module.startswith(".") or _library(facts, module) else (module, remote)


# the names libraries are imported as by habit (``import numpy as np``), which a star import hands on
STAR_ALIASES = {"np", "nn", "F", "plt", "optim", "pd", "cudnn", "vutils", "transforms", "dist"}


def _library(facts: Facts, module: str) -> bool:
    """A library's module, not the project's: a project's ``datasets.py`` beside the script shadows HF datasets."""
    return module.split(".")[0] in LIBRARIES and module.split(".")[0] not in facts.own
