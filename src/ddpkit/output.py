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
import logging
from collections.abc import Iterable
from typing import Any

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
    """Stands in for a SummaryWriter on ranks other than 0: every method accepts anything and does nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def summary_writer(log_dir: str | None = None, **kwargs: Any):
    """A ``torch.utils.tensorboard.SummaryWriter`` on rank 0, a no-op object with the same methods elsewhere.

    Needs the ``tensorboard`` extra (``pip install ddpkit[tensorboard]``) on rank 0. Under ``ddpkit launch``
    it also gets the phase report's scalars after each window: ``ddpkit/phases/<phase>/rank<r>`` (ms per step)
    and ``ddpkit/straggler_score`` (the largest excess of one rank's phase over the others', as a share of
    the step: 0 when every rank is alike).
    """
    if not runtime.ensure_init().is_main:
        return _NullWriter()
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError("summary_writer needs tensorboard: pip install 'ddpkit[tensorboard]'") from exc
    writer = SummaryWriter(log_dir=log_dir, **kwargs)
    phases.add_listener(lambda step, windows, found: _phase_scalars(writer, step, windows))
    return writer


def _phase_scalars(writer: Any, step: int, windows: list[dict[str, Any]]) -> None:
    for win in windows:
        for phase, ms in win["ms"].items():
            writer.add_scalar(f"ddpkit/phases/{phase}/rank{win['rank']}", ms, step)
    writer.add_scalar("ddpkit/straggler_score", straggler.score(windows), step)


def progress(iterable: Iterable, **tqdm_kwargs: Any) -> Iterable:
    """``tqdm(iterable, ...)`` on rank 0; a disabled tqdm elsewhere: the same items, no bar, and the bar's
    methods (``bar.set_postfix(loss=...)``, ``bar.update()``) do nothing instead of raising."""
    from tqdm import tqdm

    if not runtime.ensure_init().is_main:
        tqdm_kwargs["disable"] = True
    return tqdm(iterable, **tqdm_kwargs)
