"""Communication options for DDP, behind one small config, checked before training starts.

Example::

    model = ddpkit.prepare_model(net, comm=ddpkit.CommConfig(bucket_mb=50, compression="fp16"))

- ``bucket_mb``: gradient bucket size (DDP's ``bucket_cap_mb``; torch's default 25).
- ``gradient_as_bucket_view``: gradients alias the communication buckets (saves a copy and memory).
- ``static_graph``: the set of used parameters never changes (lets DDP skip per-step bookkeeping).
- ``compression`` (lossy, opt-in): ``"fp16"`` or ``"bf16"`` send gradients in 16 bits and average in fp32;
  ``"powersgd"`` sends a low-rank approximation (torch's PowerSGD hook, ``powersgd_rank``).

On NCCL, fp16 and bf16 are torch's own ``fp16_compress_hook`` / ``bf16_compress_hook``. On gloo, torch's fp16
hook measured slower than no hook (gloo sums half precision slowly) and its bf16 hook refuses to run, so ddpkit
uses an all-gather hook instead: each rank sends its 16-bit gradient once and every rank sums the copies in
fp32 (2(N-1)/N of the fp32 all-reduce's bytes become (N-1)/N of half as many).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

COMPRESSIONS = (None, "fp16", "bf16", "powersgd")


@dataclasses.dataclass(frozen=True)
class CommConfig:
    bucket_mb: float | None = None
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    compression: str | None = None
    powersgd_rank: int = 2

    def __post_init__(self):
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r} is not one of none, fp16, bf16, powersgd")
        if self.bucket_mb is not None and self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be >= 1, got {self.powersgd_rank}")

    def ddp_kwargs(self) -> dict:
        kwargs = {"gradient_as_bucket_view": self.gradient_as_bucket_view, "static_graph": self.static_graph}
        if self.bucket_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_mb
        return kwargs

    def describe(self) -> str:
        parts = [f"bucket {self.bucket_mb or 25} MB"]
        parts += ["grad-as-bucket-view"] * self.gradient_as_bucket_view + ["static-graph"] * self.static_graph
        if self.compression:
            parts.append(f"{self.compression} compression (lossy)")
        return ", ".join(parts)


def from_env(config: CommConfig | None, environ: Mapping[str, str]) -> CommConfig | None:
    """The script's config, overridden by ``DDPKIT_COMM`` (JSON of CommConfig fields, set by ``ddpkit bench``).

    >>> from_env(CommConfig(bucket_mb=10), {"DDPKIT_COMM": '{"gradient_as_bucket_view": true}'})
    CommConfig(bucket_mb=10, gradient_as_bucket_view=True, static_graph=False, compression=None, powersgd_rank=2)
    """
    if not environ.get("DDPKIT_COMM"):
        return config
    fields = json.loads(environ["DDPKIT_COMM"])
    return dataclasses.replace(config, **fields) if config else CommConfig(**fields)


def skip_hook(state, bucket):
    """No communication at all (gradients stay local): ``ddpkit bench`` times the step without it to
    measure how much of the step communication takes. Never for training."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _allgather_hook(dtype: torch.dtype):
    """Send the bucket once in ``dtype``; every rank sums all copies in fp32 and divides by the world size."""

    # No annotations on purpose: DDP compares the `bucket` annotation with dist.GradBucket, and this module's
    # `from __future__ import annotations` would turn it into a string.
    def hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        grad = bucket.buffer()
        parts = [torch.empty(grad.numel(), dtype=dtype, device=grad.device) for _ in range(world)]
        work = dist.all_gather(parts, grad.to(dtype), group=group, async_op=True)

        def average(fut):
            total = torch.zeros_like(grad)
            for part in parts:
                total.add_(part)
            return total.div_(world)

        return work.get_future().then(average)

    hook.__name__ = f"ddpkit_{dtype}_allgather_hook".replace("torch.", "")
    return hook


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
    elif backend == "nccl":
        hook = default_hooks.fp16_compress_hook if config.compression == "fp16" else default_hooks.bf16_compress_hook
        model.register_comm_hook(None, hook)
    else:
        model.register_comm_hook(None, _allgather_hook(torch.float16 if config.compression == "fp16" else torch.bfloat16))
