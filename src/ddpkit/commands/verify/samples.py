"""Each training sample's random draws, the same in both of ``ddpkit verify``'s runs: its augmentation.

A Dataset that augments at random (a random crop or flip, Python's ``random`` or numpy in ``__getitem__``) draws
from whatever generator state its process has when it fetches a sample: one process fetching the global batch and
N processes fetching its parts draw different numbers for the same sample, and the runs could not be compared
exactly ("cannot compare exactly"). In verify's runs each training loader's dataset is wrapped so that fetching
sample ``i`` seeds torch's, Python's and numpy's generators from ``i`` alone (and the run's draws offset) and puts
their states back after: sample ``i`` is augmented the same way in both runs, in the main process or a worker, and
the script's own draws elsewhere are not moved. What is drawn inside a training step (noise, sampling) is not a
sample's: the re-runs with other draws (:mod:`ddpkit.commands.verify.draws`) still judge those.

Example::

    >>> import random
    >>> class Jitter(torch.utils.data.Dataset):
    ...     def __len__(self): return 4
    ...     def __getitem__(self, i): return i + random.random()
    >>> a, b = SampleSeeded(Jitter(), 0), SampleSeeded(Jitter(), 0)
    >>> a[2] == b[2], len(a)
    (True, 4)
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset


class SampleSeeded(Dataset):
    """``dataset`` whose sample ``i`` is fetched with the generators seeded from ``base`` and ``i``."""

    def __init__(self, dataset: Any, base: int):
        self.dataset, self.base = dataset, base

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # ``loader.dataset.classes``: the script's own dataset's
        if name.startswith("__") or name in ("dataset", "base"):  # (unpickling in a worker: not set yet)
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __getitem__(self, index: Any) -> Any:
        numpy = sys.modules.get("numpy")
        saved = (torch.get_rng_state(), random.getstate(), numpy.random.get_state() if numpy else None)
        seed = (self.base * 1_000_003 + hash(index)) % 2**62
        try:
            torch.manual_seed(seed)
            random.seed(seed)
            if numpy is not None:
                numpy.random.seed(seed % 2**32)
            return self.dataset[index]
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            if numpy is not None and saved[2] is not None:
                numpy.random.set_state(saved[2])
