"""The mode table, as a script or a plugin package sees it: add a mode with :func:`register` (or the
``ddpkit.strategies`` entry point group), look one up with :func:`get`. The table and the built-in modes
live in :mod:`ddpkit.strategies`.

Example::

    >>> from ddpkit import strategy
    >>> sorted(strategy.STRATEGIES)[:2], strategy.get("ddp").multi_process
    (['ddp', 'dp'], True)
"""

from ddpkit.strategies.table import ENTRY_POINTS, STRATEGIES, DataParallel, Distributed, Sharded, Strategy, get, register

# the built-in modes are public too: a new mode is often one of them with one answer changed
__all__ = ["ENTRY_POINTS", "STRATEGIES", "DataParallel", "Distributed", "Sharded", "Strategy", "get", "register"]
