"""SyncBatchNorm that also runs on CPU / gloo.

torch's ``nn.SyncBatchNorm`` refuses CPU tensors ("SyncBatchNorm expected input tensor to be on GPU"),
because its kernels (``batch_norm_stats`` and friends) exist for CUDA only, and DDP refuses it in CPU
modules. :func:`convert_sync_batchnorm` keeps torch's class on GPUs and, elsewhere, uses this module's
:class:`SyncBatchNorm`, which computes the same statistics with ordinary tensor ops and two collectives:

- forward: each rank's (count, mean, M2) is all-gathered and merged with Chan's parallel formula, so the
  batch is normalised with the mean and biased variance of the *global* batch (ranks may hold different
  batch sizes); running stats take the unbiased global variance, exactly as BatchNorm would on the
  concatenated batch.
- backward: the per-channel sums of dy and dy*x̂ are all-reduced; the weight and bias gradients stay
  local because DDP averages them afterwards.

State-dict keys are those of BatchNorm, so checkpoints move freely between the two.

Example::

    model = convert_sync_batchnorm(model, torch.device("cpu"))   # BatchNorm*d -> ddpkit's SyncBatchNorm
"""

from __future__ import annotations

import copy
import copyreg
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view([1, -1] + [1] * (x.dim() - 2))


