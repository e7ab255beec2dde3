"""Communication options for DDP, behind one small config, checked before training starts.

Example::

    model = ddpkit.prepare_model(net, comm=ddpkit.CommConfig(bucket_mb=50, compression="fp16"))

- ``bucket_mb``: gradient bucket size (DDP's ``bucket_cap_mb``; torch's default 25).
- ``gradient_as_bucket_view``: gradients alias the communication buckets (saves a copy and memory).
- ``static_graph``: the set of used parameters never changes (lets DDP skip per-step bookkeeping); parameters
  unused by design are then fine: DDP finds them in the first iteration.
- ``compression`` (lossy, opt-in): ``"fp16"`` or ``"bf16"`` send gradients in 16 bits and average in fp32;
  ``"powersgd"`` sends a low-rank approximation (torch's PowerSGD hook, ``powersgd_rank``).

fp16 is torch's own ``fp16_compress_hook`` on both backends; bf16 is torch's ``bf16_compress_hook`` on NCCL and,
on gloo (where torch's hook refuses to run), the same all-reduce in bf16 done by :func:`_bf16_allreduce_hook`.
On a CPU both measured no faster than uncompressed: the casts cost about what the halved bytes save.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.core.options import Compression, check


@dataclasses.dataclass(frozen=True)
class CommConfig:
    bucket_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    compression: Compression | None = None
    powersgd_rank: int = 2

    def __post_init__(self):
        check("compression", self.compression, Compression, none="None (no compression)")
        if self.bucket_mb is not None and self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")

    def ddp_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": self.gradient_as_bucket_view,
                                  "static_graph": self.static_graph}
        if self.bucket_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_mb
        return kwargs

    def describe(self) -> str:
        parts = [f"bucket {self.bucket_mb or 25} MB"]
        parts += ["grad-as-bucket-view"] * self.gradient_as_bucket_view + ["static-graph"] * self.static_graph
        if self.compression:
            parts.append(f"{self.compression} compression (lossy)")
        return ", ".join(parts)


def skip_hook(state, bucket):
    """No communication at all (gradients stay local): ``ddpkit bench`` times the step without it to
    measure how much of the step communication takes. Never for training."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _bf16_allreduce_hook(state, bucket):
    """torch's ``bf16_compress_hook`` without its NCCL-only check: sum in bf16, average back in fp32.

    bf16 keeps fp32's exponent range, so summing before dividing cannot overflow (fp16 could: for fp16 torch's
    own hook, which divides first, runs on gloo as it is). An all-gather of bf16 copies summed in fp32 was
    also measured: 85-115 ms per step against 56-67 ms for this and 52-66 ms for no compression (33 MB MLP).
    """
    group = state if state is not None else dist.group.WORLD
    grad = bucket.buffer()
    work = dist.all_reduce(grad.to(torch.bfloat16), group=group, async_op=True)

    def average(fut):
        return grad.copy_(fut.value()[0]).div_(dist.get_world_size(group))

    return work.get_future().then(average)


def register(model, config: CommConfig, backend: str) -> None:
    """Attach the compression hook to a DDP model; refuses an unusable combination before any step."""
    if config.compression is None:
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.compression == "powersgd":
        if backend != "nccl":  # measured: a 2048-wide MLP aborts within the first steps on gloo
            raise ValueError("compression='powersgd' needs NCCL: on gloo torch's PowerSGD hook aborts mid-run "
                             "(\"Received data size doesn't match expected size\"); use 'fp16' or 'bf16' on CPU")
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=config.powersgd_rank,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif config.compression == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook if backend == "nccl" else _bf16_allreduce_hook)
