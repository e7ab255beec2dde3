"""Per-rank peak memory of each mode at N processes, from one fake step of the script in one process.

The planning run (:mod:`ddpkit.commands.plan.hooks`) counts, with torch's ``MemTracker``, the script's first
step at one process: what lived when its first forward started, the peaks at the end of that forward, of the
backward and of the optimizer step, with the parameters, gradients and optimizer state they held. Those split
into

- ``state``: parameters and buffers, gradients, optimizer state (the part ``init_empty(budget_mb=)`` counts);
- ``resident``: what else lived when the first forward started (a dataset made after ``prepare_model``, the
  batch): whole on every rank, in every mode;
- ``activations``: the rest of the forward's and of the backward's peak (saved activations, the loss), which
  scale with the per-process batch; in later steps the optimizer state lives through them, and the gradients
  too in the forward when the script zeroes them after it (``grads_kept``: still set after the step);
- ``temporaries``: the rest of the optimizer step's peak (e.g. Adam's ``foreach`` intermediates).

and each mode adds what it holds on top:

- ``ddp``: the reducer's gradient buckets (one more copy of the gradients, unless ``gradient_as_bucket_view``);
  SyncBatchNorm (CPU, ddpkit's) keeps two tensors the size of each BatchNorm's input for backward; the wrap
  itself broadcasts the parameters through flat copies (up to 250 MiB): a frozen backbone peaks there;
- ``fsdp`` / ``hsdp``: ``state`` and ``temporaries`` divided over the shard group, plus three copies of the
  largest group gathered whole at once (the block in use, the one prefetched, its unsharded gradient); a model
  built whole (not under ``init_empty``) lives beside its shards while ``fully_shard`` makes them.

Those constants were measured on CPU with the same tracker (``ddpkit plan --measure`` runs it for real); the
suite checks them on three scripts at 1, 2 and 3 processes (tests/test_plan.py).

Example::

    >>> c = Capture.from_json({"params": 100, "grads": 100, "optimizer": 200, "fwd_peak": 300, "fb_peak": 500,
    ...                        "peak": 450, "groups": [100], "batchnorm": 0, "elements": 25, "largest_module": 25})
    >>> single(c).total, ddp(c, 2).total, sharded(c, 2).total
    (700, 800, 800)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

GATHERED_COPIES = 3  # fsdp: the block in use, the one prefetched, and the unsharded gradient of one of them
DDP_BROADCAST_BUCKET = 250 * 2**20  # DistributedDataParallel's broadcast_bucket_size
SYNC_BN_COPIES = 2  # ddpkit's CPU SyncBatchNorm: x-hat and its gathered statistics' broadcasts, per BatchNorm


@dataclasses.dataclass(frozen=True)
class Capture:
    """What the planning run measured, in bytes (see the module's docstring)."""

    params: int  # parameters and buffers
    grads: int
    optimizer: int
    fb_peak: int  # the peak up to the first optimizer step
    peak: int  # the peak during the first optimizer step
    groups: tuple[int, ...]
    batchnorm: int
    elements: int
    largest_module: int
    resident: int = 0  # all that lived at the first forward besides the models, a restored optimizer state too
    restored: int = 0  # the optimizer state that was restored before the first step
    stale_grads: int = 0  # the largest gradient no optimizer zeroes: a later backward makes it anew beside it
    setup_peak: int = 0  # the peak before the first forward (a restore's payload)
    fwd_peak: int | None = None  # the peak at the end of the first forward (None: fb_peak)
    grads_kept: bool = True
    built_whole: bool = True  # the script built the model on a device, not under init_empty (meta)
    param_bytes: int | None = None  # parameters alone (None: params)
    trainable_bytes: int | None = None
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
            if _count(data.get(name), 0) is None:
                raise ValueError(f"plan record: {name}={data.get(name)!r}, expected a byte count (an int >= 0)")
        optional = ("resident", "restored", "stale_grads", "setup_peak", "fwd_peak", "param_bytes",
                    "trainable_bytes")
        for name in optional:
            if name in data and _count(data[name], 0) is None:
                raise ValueError(f"plan record: {name}={data[name]!r}, expected a byte count (an int >= 0)")
        groups = data.get("groups")
        if not isinstance(groups, list) or not all(_count(g, 0) is not None for g in groups):
            raise ValueError(f"plan record: groups={groups!r}, expected a list of byte counts")
        batch: Mapping[str, Any] = data["batch"] if isinstance(data.get("batch"), Mapping) else {}
        budget: Mapping[str, Any] = data["script_budget"] if isinstance(data.get("script_budget"), Mapping) else {}
        return cls(**{n: data[n] for n in ints}, **{n: data[n] for n in optional if n in data},
                   groups=tuple(groups), grads_kept=data.get("grads_kept") is not False,
                   built_whole=data.get("built_whole") is not False,
                   sync_batchnorm=data.get("sync_batchnorm") is not False, bucket_view=data.get("bucket_view") is True,
                   batch_size=_count(batch.get("size")), batch_global=batch.get("global") is True,
                   script_budget_mb=_number(budget.get("budget_mb")),
                   script_slots=_count(budget.get("optimizer_slots"), 0),
                   shard_size=_count(data.get("shard_size")))

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def other(self) -> int:
        """What lives besides the state in every step: ``resident`` but the restored optimizer state."""
        return max(0, self.resident - self.restored)

    @property
    def act_backward(self) -> int:
        return max(0, self.fb_peak - self.params - self.grads - self.resident)

    @property
    def act_forward(self) -> int:
        return max(0, (self.fb_peak if self.fwd_peak is None else self.fwd_peak) - self.params - self.resident)

    @property
    def temporaries(self) -> int:
        return max(0, self.peak - self.state - self.other)  # a restored optimizer state is in the state

    def element_size(self) -> int:
        """Bytes per parameter element (buffers are not parameters)."""
        size = self.params if self.param_bytes is None else self.param_bytes
        return size // self.elements if self.elements else 4

    def slots(self) -> int:
        """Optimizer tensors per parameter (Adam 2, SGD with momentum 1): the script's own
        ``init_empty(optimizer_slots=)`` when it gave one, else what the first step made."""
        if self.script_slots is not None:
            return self.script_slots
        trained = self.trainable_bytes if self.trainable_bytes is not None else self.params
        return round(self.optimizer / trained) if trained else 0

    def batch_scale(self, share: int) -> float:
        """Activations per rank at N processes over those of one: 1/N of a ``global_batch_size``."""
        if not self.batch_global or not self.batch_size:
            return 1.0
        return math.ceil(self.batch_size / share) / self.batch_size


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One mode at N processes: bytes per rank, by part, and the peak (the largest phase's sum)."""

    state: int
    resident: int
    activations: int
    comm: int
    temporaries: int
    total: int


def estimate(c: Capture, shard: int = 1, scale: float = 1.0, extra_act: int = 0, comm: int = 0,
             comm_in_step: bool = False, construction: int = 0) -> Estimate:
    """The three phases of a later step, with the state split ``shard`` ways: the forward (the gradients freed
    unless the script keeps them into it), the backward, the optimizer step; the peak is the largest of them and
    of the wrap's own (``construction``)."""
    state, temps = -(-c.state // shard), -(-c.temporaries // shard)
    freed = 0 if c.grads_kept else -(-c.grads // shard)
    forward = round((c.act_forward + extra_act) * scale) - freed
    backward = round((c.act_backward + extra_act) * scale) + -(-c.stale_grads // shard)
    peak = state + c.other + max(forward + comm, backward + comm, temps + (comm if comm_in_step else 0))
    return Estimate(state, c.other, max(forward, backward), comm, temps, max(peak, construction))


def single(c: Capture) -> Estimate:
    return estimate(c, construction=c.setup_peak)


def ddp(c: Capture, n: int) -> Estimate:
    """Plus the gradient buckets (for the model's lifetime) and SyncBatchNorm's saved tensors."""
    syncbn = SYNC_BN_COPIES * c.batchnorm if c.sync_batchnorm else 0
    # DDP's constructor broadcasts rank 0's parameters and buffers through flat copies of up to 250 MiB
    return estimate(c, 1, c.batch_scale(n), syncbn, 0 if c.bucket_view else c.grads, comm_in_step=True,
                    construction=max(c.setup_peak, c.params + min(c.params, DDP_BROADCAST_BUCKET)))


def sharded(c: Capture, shard: int, n: int | None = None) -> Estimate:
    """fsdp (``shard`` = N) or hsdp (``shard`` = the shard group size, ``n`` the world size)."""
    syncbn = SYNC_BN_COPIES * c.batchnorm if c.sync_batchnorm else 0
    whole = c.params + -(-c.params // shard) if c.built_whole else 0  # fully_shard: the model and its shards
    return estimate(c, shard, c.batch_scale(n or shard), syncbn, GATHERED_COPIES * max(c.groups, default=0),
                    construction=whole)


def _count(value: Any, least: int = 1) -> int | None:
    return value if type(value) is int and value >= least else None


def _number(value: Any) -> float | None:
    return float(value) if type(value) in (int, float) and math.isfinite(value) else None
