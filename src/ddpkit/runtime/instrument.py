"""The instrumentation seam: the hooks a launching tool (``ddpkit verify``, ``ddpkit bench``) plugs into a run.

The library owns the contract, :class:`Hooks`, whose methods do nothing; it knows no tool. :func:`ddpkit.init`
calls :func:`from_env` once: in a normal run ``DDPKIT_TOOL`` is unset and the hooks are :data:`NONE` (no
entry-point lookup, nothing to pay). A tool's command sets ``DDPKIT_TOOL`` for its workers; the entry point of
that name in the ``ddpkit.tools`` group (declared in pyproject.toml, as modes are in ``ddpkit.strategies``), or
the ``module:factory`` it spells out (what verify and bench set, so an uninstalled checkout works), is a
factory ``environ -> Hooks``, and the hooks it returns keep everything the tool measures or changes: verify's in
:mod:`ddpkit.commands.verify.hooks`, bench's in :mod:`ddpkit.commands.bench.hooks`. ``prepare_model`` and
``data_loader`` call the hooks, so model.py and data read no tool variable.

Example::

    >>> from_env({}) is NONE, NONE.train_batch(32), NONE.uneven("pad")
    (True, 32, 'pad')
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.core import contract
from ddpkit.strategies.comm import CommConfig

ENTRY_POINTS = "ddpkit.tools"
OnShutdown = Callable[[Callable[[], None]], None]


class Hooks:
    """What the library calls, in the order a script meets it; every method a no-op here. A tool subclasses
    it and overrides what it needs (a subclass of the hooks of a newer ddpkit keeps working: the new methods
    do nothing)."""

    def on_budget(self, budget_mb: float, optimizer_slots: int) -> bool:
        """``init_empty(budget_mb=...)`` is about to check the budget; False: the tool skips the check (``ddpkit
        plan`` counts every mode itself, so the script's own refusal in the planning process must not stop it)."""
        return True

    def place(self, model: nn.Module, device: torch.device, options: Mapping[str, Any]) -> bool:
        """Before ``prepare_model`` moves (or materialises) ``model`` on ``device``; ``options`` are its
        keywords. True: the tool placed the model itself and nothing is allocated (``ddpkit plan`` gives it fake
        tensors of the device's)."""
        return False

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        """Every prepared model, on every rank, before wrapping; a meta model in a sharding mode (only
        materialised by the wrap) is handed over wrapped: its ``state_dict()`` gathers (collective)."""

    def comm_config(self, config: CommConfig | None) -> CommConfig | None:
        """The CommConfig a DDP wrap uses, given the script's (or None)."""
        return config

    def on_ddp(self, wrapped: nn.Module) -> bool:
        """After wrapping in DDP; True when the tool installed its own communication hook."""
        return False

    def train_batch(self, batch_size: int, given_globally: bool = False) -> int:
        """The per-process batch of a training loader; ``given_globally``: it came from ``global_batch_size``."""
        return batch_size

    def uneven(self, uneven: str) -> str:
        """A map-style training loader's tail policy (``pad``, ``drop``, ``join``)."""
        return uneven

    def multiple(self) -> int | None:
        """A map-style training loader keeps a multiple of this many samples (None: all of them)."""
        return None

    def dataset(self, dataset: Any) -> Any:
        """The dataset a map-style training loader reads (the tool may wrap it)."""
        return dataset

    def on_loader(self, loader: Any, rank: int, describe: Callable[[], dict[str, Any]],
                  on_shutdown: OnShutdown) -> None:
        """A training loader, just built; ``loader.observe(fn)`` sees (and may end) each pass's batches.
        ``describe()`` is the run as the loader sees it: ``{"global_batch", "mode", "device"}``."""


NONE = Hooks()


def from_env(environ: Mapping[str, str]) -> Hooks:
    """The hooks of the tool named by ``DDPKIT_TOOL``; :data:`NONE` when it is unset (a normal run)."""
    name = contract.TOOL.text(environ)
    if name is None:
        stray = [var.name for var in contract.TOOL_VARIABLES if var.name in environ]
        if stray:  # a harness that sets them by hand would otherwise get an uncapped run and no files, silently
            print(f"ddpkit: warning: {', '.join(stray)} set without {contract.TOOL.name}: ignored (only the hooks "
                  f"of the tool {contract.TOOL.name} names read them; ddpkit verify and bench set both)",
                  file=sys.stderr, flush=True)
        return NONE
    factory = _factory(name)
    try:
        hooks = factory(environ)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, contract.ContractError):  # the tool's own one-line complaint about its variables
            raise
        raise contract.ContractError(f"{contract.TOOL.name}={name!r}: its factory failed ({exc}); name a "
                                     "module:factory taking the environment and returning "
                                     "ddpkit.runtime.instrument.Hooks") from None
    if not isinstance(hooks, Hooks):
        raise contract.ContractError(f"{contract.TOOL.name}={name!r} returned a "
                                     f"{type(hooks).__name__}, not ddpkit.runtime.instrument.Hooks; make its "
                                     "factory return a Hooks subclass")
    return hooks


def _factory(name: str) -> Callable[[Mapping[str, str]], Any]:
    """``module:factory`` (how the ddpkit commands name their own hooks: a checkout on PYTHONPATH, with no
    installed metadata, works too), else the ``ddpkit.tools`` entry point called ``name`` (a third-party tool)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as exc:  # ValueError: an empty module name
            raise contract.ContractError(f"{contract.TOOL.name}={name!r} cannot be loaded ({exc}); name a "
                                         "module:factory that returns ddpkit.runtime.instrument.Hooks, or a "
                                         f"{ENTRY_POINTS} entry point") from None
    from importlib.metadata import entry_points  # only a tool's run pays for reading the installed metadata

    found = list(entry_points(group=ENTRY_POINTS, name=name))
    if not found:
        installed = ", ".join(sorted({point.name for point in entry_points(group=ENTRY_POINTS)})) or "none"
        raise contract.ContractError(f"{contract.TOOL.name}={name!r} is not a tool of the {ENTRY_POINTS} entry "
                                     f"points (installed: {installed}); unset it (the ddpkit command that runs "
                                     "a tool sets it) or reinstall ddpkit (pip install -e .)")
    return found[0].load()
