"""Output that appears once per job, not once per rank: print, logging, TensorBoard, progress bars.

Example::

    ddpkit.print("epoch", epoch)                       # rank 0 only
    log = ddpkit.get_logger(__name__)                  # log.info(...) on rank 0 only
    writer = ddpkit.summary_writer("runs/exp")         # a real SummaryWriter on rank 0, a no-op elsewhere
    for batch in ddpkit.progress(loader, desc="train"):  # a tqdm bar on rank 0 only
        ...
"""

from __future__ import annotations

import builtins
import datetime
import itertools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from ddpkit.core import straggler
from ddpkit.runtime import group as runtime
from ddpkit.runtime import phases


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - the point is to stand in for print
    """``print`` on the main process (rank 0); nothing on the others."""
    if runtime.ensure_init().is_main:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


class RankZeroAdapter(logging.LoggerAdapter):
    """Logs on rank 0 only; with ``all_ranks=True`` logs everywhere and prefixes ``[rank N]``."""

    def __init__(self, logger: logging.Logger, all_ranks: bool = False):
        super().__init__(logger, {})
        self.all_ranks = all_ranks

    def isEnabledFor(self, level: int) -> bool:
        return (self.all_ranks or runtime.ensure_init().is_main) and self.logger.isEnabledFor(level)

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            msg, kwargs = self.process(msg, kwargs)
            kwargs.setdefault("stacklevel", 2)
            self.logger.log(level, msg, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The logger's own methods and attributes (``addHandler``, ``handlers``, ``propagate``): a script
        configures the logger it asked for (moemen95's template: ``logger.addHandler(...)`` raised AttributeError
        on the adapter)."""
        if name == "logger":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.logger, name)

    def process(self, msg: Any, kwargs: Any):
        if self.all_ranks:
            msg = f"[rank {runtime.ensure_init().rank}] {msg}"
        return msg, kwargs


def get_logger(name: str, all_ranks: bool = False) -> RankZeroAdapter:
    """A logger adapter over ``logging.getLogger(name)`` that logs on rank 0 only.

    Handlers and levels stay yours to configure (ddpkit never touches the root logger).
    """
    return RankZeroAdapter(logging.getLogger(name), all_ranks)


class _NullWriter:
    """Stands in for a SummaryWriter on ranks other than 0: every method accepts anything and does nothing, and
    ``log_dir`` / ``get_logdir()`` answer rank 0's folder (SimCLR keeps its log file and checkpoints there)."""

    def __init__(self, log_dir: Callable[[], str]):
        self._log_dir: Callable[[], str] = log_dir
        self._known: str | None = None

    @property
    def log_dir(self) -> str:
        known = self._known if self._known is not None else self._log_dir()
        self._known = known  # read once: later reads (after destroy_process_group) need no store
        return known

    def get_logdir(self) -> str:
        return self.log_dir

    @property
    def file_writer(self) -> _NullWriter:
        """SummaryWriter's own ``file_writer`` (pytorch-semseg reads ``writer.file_writer.get_logdir()``): this."""
        return self

    def _get_file_writer(self) -> _NullWriter:
        return self

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


# the k-th summary_writer(comment=c) of every rank is the same writer (by comment: a writer rank 0 alone makes,
# under ``if is_main:``, has a comment of its own more often than not, and then shifts no other's count)
_WRITERS: dict[str, itertools.count] = {}
WAIT_S = 60.0  # a rank reading log_dir waits this long for rank 0's writer of the same order


def summary_writer(log_dir: str | None = None, **kwargs: Any):
    """A ``torch.utils.tensorboard.SummaryWriter`` on rank 0, a no-op object with the same methods elsewhere.

    Needs the ``tensorboard`` extra (``pip install ddpkit[tensorboard]``) on rank 0. Under ``ddpkit launch``
    it also gets the phase report's scalars after each window: ``ddpkit/phases/<phase>/rank<r>`` (ms per step)
    and ``ddpkit/straggler_score`` (the largest excess of one rank's phase over the others', as a share of
    the step: 0 when every rank is alike). Its ``log_dir`` is the same on every rank: without one given, rank
    0's default folder (``runs/<date>_<host>``), which the others read from the process group's store when they
    ask for it (nothing is exchanged unless they do).

    Example::

        writer = ddpkit.summary_writer()
        log_file = os.path.join(writer.log_dir, "training.log")   # rank 0's folder, on every rank
    """
    state = runtime.ensure_init()
    comment = str(kwargs.get("comment", ""))
    key = f"ddpkit/summary_writer/{comment}/{next(_WRITERS.setdefault(comment, itertools.count()))}"
    if not state.is_main:
        if log_dir is not None:  # the folder exists on every rank, as the writer makes it on rank 0: a script that
            os.makedirs(log_dir, exist_ok=True)  # copies its config into it runs there too (pytorch-semseg)
        return _NullWriter(lambda: log_dir if log_dir is not None else _rank0_log_dir(key, state.rank))
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("summary_writer needs tensorboard: pip install 'ddpkit[tensorboard]'") from exc
    writer = SummaryWriter(log_dir=log_dir, **kwargs)
    store = _store()
    if log_dir is None and store is not None:
        store.set(key, writer.log_dir)
    phases.add_listener(lambda step, windows, found: _phase_scalars(writer, step, windows))
    return writer


def _store() -> Any:
    """The process group's key-value store, or None in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


def _rank0_log_dir(key: str, rank: int) -> str:
    store = _store()
    try:
        if store is None:
            raise RuntimeError("the process group is gone: read writer.log_dir before destroy_process_group()")
        store.wait([key], datetime.timedelta(seconds=WAIT_S))
        return store.get(key).decode()
    except RuntimeError as exc:
        raise RuntimeError(f"ddpkit: writer.log_dir read on rank {rank}, but rank 0's folder for the same "
                           f"ddpkit.summary_writer() call could not be read within {WAIT_S:g} s ({exc}); call it on "
                           "every rank in the same order, or give it a log_dir") from None


def _phase_scalars(writer: Any, step: int, windows: list[dict[str, Any]]) -> None:
    for win in windows:
        for phase, ms in win["ms"].items():
            writer.add_scalar(f"ddpkit/phases/{phase}/rank{win['rank']}", ms, step)
    writer.add_scalar("ddpkit/straggler_score", straggler.score(windows), step)


def progress(iterable: Iterable, **tqdm_kwargs: Any) -> Iterable:
    """``tqdm(iterable, ...)`` on rank 0; a disabled tqdm elsewhere: the same items, no bar, and the bar's
    methods (``bar.set_postfix(loss=...)``, ``bar.update()``, ``bar.write(msg)``) do nothing instead of raising.
    (tqdm's own ``write`` prints whether the bar is disabled or not: a validation's ``bar.write(...)`` lines came
    once per rank.)"""
    from tqdm import tqdm

    if runtime.ensure_init().is_main:
        return tqdm(iterable, **tqdm_kwargs)
    bar = tqdm(iterable, **{**tqdm_kwargs, "disable": True})
    bar.write = _silent  # (this instance's, not the class's: rank 0's bar writes)
    return bar


def _silent(*args: Any, **kwargs: Any) -> None:
    """A disabled bar's ``write``: rank 0's bar prints the line once."""