def _global_stats(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge every rank's (count, mean, M2) into the global mean, biased variance and count; and the count the
    running variance's unbiased correction takes: one rank's when every rank holds the very same batch (its
    statistics and a fingerprint of its values: a fixed noise for a sample grid run in train mode), as one
    process would see that batch once, not N copies of it. (A batch-sized input the same on every rank, N
    copies in one process's batch, is counted once too: a difference of n/(n-1) in what only eval reads.)"""
    dims = _reduce_dims(x)
    count = x.numel() // x.size(1)
    acc = x.double()  # merging in float64 keeps the result within fp32 rounding of the single-batch value
    if count > 0:
        mean = acc.mean(dims)
        m2 = ((acc - _channel_view(mean, acc)) ** 2).sum(dims)
    else:  # an empty batch still takes part in the collective, with weight zero
        mean = m2 = acc.new_zeros(x.size(1))
    # (a fingerprint of the batch itself: ranks whose different samples share their statistics, a binary feature's
    # [0, 1, 0, 1] and [1, 0, 1, 0], are not one batch seen N times; review 29)
    weights = torch.arange(acc.numel(), dtype=acc.dtype, device=acc.device).mul_(0.6180339887498949).frac_()
    local = torch.cat([acc.new_tensor([count]), mean, m2, (acc.flatten() * weights).sum().reshape(1)])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    stats = torch.stack(gathered)
    counts, means, m2s = stats[:, :1], stats[:, 1:1 + x.size(1)], stats[:, 1 + x.size(1):-1]
    total = counts.sum()
    if total < 2:
        raise ValueError(f"expected more than 1 value per channel across all ranks when training, got {int(total)}")
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2s + counts * (means - g_mean) ** 2).sum(0)
    # (merged, N copies of one batch have its mean and biased variance: only the n/(n-1) differs)
    once = counts[0, 0] if counts[0, 0] > 1 and bool((stats == stats[0]).all()) else total
    return g_mean, g_m2 / total, total, once


class _SyncBatchNormCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        mean, var, total, once = _global_stats(x, group)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * once / (once - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        xhat = (x - _channel_view(mean.to(x.dtype), x)) * _channel_view(invstd, x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.group = total, group
        out = xhat
        if weight is not None:
            out = out * _channel_view(weight, x) + _channel_view(bias, x)
        return out

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = _reduce_dims(dy)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        dist.all_reduce(both, group=ctx.group)
        mean_dy, mean_dy_xhat = (both / ctx.total).to(dy.dtype).chunk(2)
        scale = invstd if weight is None else invstd * weight
        dx = _channel_view(scale, dy) * (dy - _channel_view(mean_dy, dy) - xhat * _channel_view(mean_dy_xhat, dy))
        grad_w = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy if weight is not None and ctx.needs_input_grad[2] else None
        return dx, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the global batch for CPU processes; a plain BatchNorm in eval mode or with one process.

    It is not a subclass of ``nn.SyncBatchNorm`` on purpose: DDP rejects those on CPU modules.
    """

    def __init__(self, *args, process_group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not self.training or group is None or dist.get_world_size(group) < 2:
            return super().forward(x)
        momentum = self._momentum()
        track = self.track_running_stats
        return _SyncBatchNormCPU.apply(x, self.weight, self.bias, self.running_mean if track else None,
                                       self.running_var if track else None, self.eps, momentum, group)

    def _momentum(self) -> float:
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm does
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum


class _SavedPlain:
    """Pickled as the BatchNorm it stands in for: ``torch.save(ddpkit.unwrap(model), path)`` of a whole model (what
    convert writes for ``torch.save(model, path)``) holds ``nn.BatchNorm2d``, as the one-process run's file does, and
    opens where ddpkit is not installed (its process group, not picklable, stays behind). A deep copy (a
    moving-average model made after the wrap) keeps the synchronised class: it trains over the global batch too."""

    PLAIN: type = nn.BatchNorm2d

    def __reduce_ex__(self, protocol: Any) -> Any:
        state = {k: v for k, v in self.__dict__.items() if k != "process_group"}
        # (copyreg's reconstructor makes any class, where pickle's NEWOBJ insists on the object's own)
        return copyreg._reconstructor, (self.PLAIN, object, None), state  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict) -> Any:
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "process_group"}, memo))
        twin.__dict__["process_group"] = self.__dict__.get("process_group")  # (a group is shared, not copied)
        return twin


class SyncBatchNorm1d(_SavedPlain, SyncBatchNorm, nn.BatchNorm1d):
    """:class:`SyncBatchNorm` in place of an ``nn.BatchNorm1d``, still one to ``isinstance`` (see :data:`KINDS`)."""

    PLAIN = nn.BatchNorm1d


class SyncBatchNorm2d(_SavedPlain, SyncBatchNorm, nn.BatchNorm2d):
    """:class:`SyncBatchNorm` in place of an ``nn.BatchNorm2d``, still one to ``isinstance``."""

    PLAIN = nn.BatchNorm2d


class SyncBatchNorm3d(_SavedPlain, SyncBatchNorm, nn.BatchNorm3d):
    """:class:`SyncBatchNorm` in place of an ``nn.BatchNorm3d``, still one to ``isinstance``."""

    PLAIN = nn.BatchNorm3d


class TorchSyncBatchNorm1d(_SavedPlain, nn.SyncBatchNorm, nn.BatchNorm1d):
    """torch's ``nn.SyncBatchNorm`` (CUDA) in place of an ``nn.BatchNorm1d``, still one to ``isinstance``."""

    PLAIN = nn.BatchNorm1d


class TorchSyncBatchNorm2d(_SavedPlain, nn.SyncBatchNorm, nn.BatchNorm2d):
    """torch's ``nn.SyncBatchNorm`` (CUDA) in place of an ``nn.BatchNorm2d``, still one to ``isinstance``."""

    PLAIN = nn.BatchNorm2d


class TorchSyncBatchNorm3d(_SavedPlain, nn.SyncBatchNorm, nn.BatchNorm3d):
    """torch's ``nn.SyncBatchNorm`` (CUDA) in place of an ``nn.BatchNorm3d``, still one to ``isinstance``."""

    PLAIN = nn.BatchNorm3d


# a script's own code after the wrap asks ``isinstance(m, nn.BatchNorm2d)`` (network-slimming's L1 subgradient on the
# BatchNorm weights, a fine-tuning's "freeze BatchNorm"): a plain SyncBatchNorm answered False and the code silently
# skipped every layer. The synchronised layer keeps the kind it replaced: (ddpkit's CPU class, torch's CUDA class).
KINDS = {nn.BatchNorm1d: (SyncBatchNorm1d, TorchSyncBatchNorm1d),
         nn.BatchNorm2d: (SyncBatchNorm2d, TorchSyncBatchNorm2d),
         nn.BatchNorm3d: (SyncBatchNorm3d, TorchSyncBatchNorm3d)}


def convert_sync_batchnorm(module: nn.Module, device: torch.device, process_group=None) -> nn.Module:
    """Replace every ``BatchNorm*d`` by a synchronised one sharing its parameters and buffers, of a class that is
    still a ``BatchNorm*d`` of its dimension (:data:`KINDS`).

    torch's ``nn.SyncBatchNorm`` for CUDA modules, :class:`SyncBatchNorm` (this module's) elsewhere.

    >>> net = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)), torch.device("cpu"))
    >>> type(net[1]).__name__, isinstance(net[1], nn.BatchNorm2d), isinstance(net[1], SyncBatchNorm)
    ('SyncBatchNorm2d', True, True)
    """
    kinds = {name: type(m) for name, m in module.named_modules() if type(m) in KINDS}
    if device.type == "cuda":
        out = nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    else:
        out = _convert_cpu(module, process_group)
    for name, m in out.named_modules():
        if name in kinds and type(m) in (SyncBatchNorm, nn.SyncBatchNorm):
            m.__class__ = KINDS[kinds[name]][type(m) is nn.SyncBatchNorm]  # ddpkit's own instance, made above
    return out


def _convert_cpu(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group=process_group)
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child, process_group))
    return out


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def sync_batchnorms(model: nn.Module, state: Any) -> nn.Module:
    """BatchNorm layers -> synchronised ones (statistics over the global batch), said once; ddp and fsdp."""
    if not has_batchnorm(model):
        return model
    if state.is_main:
        print("ddpkit: BatchNorm -> SyncBatchNorm (statistics over the global batch)", file=sys.stderr, flush=True)
    return convert_sync_batchnorm(model, state.device)
