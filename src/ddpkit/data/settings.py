"""DataLoader settings from the machine: worker processes from this process's share of the cores, pinned memory
for samples in CPU memory on CUDA. :func:`ddpkit.data_loader` applies them unless the script sets its own.

Example::

    loader_defaults(train_set, "cuda", cores_per_process(usable_cores(), os.cpu_count() or 1, 8))
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the docstring examples use it)
from torch.utils.data import Dataset, Subset, TensorDataset


def cores_per_process(affinity: int | None, cpu_count: int, local_processes: int) -> int:
    """This process's share of the cores.

    A process bound to fewer cores than the machine has (Slurm's per-task binding, ``taskset``, a container
    quota) already has its share: dividing it again by the local process count would starve its loader
    workers. Otherwise the machine's cores are split among the local processes.

    >>> cores_per_process(4, 64, 8), cores_per_process(64, 64, 8), cores_per_process(None, 8, 2)
    (4, 8, 4)
    """
    if affinity is not None and affinity < cpu_count:
        return affinity
    return max(1, (affinity or cpu_count) // max(1, local_processes))


def pinnable(dataset: Dataset, workers: int) -> bool:
    """True when the batches will be in CPU memory (pinning a CUDA tensor raises in the loader), decided
    without reading a sample: reading ``dataset[0]`` here would draw from the global RNG on GPU runs only and
    open lazily opened files before the workers fork. Batches from worker processes are in CPU memory
    (torch advises against CUDA tensors from workers); in-process samples are only known for a
    ``TensorDataset`` (or a ``Subset`` of one, as ``random_split`` returns), so other datasets read in the
    training process are not pinned.

    >>> pinnable(TensorDataset(torch.zeros(2)), 0), pinnable([(torch.zeros(1), 1)], 0), pinnable([0], 2)
    (True, False, True)
    >>> pinnable(Subset(Subset(TensorDataset(torch.zeros(4)), [0, 1]), [1]), 0)
    True
    """
    tensors = _tensors(dataset)
    if tensors is not None:
        return all(t.device.type == "cpu" for t in tensors.tensors)
    return workers > 0


def _tensors(dataset: Dataset) -> TensorDataset | None:
    """The TensorDataset under ``dataset`` and its Subsets (a Subset's samples are its dataset's; a tool's wrapper
    says what it wraps as ``__wrapped__``), or None."""
    dataset = getattr(dataset, "__wrapped__", dataset)
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset if isinstance(dataset, TensorDataset) else None


def loader_defaults(dataset: Dataset, device_type: str, cores_per_process: int,
                    num_workers: int | None = None) -> dict[str, Any]:
    """DataLoader settings that help unless the script sets its own: pinned memory on CUDA (:func:`pinnable`:
    no sample is read); for datasets that do work per sample, worker processes from this process's share of
    the cores (one core stays with the training loop; at most 4), kept alive across epochs. Tensors already in
    memory get no workers: for them workers only add inter-process copies. (Worker-side randomness, e.g.
    augmentation, on a resume: persistent workers draw their seeds once, when they start, so a resumed run's
    streams are fresh; with ``persistent_workers=False`` each epoch's workers are seeded from the loader's
    generator, which the checkpoint restores: a resume replays them from the next epoch on, the rest of an epoch
    resumed mid-way gets fresh streams. See docs/performance.md.) ``num_workers``: the script's own choice,
    kept (workers then persist only if it asked for some).

    >>> loader_defaults(list(range(10)), "cuda", 8)
    {'pin_memory': True, 'num_workers': 4, 'persistent_workers': True}
    >>> loader_defaults(TensorDataset(torch.zeros(4)), "cpu", 8), loader_defaults(list(range(10)), "cpu", 1)
    ({}, {})
    >>> loader_defaults(Subset(TensorDataset(torch.zeros(4)), [0, 1]), "cuda", 8)  # random_split's
    {'pin_memory': True}
    >>> loader_defaults(list(range(10)), "cpu", 8, num_workers=2)
    {'num_workers': 2, 'persistent_workers': True}
    """
    workers = num_workers if num_workers is not None else \
        0 if _tensors(dataset) is not None else min(4, cores_per_process - 1)
    defaults: dict[str, Any] = {"pin_memory": True} if device_type == "cuda" and pinnable(dataset, workers) else {}
    if workers > 0:
        defaults.update(num_workers=workers, persistent_workers=True)
    return defaults
