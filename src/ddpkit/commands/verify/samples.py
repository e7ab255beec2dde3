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
    """``dataset`` whose sample ``i`` is fetched with the generators seeded from ``base`` and ``i``. Its own
    attributes have names no script's dataset uses: ``loader.dataset.dataset`` (a Subset's) and ``loader.dataset.
    transform = ...`` reach the script's dataset."""

    def __init__(self, dataset: Any, base: int):
        self.__dict__["_ddpkit_dataset"], self.__dict__["_ddpkit_base"] = dataset, base

    def __len__(self) -> int:
        return len(self.__dict__["_ddpkit_dataset"])

    @property
    def __wrapped__(self) -> Any:  # what the loader's defaults look at (tensors in memory: no worker processes)
        return self.__dict__["_ddpkit_dataset"]

    def __getattr__(self, name: str) -> Any:  # ``loader.dataset.classes``: the script's own dataset's
        inner = self.__dict__.get("_ddpkit_dataset")
        if name.startswith("__") or inner is None:  # (unpickling in a worker: not set yet)
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_ddpkit_dataset"], name, value)

    def __getitem__(self, index: Any) -> Any:
        dataset = self.__dict__["_ddpkit_dataset"]
        try:
            key = int(index)  # a sampler's int, or a 0-d tensor's value (not its hash: that is its id)
        except (TypeError, ValueError):
            return dataset[index]  # a key of another kind: fetched as it is
        numpy = sys.modules.get("numpy")
        saved = (torch.random.default_generator.get_state(), random.getstate(),
                 numpy.random.get_state() if numpy else None)
        seed = (self.__dict__["_ddpkit_base"] * 1_000_003 + key) % 2**62
        try:
            # the CPU generator only: torch.manual_seed would reseed the GPUs' too, which the step draws from
            torch.random.default_generator.manual_seed(seed)
            random.seed(seed)
            if numpy is not None:
                numpy.random.seed(seed % 2**32)
            return dataset[index]
        finally:
            torch.random.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            if numpy is not None and saved[2] is not None:
                numpy.random.set_state(saved[2])
