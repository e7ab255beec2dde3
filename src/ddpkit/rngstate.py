"""Every random state a resume needs, as tensors: python, numpy, torch, CUDA and the loaders' worker-seed
generators, gathered from every rank into the checkpoint and loaded with ``weights_only=True`` (no pickle).

Example::

    rng = gather(local(loaders, mode), state)      # on rank 0: {"torch": [world, 5056] uint8, ...}
    restore({k: v[state.rank].clone() for k, v in rng.items()}, loaders, mode)
"""

from __future__ import annotations

import random
import sys
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover  (annotations only: fsdp's init uses the host half, below the loaders)
    from ddpkit import runtime, strategy
    from ddpkit.data import ShardedDataLoader


def host() -> dict[str, torch.Tensor]:
    """python's, numpy's (when imported) and torch's CPU generator states, as tensors."""
    version, mt, gauss = random.getstate()
    state = {"python_mt": torch.tensor(mt, dtype=torch.int64),
             "python_gauss": torch.tensor([version, gauss is not None, gauss or 0.0], dtype=torch.float64),
             "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        _, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        state["numpy_rest"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return state


def set_host(state: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`host`."""
    version, has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((int(version), tuple(state["python_mt"].tolist()), gauss if has_gauss else None))
    torch.set_rng_state(state["torch"])
    if "numpy_keys" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        pos, has_gauss, cached = state["numpy_rest"].tolist()
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), cached))


def local(loaders: dict[str, ShardedDataLoader], mode: strategy.Strategy) -> dict[str, torch.Tensor]:
    """This rank's random states, as tensors (so they can be gathered and loaded without pickle)."""
    state = host()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = mode.cuda_rng_devices(torch.cuda.current_device(), torch.cuda.device_count())
        state["cuda"] = torch.stack([torch.cuda.get_rng_state(d) for d in devices])  # one row per device
    for name, loader in loaders.items():
        generator = loader.generator_state()
        if generator is not None:
            state[f"loader.{name}"] = generator
    return state


def restore(state: dict[str, torch.Tensor], loaders: dict[str, ShardedDataLoader], mode: strategy.Strategy) -> None:
    set_host(state)
    if "cuda" in state and torch.cuda.is_available():
        rows = state["cuda"] if state["cuda"].dim() == 2 else state["cuda"].unsqueeze(0)  # older: one device
        devices = mode.cuda_rng_devices(torch.cuda.current_device(), torch.cuda.device_count())
        for device, row in zip(devices, rows):
            torch.cuda.set_rng_state(row.clone(), device)
    for name, loader in loaders.items():
        if f"loader.{name}" in state and loader.generator is not None:
            loader.generator.set_state(state[f"loader.{name}"])


def gather(local: dict[str, torch.Tensor], state: runtime.State) -> dict[str, torch.Tensor] | None:
    """Every rank's RNG tensors on rank 0, stacked along a new first dim (None on other ranks)."""
    if state.world_size == 1:
        return {k: v.unsqueeze(0) for k, v in local.items()}
    out = {}
    for name in sorted(local):
        tensor = local[name].to(state.device)
        parts = [torch.empty_like(tensor) for _ in range(state.world_size)]
        dist.all_gather(parts, tensor)
        out[name] = torch.stack(parts).cpu()
    return out if state.is_main else None
