"""ddpkit: a single-device PyTorch training script, data-parallel in a few lines.

    import ddpkit
    state = ddpkit.init()                                  # rank, world size, device, mode
    model = ddpkit.prepare_model(Net())                    # device + SyncBatchNorm + DDP / DataParallel
    loader = ddpkit.data_loader(train_set, batch_size=32)  # sharded, reshuffled every epoch
    for x, y in ddpkit.progress(loader): ...               # bar on rank 0 only
    ddpkit.print("done")                                   # printed once

Launch with ``ddpkit launch --nproc-per-node 2 train.py`` or run ``python train.py`` as before.
Importing ddpkit imports nothing heavy: each name loads its module on first use.
"""

# Helpers under private names (and no ``from __future__``): ``dir(ddpkit)`` is the API, not this module's imports.
import importlib as _importlib
import typing as _typing

# public name -> module that defines it; resolved lazily so `import ddpkit` stays cheap.
_EXPORTS = {
    "init": "runtime.group",
    "State": "core.process",
    "shutdown": "runtime.group",
    "prepare_model": "model",
    "unwrap": "model",
    "no_sync": "model",
    "accumulate": "model",
    "init_empty": "model",
    "autocast": "precision",
    "data_loader": "data.build",
    "join": "data.join",
    "reduce": "runtime.collectives",
    "gather": "runtime.collectives",
    "rank_generator": "runtime.rankgen",
    "barrier": "runtime.control",
    "broadcast": "runtime.control",
    "gather_object": "runtime.control",
    "any_rank": "runtime.control",
    "all_ranks": "runtime.control",
    "main_process_first": "runtime.control",
    "spawn": "launcher.spawn",
    "SpawnError": "launcher.spawn",
    "Checkpointer": "checkpoint.checkpointer",
    "CommConfig": "strategies.comm",
    "print": "output",
    "get_logger": "output",
    "summary_writer": "output",
    "progress": "output",
    "__version__": "core.version",  # lazy too: importing it would bind the submodule `core` on the package
}

__all__ = [name for name in _EXPORTS if name != "__version__"]

if _typing.TYPE_CHECKING:  # pragma: no cover
    from ddpkit.checkpoint.checkpointer import Checkpointer
    from ddpkit.core.process import State
    from ddpkit.core.version import __version__
    from ddpkit.data.build import data_loader
    from ddpkit.data.join import join
    from ddpkit.launcher.spawn import SpawnError, spawn
    from ddpkit.model import accumulate, init_empty, no_sync, prepare_model, unwrap
    from ddpkit.output import get_logger, print, progress, summary_writer
    from ddpkit.precision import autocast
    from ddpkit.runtime.collectives import gather, reduce
    from ddpkit.runtime.control import all_ranks, any_rank, barrier, broadcast, gather_object, main_process_first
    from ddpkit.runtime.group import init, shutdown
    from ddpkit.runtime.rankgen import rank_generator
    from ddpkit.strategies.comm import CommConfig


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"ddpkit.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The API, ``__version__`` and the submodules imported so far; not this module's own helpers.

    >>> {"init", "SpawnError", "__version__"} <= set(__dir__()) and "importlib" not in __dir__()
    True
    """
    return sorted(set(_EXPORTS) | {name for name in globals() if not name.startswith("_") or name.startswith("__")})
