"""The mode table, as a script or a plugin package sees it: add a mode with :func:`register` (or the
``ddpkit.strategies`` entry point group), look one up with :func:`get`. The table lives in
:mod:`ddpkit.strategies.table`, each built-in mode in its own file there (``base``, ``dp``, ``ddp``, ``fsdp``).

Example::

    >>> from ddpkit import strategy
    >>> sorted(strategy.STRATEGIES)[:2], strategy.get("ddp").multi_process
    (['ddp', 'dp'], True)
    >>> strategy.Distributed is strategy.DDPStrategy
    True
"""

from ddpkit.core.environment import LaunchEnvError, ProcessEnv, visible_gpus
from ddpkit.strategies.base import Options, Strategy
from ddpkit.strategies.ddp import DDPOptions, DDPStrategy
from ddpkit.strategies.dp import DataParallelStrategy
from ddpkit.strategies.fsdp import FSDPOptions, FSDPStrategy
from ddpkit.strategies.table import ENTRY_POINTS, STRATEGIES, get, register

# the names before the modes said what they are (plugins subclass them): DataParallel is torch's class's name
DataParallel = DataParallelStrategy
Distributed = DDPStrategy
Sharded = FSDPStrategy

# the built-in modes are public too: a new mode is often one of them with one answer changed; and what a mode's
# device() needs (this module named them before the move, and a plugin may import them from here)
__all__ = ["ENTRY_POINTS", "STRATEGIES", "DDPOptions", "DDPStrategy", "DataParallel", "DataParallelStrategy",
           "Distributed", "FSDPOptions", "FSDPStrategy", "LaunchEnvError", "Options", "ProcessEnv", "Sharded",
           "Strategy", "get", "register", "visible_gpus"]
