"""Mixed precision as one option: ``with ddpkit.autocast("bf16"):`` around the forward and the loss.

bf16 runs on CPU and GPU and needs no loss scaling. fp16 is for CUDA only, with torch's GradScaler::

    scaler = torch.amp.GradScaler("cuda")
    with ddpkit.autocast("fp16"):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()

``None`` or ``"fp32"`` is full precision, so the option can come straight from a command-line flag.
"""

from __future__ import annotations

import contextlib

import torch

from ddpkit.core.options import Precision, check
from ddpkit.runtime import group as runtime

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: Precision | None = "bf16"):
    """A ``torch.autocast`` context for this process's device, or a no-op for ``None`` / ``"fp32"``."""
    if check("precision", precision, Precision, none="None") in (None, "fp32"):
        return contextlib.nullcontext()
    device = runtime.ensure_init().device
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(f"fp16 autocast needs a CUDA device, this process runs on {device}; use 'bf16' on CPU")
    return torch.autocast(device.type, dtype=_DTYPES[str(precision)])
