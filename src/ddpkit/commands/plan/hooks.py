"""``ddpkit plan``'s hooks in its runs (the ``plan`` entry point of ``ddpkit.tools``, declared in pyproject.toml).

:func:`ddpkit.commands.plan.command.run_once` sets ``DDPKIT_TOOL=ddpkit.commands.plan.hooks:from_env`` and the
variables read here. Two kinds of run use them, both counting live tensor bytes with torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``: each storage created, by weak reference, until it
is freed) from ``prepare_model`` on:

- **the planning run** (``DDPKIT_PLAN_FAKE=1``, one process): ``prepare_model`` gives the model fake tensors
  (``FakeTensorMode``: shapes, dtypes, a device, no memory), so the script's own first step (its forward,
  loss, backward and optimizer) runs without allocating the model's memory. The run stops once every prepared
  model's optimizer stepped once (a GAN: both) and writes the fields of
  :class:`~ddpkit.commands.plan.memory.Capture`: what the per-mode formulas need.
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
from ddpkit.strategies.meta import on_meta


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


def tracker() -> Any:
    """torch's MemTracker counting live tensor bytes only: its per-module records refuse a module called again
    at the top level before a reset (gradient accumulation, a GAN's discriminator, two views of one batch), and
    its gradient hooks refuse frozen parameters; plan needs neither (gradients are counted as the tensors they
    are when backward makes them)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Totals(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(module, None)  # each call a first one
            super()._pre_fw_hook(module, inputs)

    return Totals()


MAX_ROUNDS = 8  # a planning run ends after this many steps of one optimizer, every model stepped or not


class PlanHooks(Hooks):
    def __init__(self, out: str | None, steps: int = 1, fake: bool = False):
        self.out, self.steps, self.fake = out, steps, fake
        self.tracker: Any = None
        self.record: dict[str, Any] = {"batchnorm": 0}
        self.models: list[nn.Module] = []
        self.seen: set[int] = set()  # BatchNorm modules whose input is counted
        self.replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real parameter -> its fake stand-in
        self.done = 0  # steps of the first optimizer that stepped (a measured run stops after K)
        self.stepped: dict[torch.optim.Optimizer, int] = {}  # each optimizer's steps, in order of its first
        self.written = False

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
        self.record["built_whole"] = self.record.get("built_whole", False) or not on_meta(model)
        self.replaced.update(fake_copy(model, device))
        return True

    def train_batch(self, batch_size: int, given_globally: bool = False) -> int:
        self.record.setdefault("batch", {"size": batch_size, "global": given_globally})
        return batch_size

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        """Count from the first prepared model on; a later one is added to the count (track_external)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.models.append(model)
        params = [p for m in self.models for p in m.parameters()]
        self.record.update(params=live_bytes([*params, *(b for m in self.models for b in m.buffers())]),
                           param_bytes=live_bytes(params), trainable_bytes=live_bytes(p for p in params
                                                                                      if p.requires_grad))
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.register_forward_pre_hook(self._batchnorm_input)
        model.register_forward_pre_hook(self._first_forward)
        model.register_forward_hook(self._forward_done)
        if self.tracker is not None:
            self.tracker.track_external(model)
            return
        self.device = next(iter(model.parameters()), torch.empty(0)).device
        self.tracker = tracker()
        self.tracker.track_external(model)
        on_shutdown(self._at_end)
        self.tracker.__enter__()  # left at the last counted step (the script is stopped there)
        self.handles = (register_optimizer_step_pre_hook(self._before_step),
                        register_optimizer_step_post_hook(self._after_step))

    def _batchnorm_input(self, module: nn.Module, inputs: tuple[Any, ...]) -> None:
        """Each BatchNorm's input at its first call (a micro-step's, with accumulation: they come one at a time)."""
        if id(module) not in self.seen and inputs and isinstance(inputs[0], torch.Tensor):
            self.seen.add(id(module))
            self.record["batchnorm"] += inputs[0].numel() * inputs[0].element_size()

    def _first_forward(self, module: nn.Module, inputs: Any) -> None:
        """What lives besides the models when the first step starts (a dataset made after prepare_model, the
        batch, a restored optimizer state): held whole on every rank in every mode, and not an activation."""
        if "resident" not in self.record and torch.is_grad_enabled():  # not a no_grad shape check before training
            self.record["resident"] = self._current() - self.record["params"]
            self.record["setup_peak"] = self._peak()  # a restore's loaded payload, say: gone before training
            if self.fake:
                _restart_peak(self.tracker)

    def _forward_done(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self.done == 0 and "fwd_peak" not in self.record and "resident" in self.record:
            self.record["fwd_peak"] = self._peak()

    def _current(self) -> int:
        return int(self.tracker.get_tracker_snapshot("current").get(self.device, {}).get("Total", 0))

    def _peak(self) -> int:
        return int(self.tracker.get_tracker_snapshot("peak").get(self.device, {}).get("Total", 0))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        first = optimizer not in self.stepped
        if self.fake and first:
            rebind(optimizer, self.replaced)
            if not _steps_a_model(optimizer, self.models):  # its step would count nothing
                sys.exit("ddpkit plan: the first optimizer to step holds none of the prepared model's parameters; "
                         "pass it model.parameters() of a model from ddpkit.prepare_model")
        if first:  # a restored optimizer state lived through the first step: in resident, and in the state after
            self.record["restored"] = self.record.get("restored", 0) + live_bytes(_states(optimizer))
        if not self.fake and not first and self._covered() and min(self.stepped.values()) >= self.steps:
            self._finish()  # a measured run: each model's optimizers took K steps
        self.stepped.setdefault(optimizer, 0)
        if self.fake:  # each phase's own peak: the optimizer step's temporaries shard in fsdp, activations do not
            self.record["fb_peak"] = max(self.record.get("fb_peak", 0), self._peak())
            self.record["grads"] = max(self.record.get("grads", 0), live_bytes(
                p.grad for m in self.models for p in m.parameters() if p.grad is not None))
            _restart_peak(self.tracker)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.stepped[optimizer] += 1
        if optimizer is next(iter(self.stepped)):
            self.done += 1
        if not self.fake:
            return
        self.record["peak"] = max(self.record.get("peak", 0), self._peak())
        _restart_peak(self.tracker)
        covered = self._covered()
        if self.out is not None:  # how far the fake run got: a value read before the stop is told precisely
            with open(os.path.join(self.out, "progress.json"), "w") as f:
                stepped = self._stepped_ids()
                json.dump({"stepped": sum(self._stepped_in(m, stepped) for m in self._trained()),
                           "models": len(self._trained())}, f)
        # each trained model's optimizer stepped once (a GAN: both, a WGAN's critic 5 times first); a model
        # prepared with trainable parameters that no optimizer steps (an EMA copy) ends it after MAX_ROUNDS
        if covered or max(self.stepped.values()) >= MAX_ROUNDS:
            self._finish()

    def _trained(self) -> list[nn.Module]:
        return [m for m in self.models if any(p.requires_grad for p in m.parameters())]

    def _stepped_ids(self) -> set[int]:
        """The parameters some optimizer that stepped holds."""
        return {id(p) for o in self.stepped for g in o.param_groups for p in g["params"]}

    def _optimizer_bytes(self) -> int:
        return live_bytes(t for o in self.stepped for t in _states(o))

    def _stepped_in(self, model: nn.Module, stepped: set[int]) -> bool:
        return any(id(p) in stepped for p in model.parameters())

    def _covered(self) -> bool:
        """Every prepared model with trainable parameters has some of them in an optimizer that stepped (a linear
        probe's optimizer holds the head alone)."""
        stepped = self._stepped_ids()
        return all(self._stepped_in(m, stepped) for m in self._trained())

    def _finish(self) -> None:
        """Write the record and stop the script: its next line may read the fake loss (loss.item())."""
        stepped = self._stepped_ids()
        self.record.update(optimizer=self._optimizer_bytes(),
                           grads_kept=any(p.grad is not None for m in self.models for p in m.parameters()),
                           # no optimizer zeroes these (a linear probe's backbone): the next backward makes each
                           # one anew, one at a time, and adds it to the old
                           stale_grads=max((live_bytes([p.grad]) for m in self.models for p in m.parameters()
                                            if p.grad is not None and id(p) not in stepped), default=0))
        if not self.fake:
            self.record["peak"] = self._peak()
        self.tracker.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        self._write()
        sys.exit(0)

    def _at_end(self) -> None:
        """The script ended before a measured run's K steps: its record as it stands (nothing in a planning run,
        whose record needs a finished step)."""
        if self.tracker is not None and not self.fake and self.stepped and not self.written:
            self.record.update(peak=self._peak(), optimizer=self._optimizer_bytes())
            self._write()

    def _write(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.out is not None:
            with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
                json.dump({**self.record, "steps": self.done, "device": str(self.device), "rss_mb": _peak_rss_mb()}, f)
        self.written = True


def _states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


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
    """The hooks of one plan run, from the variables :func:`ddpkit.commands.plan.command.run_once` set."""
    fake = contract.PLAN_FAKE.flag(environ)
    return PlanHooks(contract.PLAN_OUT.text(environ), 1 if fake else (contract.MAX_STEPS.number(environ) or 3), fake)

