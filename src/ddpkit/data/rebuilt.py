"""A training loader built again on the same dataset starts at the epoch the last one reached: glow's endless
``sample_data`` rebuilds its ``DataLoader(dataset, shuffle=True)`` when it runs dry, and some scripts build their
loader inside the epoch loop. torch's loader draws a new permutation at each build; a ``ddpkit.data_loader``
reads epoch ``e``'s seeded order, so each build starting at epoch 0 would replay the same order every pass.

Example::

    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> ds = TensorDataset(torch.arange(4))
    >>> class Loader:
    ...     epoch = 0
    >>> first = Loader(); first_start = start(ds, first); first.epoch = 1   # (its one pass done)
    >>> second = Loader(); first_start, start(ds, second)
    (0, 1)
"""

from __future__ import annotations

import weakref
from typing import Any

# dataset -> (the last training loader built on it, the epoch it started at)
_LAST: weakref.WeakKeyDictionary[Any, tuple[weakref.ref, int]] = weakref.WeakKeyDictionary()


def start(dataset: Any, loader: Any) -> int:
    """The epoch ``loader`` starts at, built on ``dataset``: 0 for the first; after that, past the epochs the
    last one built on it reached (at least one past where it started). A dataset that takes no weak reference (a
    list) is not followed: 0."""
    try:
        last = _LAST.get(dataset)
    except TypeError:
        return 0
    first = 0
    if last is not None:
        previous, began = last
        alive = previous()
        first = max(began + 1, int(getattr(alive, "epoch", began + 1))) if alive is not None else began + 1
    try:
        _LAST[dataset] = (weakref.ref(loader), first)
    except TypeError:
        return 0
    return first
