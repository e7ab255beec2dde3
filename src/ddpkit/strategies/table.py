"""Parallel modes as one table: each mode is a small object (:class:`ddpkit.strategies.base.Strategy`), and
every question whose answer depends on the mode asks it. One file per built-in mode: ``base.py`` (``single``,
and what every mode inherits), ``dp.py``, ``ddp.py``, ``fsdp.py``, ``hsdp.py``.

Another mode is one :class:`Strategy` subclass, made known with :func:`register`, or from another package
through the ``ddpkit.strategies`` entry point group (so the launcher and every worker find it without an
import in the script).

Example::

    >>> sorted(STRATEGIES)
    ['ddp', 'dp', 'fsdp', 'hsdp', 'single']
    >>> get("ddp").multi_process, get("dp").min_gpus
    (True, 2)

Nothing here (nor in the mode files) imports torch at module level: ``ddpkit launch`` reads the table before
it needs torch. Each mode's wrapper class, a subclass of torch's, lives in ``<mode>_wrapper.py``, imported when
a model is wrapped.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpkit.strategies.base import Strategy
from ddpkit.strategies.ddp import DDPStrategy
from ddpkit.strategies.dp import DataParallelStrategy
from ddpkit.strategies.fsdp import FSDPStrategy
from ddpkit.strategies.hsdp import HSDPStrategy

ENTRY_POINTS = "ddpkit.strategies"

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (Strategy(), DataParallelStrategy(), DDPStrategy(),
                                                        FSDPStrategy(), HSDPStrategy())}


def register(strategy: Strategy) -> Strategy:
    """Add (or replace) a mode; returns it. ``auto`` is not a mode name: it chooses among them."""
    if not strategy.name or strategy.name == "auto":
        raise ValueError(f"a strategy needs a name other than 'auto', got {strategy.name!r}")
    STRATEGIES[strategy.name] = strategy
    return strategy


def get(name: str, error: Callable[[str], Exception] = ValueError) -> Strategy:
    """The mode called ``name``, looking in installed packages' entry points for names not built in."""
    if name not in STRATEGIES:
        from importlib.metadata import entry_points

        for point in entry_points(group=ENTRY_POINTS, name=name):
            register(point.load()())
    if name not in STRATEGIES:
        raise error(f"mode {name!r} is not one of auto, {', '.join(sorted(STRATEGIES))}; "
                    "pass one of them (or omit it for auto)")
    return STRATEGIES[name]
