"""Every random state a resume needs, as tensors: python, numpy, torch, CUDA and the loaders' worker-seed
generators, gathered from every rank into the checkpoint and loaded with ``weights_only=True`` (no pickle).

Example::

    rng = gather(local(loaders, mode), state)      # on rank 0: {"torch": [world, 5056] uint8, ...}
    restore({k: v[state.rank].clone() for k, v in rng.items()}, loaders, mode)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddpkit.runtime import rankgen
from ddpkit.strategies.generators import host, set_host

if TYPE_CHECKING:  # pragma: no cover
    from ddpkit.core.process import State
    from ddpkit.data.loader import ShardedDataLoader
    from ddpkit.strategies.table import Strategy


def local(loaders: dict[str, ShardedDataLoader], mode: Strategy) -> dict[str, torch.Tensor]:
    """This rank's random states, as tensors (so they can be gathered and loaded without pickle)."""
    state = host()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = mode.cuda_rng_devices(torch.cuda.current_device(), torch.cuda.device_count())
        state["cuda"] = torch.stack([torch.cuda.get_rng_state(d) for d in devices])  # one row per device
    for name, loader in loaders.items():
        generator = loader.generator_state()
        if generator is not None:
            state[f"loader.{name}"] = generator
    state.update({f"rankgen.{kind}": g for kind, g in rankgen.states().items()})  # (a step's noise: the stream on)
    return state


def restore(state: dict[str, torch.Tensor], loaders: dict[str, ShardedDataLoader], mode: Strategy) -> None:
    """Set this rank's saved random states; a state the generators refuse (its shape checked already, its
    content not: a crafted Mersenne state) is one line, with every generator as it was."""
    before = local(loaders, mode)
    try:
        _restore(state, loaders, mode)
    except (RuntimeError, ValueError, OverflowError, TypeError) as exc:
        _restore(before, loaders, mode)
        said = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise ValueError(f"the checkpoint's random state was refused by its generator ({type(exc).__name__}: "
                         f"{said}); expected the states ddpkit's save gathers: the checkpoint is damaged or was not "
                         "written by ddpkit") from None


def _restore(state: dict[str, torch.Tensor], loaders: dict[str, ShardedDataLoader], mode: Strategy) -> None:
    set_host(state)
    if "cuda" in state and torch.cuda.is_available():
        rows = state["cuda"] if state["cuda"].dim() == 2 else state["cuda"].unsqueeze(0)  # older: one device
        devices = mode.cuda_rng_devices(torch.cuda.current_device(), torch.cuda.device_count())
        for device, row in zip(devices, rows):
            torch.cuda.set_rng_state(row.clone(), device)
    for name, loader in loaders.items():
        if f"loader.{name}" in state and loader.generator is not None:
            loader.generator.set_state(state[f"loader.{name}"])
    for name in state:
        if name.startswith("rankgen."):
            rankgen.set_state(name[len("rankgen."):], state[name])


def gather(local: dict[str, torch.Tensor], state: State) -> dict[str, torch.Tensor] | None:
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
