"""Pinning a batch as torch's DataLoader does, except for tensors already off the CPU: a stream may yield CUDA
tensors, and torch's own pinning raises on them.

Example::

    pinned({"x": cpu_tensor, "y": cuda_tensor})   # x pinned, y left where it is
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import torch
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory


def pinned(data: Any) -> Any:
    """``data`` pinned by torch's own rules (a mapping or sequence type kept, a batch object's own
    ``pin_memory()`` called), except that a tensor off the CPU (a CUDA tensor) is left as it is.

    >>> pinned({"x": torch.zeros(2, device="meta"), "name": ["a"]})   # nothing on the CPU: nothing pinned
    {'x': tensor(..., device='meta', size=(2,)), 'name': ['a']}
    """
    if isinstance(data, torch.Tensor):
        return data.pin_memory() if data.device.type == "cpu" else data
    if not _off_cpu(data):
        return torch_pin_memory(data)
    # Only containers holding an off-CPU tensor get here: rebuilt as torch rebuilds them, leaves pinned above.
    try:
        if isinstance(data, Mapping):
            items = {k: pinned(v) for k, v in data.items()}
            if isinstance(data, MutableMapping):  # a copy keeps the mapping's type and extra attributes
                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)  # type: ignore[call-arg]
        if isinstance(data, tuple):
            parts = [pinned(v) for v in data]
            return type(data)(*parts) if hasattr(data, "_fields") else type(data)(parts)
        if not isinstance(data, MutableSequence):
            return type(data)([pinned(v) for v in data])
        sequence = copy.copy(data)
        for i, item in enumerate(data):
            sequence[i] = pinned(item)
        return sequence
    except TypeError:  # a type that cannot be copied or rebuilt: torch falls back to a dict / list as well
        return {k: pinned(v) for k, v in data.items()} if isinstance(data, Mapping) else [pinned(v) for v in data]


def _off_cpu(data: Any) -> bool:
    """Whether torch's pinning would reach a tensor off the CPU in ``data`` (it raises on one)."""
    if isinstance(data, torch.Tensor):
        return data.device.type != "cpu"
    if hasattr(data, "pin_memory") or isinstance(data, (str, bytes)):  # its own pin_memory() decides
        return False
    if isinstance(data, Mapping):
        return any(_off_cpu(v) for v in data.values())
    if isinstance(data, Sequence):
        return any(_off_cpu(v) for v in data)
    return False
