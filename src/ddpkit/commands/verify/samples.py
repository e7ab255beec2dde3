"""Each training sample's random draws, the same in both of ``ddpkit verify``'s runs: its augmentation.

A Dataset that augments at random (a random crop or flip, Python's ``random`` or numpy in ``__getitem__``) draws
from whatever generator state its process has when it fetches a sample: one process fetching the global batch and
N processes fetching its parts draw different numbers for the same sample, and the runs could not be compared
exactly ("cannot compare exactly"). In verify's runs each training loader's dataset is wrapped so that fetching
sample ``i`` seeds torch's, Python's and numpy's generators from ``i`` alone (and the run's draws offset) and puts
their states back after: sample ``i`` is augmented the same way in both runs, in the main process or a worker, and
the script's own draws elsewhere are not moved. What is drawn inside a training step (noise, sampling) is not a
sample's: the re-runs with other draws (:mod:`ddpkit.commands.verify.draws`) still judge those. A dataset whose
sample comes out different when fetched twice so (the first sample each process fetches is fetched twice: a library
that augments from a generator of its own, seeded from the OS, as albumentations' ``Compose`` without ``seed=``)
cannot be matched: the probe file says so, and the re-runs judge it too.

Example::

    >>> import random
    >>> class Jitter(torch.utils.data.Dataset):
    ...     def __len__(self): return 4
    ...     def __getitem__(self, i): return i + random.random()
    >>> a, b = SampleSeeded(Jitter(), 0), SampleSeeded(Jitter(), 0)
    >>> a[2] == b[2], len(a)
    (True, 4)
    >>> import numpy, tempfile, os
    >>> class Own(torch.utils.data.Dataset):
    ...     rng = numpy.random.default_rng()
    ...     def __len__(self): return 4
    ...     def __getitem__(self, i): return torch.tensor(self.rng.random())
    >>> probe = os.path.join(tempfile.mkdtemp(), "probe")
    >>> _ = SampleSeeded(Own(), 0, probe)[0]; os.path.exists(probe)
    True
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset


class SampleSeeded(Dataset):
    """``dataset`` whose sample ``i`` is fetched with the generators seeded from ``base`` and ``i``. Its own
    attributes have names no script's dataset uses: ``loader.dataset.dataset`` (a Subset's) and ``loader.dataset.
    transform = ...`` reach the script's dataset."""

    def __init__(self, dataset: Any, base: int, probe: str | None = None):
        self.__dict__["_ddpkit_dataset"], self.__dict__["_ddpkit_base"] = dataset, base
        # a file made when a process's first sample differs fetched twice alike (see :func:`repeatable`)
        self.__dict__["_ddpkit_probe"], self.__dict__["_ddpkit_probed"] = probe, None

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
        probe = self.__dict__["_ddpkit_probe"]
        if probe is not None and self.__dict__["_ddpkit_probed"] != os.getpid():  # once in each process (worker)
            self.__dict__["_ddpkit_probed"] = os.getpid()
            first = self._seeded(dataset, index, key)
            if not _same(first, self._seeded(dataset, index, key), 0):
                open(probe, "a").close()
            return first
        return self._seeded(dataset, index, key)

    def _seeded(self, dataset: Any, index: Any, key: int) -> Any:
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


def _same(a: Any, b: Any, depth: int) -> bool:
    """Equal, for what a sample holds: tensors and arrays element by element (NaN equal to NaN), images by their
    bytes, containers item by item, an object without an ``==`` of its own by its attributes; what cannot be
    compared counts as equal.

    >>> class Record:
    ...     def __init__(self, x): self.x = x
    >>> _same(Record(torch.ones(2)), Record(torch.ones(2)), 0), _same(Record(1), Record(2), 0)
    (True, False)
    """
    if depth > 8:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a, b) or a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                    and torch.equal(a.nan_to_num(), b.nan_to_num()))
    if hasattr(a, "__array__") and hasattr(b, "__array__") and not isinstance(a, (str, bytes)):
        try:
            return _same(torch.as_tensor(a.__array__()), torch.as_tensor(b.__array__()), depth + 1)
        except (TypeError, ValueError, RuntimeError):
            return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if hasattr(a, "tobytes") and hasattr(b, "tobytes"):  # a PIL image
        return bool(a.tobytes() == b.tobytes())
    if type(a) is type(b) and type(a).__eq__ is object.__eq__:  # no equality of its own: an identity test
        return _same(vars(a), vars(b), depth + 1) if hasattr(a, "__dict__") and hasattr(b, "__dict__") else True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (an object whose == raises or is not a bool)
        return True

