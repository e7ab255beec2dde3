"""``ddpkit.join``: ranks may run different numbers of training steps without a hang (torch's ``Join`` for DDP).
The loaders built with ``uneven="join"`` check that they run inside it (:attr:`ddpkit.core.process.Process.joining`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ddpkit.core import process
from ddpkit.runtime import group as runtime


@contextlib.contextmanager
def join(model: torch.nn.Module) -> Iterator[None]:
    """Let ranks run different numbers of training steps without a hang (torch's ``Join`` for DDP).

    Ranks that run out of batches shadow the others' all-reduces until every rank is done. Does not work
    with SyncBatchNorm (its collectives run in forward): pass ``sync_batchnorm=False`` or use ``uneven='pad'``.
    Outside DDP it does nothing.

    Example::

        loader = ddpkit.data_loader(train_set, 32, uneven="join")
        with ddpkit.join(model):
            for x, y in loader: ...
    """
    context = runtime.ensure_init().strategy.join(model)
    proc = process.current()
    proc.joining = True
    try:
        with context:
            yield
    finally:
        proc.joining = False
