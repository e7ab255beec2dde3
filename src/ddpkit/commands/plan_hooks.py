"""``ddpkit plan``'s hooks in its runs (the ``plan`` entry point of ``ddpkit.tools``).

:func:`ddpkit.commands.plan.run_once` sets ``DDPKIT_TOOL=ddpkit.commands.plan_hooks:from_env`` and the
variables read here. Two kinds of run use them, both counting live tensor bytes with torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``: each storage created, by weak reference, until it
is freed) from ``prepare_model`` on:

- **the planning run** (``DDPKIT_PLAN_FAKE=1``, one process): ``prepare_model`` gives the model fake tensors
  (``FakeTensorMode``: shapes, dtypes, a device, no memory), so the script's own first step (its forward,
  loss, backward and optimizer) runs without allocating the model's memory. The run stops after the first
  optimizer step and writes :class:`Capture`'s fields: what the per-mode formulas of
  :mod:`ddpkit.commands.plan_model` need.
- **a measured run** (``ddpkit plan --measure``): the script for real in one mode at N processes, stopped
  after ``DDPKIT_MAX_STEPS`` optimizer steps; each rank writes its peak.

Example::

    >>> hooks = from_env({"DDPKIT_PLAN_OUT": "/tmp/x", "DDPKIT_PLAN_FAKE": "1"})
    >>> hooks.fake, hooks.steps, hooks.on_budget(600, 2)
    (True, 1, False)
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.core import contract
from ddpkit.runtime.instrument import Hooks, OnShutdown
from ddpkit.strategies import fsdp_wrapper


def live_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under ``tensors`` (a tied weight counts once).

    >>> w = torch.zeros(4); live_bytes([w, w, w[:2], torch.zeros(2, dtype=torch.float64)])
    32
    """
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()  # the C++ storage: fake tensors have no data pointer to key on
    return sum(seen.values())


