"""Per-rank peak memory of each mode at N processes, from one fake step of the script in one process.

The planning run (:mod:`ddpkit.commands.plan_hooks`) counts, with torch's ``MemTracker``, the script's first
step at one process: the peak of its forward and backward, and the peak of its optimizer step, with the
parameters, gradients and optimizer state they held. Those split into

- ``state``: parameters and buffers, gradients, optimizer state (the part ``init_empty(budget_mb=)`` counts);
- ``activations``: the rest of the forward/backward peak (saved activations, the batch, the loss), which
  scales with the per-process batch;
- ``temporaries``: the rest of the optimizer step's peak (e.g. Adam's ``foreach`` intermediates).

and each mode adds what it holds on top:

- ``ddp``: the reducer's gradient buckets (one more copy of the gradients, unless ``gradient_as_bucket_view``);
  SyncBatchNorm (CPU, ddpkit's) keeps two tensors the size of each BatchNorm's input for backward;
- ``fsdp`` / ``hsdp``: ``state`` and ``temporaries`` divided over the shard group, plus three copies of the
  largest group gathered whole at once (the block in use, the one prefetched, its unsharded gradient).

Those constants were measured on CPU with the same tracker (``ddpkit plan --measure`` runs it for real); the
suite checks them on three scripts at 1, 2 and 3 processes (tests/test_plan.py).

Example::

    >>> c = Capture.from_json({"params": 100, "grads": 100, "optimizer": 200, "fb_peak": 500, "peak": 450,
    ...                        "groups": [100], "batchnorm": 0, "elements": 25, "largest_module": 25})
    >>> single(c).total, ddp(c, 2).total, sharded(c, 2).total
    (700, 800, 800)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

GATHERED_COPIES = 3  # fsdp: the block in use, the one prefetched, and the unsharded gradient of one of them
SYNC_BN_COPIES = 2  # ddpkit's CPU SyncBatchNorm: x-hat and its gathered statistics' broadcasts, per BatchNorm


@dataclasses.dataclass(frozen=True)
class Capture:
    """What the planning run measured, in bytes (see the module's docstring)."""

    params: int
    grads: int
    optimizer: int
    fb_peak: int
    peak: int
    groups: tuple[int, ...]
    batchnorm: int
    elements: int
    largest_module: int
    sync_batchnorm: bool = True
    bucket_view: bool = False
    batch_size: int | None = None
    batch_global: bool = False
    script_budget_mb: float | None = None
    script_slots: int | None = None
    shard_size: int | None = None  # the script's prepare_model(shard_size=), hsdp's

    @classmethod
    def from_json(cls, data: Any) -> Capture:
        """From a planning run's record; anything else is a one-line ValueError naming the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan record is a JSON object, got {type(data).__name__}")
        ints = ("params", "grads", "optimizer", "fb_peak", "peak", "batchnorm", "elements", "largest_module")
        for name in ints:
            value = data.get(name)
            if type(value) is not int or value < 0:
                raise ValueError(f"plan record: {name}={value!r}, expected a byte count (an int >= 0)")
        groups = data.get("groups")
        if not isinstance(groups, list) or not all(type(g) is int and g >= 0 for g in groups):
            raise ValueError(f"plan record: groups={groups!r}, expected a list of byte counts")
        batch = data.get("batch") or {}
        budget = data.get("script_budget") or {}
        return cls(**{n: data[n] for n in ints}, groups=tuple(groups),
                   sync_batchnorm=data.get("sync_batchnorm") is not False, bucket_view=data.get("bucket_view") is True,
                   batch_size=batch.get("size") if type(batch.get("size")) is int else None,
                   batch_global=batch.get("global") is True,
                   script_budget_mb=_number(budget.get("budget_mb")),
                   script_slots=budget.get("optimizer_slots") if type(budget.get("optimizer_slots")) is int else None,
                   shard_size=_count(data.get("shard_size")))

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        return max(0, self.fb_peak - self.params - self.grads)

    @property
    def temporaries(self) -> int:
        return max(0, self.peak - self.state)

    def slots(self) -> int:
        """Optimizer tensors per parameter (Adam 2, SGD with momentum 1): the script's own
        ``init_empty(optimizer_slots=)`` when it gave one, else what the first step made."""
        if self.script_slots is not None:
            return self.script_slots
        return round(self.optimizer / self.params) if self.params else 0

    def batch_scale(self, share: int) -> float:
        """Activations per rank at N processes over those of one: 1/N of a ``global_batch_size``."""
        if not self.batch_global or not self.batch_size:
            return 1.0
        return math.ceil(self.batch_size / share) / self.batch_size


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One mode at N processes: bytes per rank, by part."""

    state: int
    activations: int
    comm: int
    temporaries: int
    comm_in_step: bool = False  # ddp's buckets live as long as the model; fsdp's gathered blocks only in a pass

    @property
    def total(self) -> int:
        held = self.comm if self.comm_in_step else 0
        return self.state + max(self.activations + self.comm, self.temporaries + held)


def single(c: Capture) -> Estimate:
    return Estimate(c.state, c.activations, 0, c.temporaries)


def ddp(c: Capture, n: int) -> Estimate:
    scale = c.batch_scale(n)
    syncbn = SYNC_BN_COPIES * c.batchnorm if c.sync_batchnorm else 0
    buckets = 0 if c.bucket_view else c.grads
    return Estimate(c.state, round((c.activations + syncbn) * scale), buckets, c.temporaries, comm_in_step=True)


def sharded(c: Capture, shard: int, n: int | None = None) -> Estimate:
    """fsdp (``shard`` = N) or hsdp (``shard`` = the shard group size, ``n`` the world size)."""
    scale = c.batch_scale(n or shard)
    syncbn = SYNC_BN_COPIES * c.batchnorm if c.sync_batchnorm else 0
    gathered = GATHERED_COPIES * max(c.groups, default=0)
    return Estimate(-(-c.state // shard), round((c.activations + syncbn) * scale), gathered,
                    -(-c.temporaries // shard))


def _count(value: Any) -> int | None:
    return value if type(value) is int and value >= 1 else None


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) else None
