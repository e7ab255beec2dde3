"""Labels a token-mean loss ignores (``-100``, torch's ``ignore_index``) in a number that varies from sample to
sample: the count a mean divides by then differs between micro-batches, and a loss weighted by samples changes
with the world size. verify names it as the cause of a difference it finds.

Example::

    >>> from torch.utils.data import DataLoader
    >>> masked_labels(DataLoader([(torch.tensor([1, -100]),), (torch.tensor([2, 3]),)], batch_size=2))
    -100
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def masked_labels(loader: Any, probes: int = 8) -> int | None:
    """The ignored-label value (-100, torch's ``ignore_index``; or -1 in sequences of labels, makemore's) when the
    batches of a map-style loader hold it in a number that varies from sample to sample: then a token-mean loss
    averages a count that differs between micro-batches, and weighting it by samples changes with the world size.
    The first ``probes`` samples go through the loader's own ``collate_fn`` (a collator that pads labels with -100
    counts). The same count in every sample (a fixed prompt length, no padding) is no such cause; None then.
    A -1 counts in 2-d labels only (a 1-d label of -1 / +1 is a class).

    >>> from torch.utils.data import DataLoader
    >>> varied = [(torch.tensor([3, -100]),), (torch.tensor([-100, -100]),)]
    >>> masked_labels(DataLoader(varied, batch_size=2)), masked_labels(DataLoader(varied[:1] * 2, batch_size=2))
    (-100, None)
    >>> masked_labels(DataLoader([torch.tensor([5, -1]), torch.tensor([5, 6])], batch_size=2))
    -1
    >>> masks = [torch.tensor([[5, 255]], dtype=torch.uint8), torch.tensor([[5, 6]], dtype=torch.uint8)]
    >>> masked_labels(DataLoader(masks, batch_size=2)) is None
    True
    """
    dataset = getattr(loader, "dataset", None)
    try:
        samples = [dataset[i] for i in range(min(probes, len(dataset)))]  # type: ignore[index, arg-type]
        batch = getattr(loader, "collate_fn", None)(samples)  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - a stream, or a dataset or collator that cannot be probed: nothing said
        return None
    return next((value for value, counts in _kept_per_row(batch, depth=0) if len(set(counts)) > 1), None)


def _kept_per_row(value: Any, depth: int) -> Iterator[tuple[int, list[int]]]:
    """For each integer tensor of a batch that holds -100 (or -1, in rows of several labels): that value, and how
    many of each row's entries are not it."""
    if isinstance(value, torch.Tensor):
        # (a uint8 mask holds no -1: ``value == -1`` would match its 255, DeepLab's ignored label, and name -1)
        integer = not value.is_floating_point() and not value.is_complex() and value.dtype != torch.uint8
        for ignored in (-100, -1):
            rows = value.dim() >= (1 if ignored == -100 else 2)
            if integer and rows and bool((value == ignored).any()):
                yield ignored, (value != ignored).reshape(value.shape[0], -1).sum(1).tolist()
    elif depth < 3 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _kept_per_row(item, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for item in value.values():
            yield from _kept_per_row(item, depth + 1)