def fake_copy(model: nn.Module, device: torch.device) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Give ``model`` fake parameters and buffers on ``device``, in place (ties kept): nothing is allocated.
    Returns id(real) -> (real, fake), for an optimizer built before ``prepare_model`` (:func:`rebind`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the script's real batches meet the fake weights
    made: dict[int, torch.Tensor] = {}
    replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for store in stores:
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    with mode:
                        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                    made[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    replaced[id(t)] = (t, made[id(t)])
                store[name] = made[id(t)]
    return replaced


def rebind(optimizer: torch.optim.Optimizer, replaced: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """An optimizer built before ``prepare_model`` holds the real parameters (single and ddp keep them, so a
    script may do that): hand it their fake stand-ins before its first step."""
    for group in optimizer.param_groups:
        group["params"] = [replaced[id(p)][1] if replaced.get(id(p), (None,))[0] is p else p
                           for p in group["params"]]


def groups(model: nn.Module, shard: Any) -> list[int]:
    """Parameter bytes of each fsdp group (the blocks ``prepare_model(shard=...)`` picks, then the root's rest).

    >>> groups(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2)), [nn.Linear])
    [88, 440, 0]
    """
    picked = fsdp_wrapper.blocks(model, shard)
    taken: set[int] = set()
    sizes = []
    for block in [*picked, model]:
        mine = [p for p in block.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        sizes.append(sum(p.numel() * p.element_size() for p in mine))
    return sizes


class PlanHooks(Hooks):
    def __init__(self, out: str | None, steps: int = 1, fake: bool = False):
        self.out, self.steps, self.fake = out, steps, fake
        self.tracker: Any = None
        self.record: dict[str, Any] = {"batchnorm": 0}
        self.models: list[nn.Module] = []
        self.seen: set[int] = set()  # BatchNorm modules whose input is counted
        self.replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real parameter -> its fake stand-in
        self.done = 0

    def on_budget(self, budget_mb: float, optimizer_slots: int) -> bool:
        """Recorded, not checked: the planning run counts every mode itself."""
        self.record["script_budget"] = {"budget_mb": budget_mb, "optimizer_slots": optimizer_slots}
        return False  # a measured run measures the modes that the budget would refuse too

    def place(self, model: nn.Module, device: torch.device, options: Mapping[str, Any]) -> bool:
        """The planning run: every prepared model gets fake tensors (a GAN's two as well)."""
        if not self.fake:
            return False
        comm, sizes = options.get("comm"), [sum(p.numel() for p in m.parameters(recurse=False))
                                            for m in model.modules()]
        self.record.update(  # a second model's blocks and sizes add to the first's
            groups=self.record.get("groups", []) + groups(model, options.get("shard")),
            sync_batchnorm=bool(options.get("sync_batchnorm", True)), shard_size=options.get("shard_size"),
            bucket_view=bool(getattr(comm, "gradient_as_bucket_view", False)),
            elements=self.record.get("elements", 0) + sum(p.numel() for p in model.parameters()),
            largest_module=max([self.record.get("largest_module", 0), *sizes]))
        self.replaced.update(fake_copy(model, device))
        return True

    def train_batch(self, batch_size: int, given_globally: bool = False) -> int:
        self.record.setdefault("batch", {"size": batch_size, "global": given_globally})
        return batch_size

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        """Count from the first prepared model on; a later one is added to the count (track_external)."""
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.models.append(model)
        self.record["params"] = live_bytes(t for m in self.models for t in [*m.parameters(), *m.buffers()])
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_pre_hook(self._batchnorm_input)
        if self.tracker is not None:
            self.tracker.track_external(model)
            return
        self.device = next(iter(model.parameters()), torch.empty(0)).device
        self.tracker = MemTracker()
        self.tracker.track_external(model)
        self.tracker.__enter__()  # left at the last counted step (the script is stopped there)
        self.handles = (register_optimizer_step_pre_hook(self._before_step),
                        register_optimizer_step_post_hook(self._after_step))

    def _batchnorm_input(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        """Each BatchNorm's input at its first call (a micro-step's, with accumulation: they come one at a time)."""
        if id(module) not in self.seen and inputs and isinstance(inputs[0], torch.Tensor):
            self.seen.add(id(module))
            self.record["batchnorm"] += inputs[0].numel() * inputs[0].element_size()

    def _peak(self) -> int:
        return int(self.tracker.get_tracker_snapshot("peak").get(self.device, {}).get("Total", 0))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.done == 0:
            if self.fake:
                rebind(optimizer, self.replaced)
            if self.fake and not _steps_a_model(optimizer, self.models):  # its step would count nothing
                sys.exit("ddpkit plan: the first optimizer to step holds none of the prepared model's parameters; "
                         "pass it model.parameters() of a model from ddpkit.prepare_model")
            self.record["fb_peak"] = self._peak()
            self.record["grads"] = live_bytes(p.grad for m in self.models for p in m.parameters() if p.grad is not None)
            if self.fake:  # the step's own peak: its temporaries shard in fsdp, the activations do not
                _restart_peak(self.tracker)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.done += 1
        self.tracker.reset_mod_stats()  # the tracker's per-module records refuse a second forward otherwise
        if self.done < self.steps:
            return
        self.record.update(peak=self._peak(), optimizer=live_bytes(
            v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)))
        self.tracker.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self._write()
        # the script stops here: its next line may read the fake loss (loss.item()), and the count is done
        sys.exit(0)

    def _write(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.out is not None:
            with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
                json.dump({**self.record, "steps": self.done, "device": str(self.device), "rss_mb": _peak_rss_mb()}, f)


def _steps_a_model(optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> bool:
    mine = {id(p) for m in models for p in m.parameters()}
    return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])


def _peak_rss_mb() -> float:
    """This process's peak resident memory (Linux: ru_maxrss in KiB): the planning run's own cost."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _restart_peak(tracker: Any) -> None:
    """Count the tracker's peak from now on, as entering it does (MemTracker has no public call for it)."""
    tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in tracker._peak_mem_snap.items()}


def from_env(environ: Mapping[str, str]) -> PlanHooks:
    """The hooks of one plan run, from the variables :func:`ddpkit.commands.plan.run_once` set."""
    fake = contract.PLAN_FAKE.flag(environ)
    return PlanHooks(contract.PLAN_OUT.text(environ), 1 if fake else (contract.MAX_STEPS.number(environ) or 3), fake)

