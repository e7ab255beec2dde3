"""Inside each run of ``ddpkit verify``: the step cap, what the run did, and the step-1 gradients.

:class:`Recorder` is created by :mod:`ddpkit.instrument` in a verify run only. It

- stops the run after K optimizer steps (of every optimizer) with a clean ``SystemExit(0)`` raised right
  after the K-th step. A loader that simply ran dry at the cap broke loops that re-create their iterator
  (``except StopIteration: it = iter(loader); next(it)``); exiting does not depend on the loop's shape, and
  the shutdown hooks still save the weights as they are after step K;
- turns off dropout given as a float attribute (``nn.MultiheadAttention(dropout=)``, ``nn.LSTM/GRU(dropout=)``,
  a GPT block's ``self.dropout`` for ``scaled_dot_product_attention``): no Dropout module holds it;
- writes, on rank 0, the gradients of step 1 (``<out>.grads``), each element's largest |gradient| over all
  the steps (``<out>.gradpeak``: :mod:`ddpkit.verify_noise` excuses elements that only ever got float noise)
  and the facts (``<out>.json``): models prepared, training batches handed out by ddpkit loaders, optimizer
  steps, whether the cap stopped the run, whether torch's global random generator was drawn from during a
  step (noise, augmentation), and the largest learning rate any optimizer stepped with.
  ``ddpkit verify`` refuses what it cannot compare and names a FAIL's likely cause from them.

Example (what verify reads back)::

    {"models": 1, "batches": 3, "steps": 3, "capped": true, "random_draws": false, "lr": 0.001}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

OnShutdown = Callable[[Callable[[], None]], None]


def dropout_off(model: nn.Module) -> int:
    """Set every dropout of ``model`` to 0, modules and float attributes alike; returns how many.

    >>> dropout_off(nn.Sequential(nn.Dropout(0.5), nn.LSTM(2, 2, num_layers=2, dropout=0.3),
    ...                           nn.MultiheadAttention(4, 2, dropout=0.1)))
    3
    """
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p, count = 0.0, count + 1
        for name in ("dropout", "dropout_p", "attn_dropout_p"):
            value = module.__dict__.get(name)  # a float attribute, never a submodule or a bool
            if isinstance(value, float) and 0.0 < value < 1.0:
                setattr(module, name, 0.0)
                count += 1
    return count


def full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy; a sharded (fsdp DTensor) tensor gathered first (collective: every rank calls it)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu()


class StepCap(SystemExit):
    """The run reached verify's step cap: a clean exit (code 0) the facts file reports as ``capped``."""


class Recorder:
    def __init__(self, out: str, max_steps: int | None):
        self.out, self.max_steps = out, max_steps
        self.models: list[tuple[nn.Module, bool]] = []
        self.loaders: list[Any] = []
        self.counts: dict[int, int] = {}  # id(optimizer) -> steps taken
        self.capped = self.random_draws = False
        self.main = False
        self._rng: torch.Tensor | None = None
        self.peaks: dict[str, torch.Tensor] = {}  # name -> largest |gradient| per element so far
        self.lr = 0.0
        self._hooked = False

    def _hook(self, is_main: bool, on_shutdown: OnShutdown) -> None:
        self.main = self.main or is_main
        if self._hooked:
            return
        self._hooked = True
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        on_shutdown(self._write_facts)

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        self.models.append((model, is_main))
        self._hook(is_main, on_shutdown)

    def on_loader(self, loader: Any, is_main: bool, on_shutdown: OnShutdown) -> None:
        self.loaders.append(loader)
        self._hook(is_main, on_shutdown)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._rng is not None and not torch.equal(self._rng, _rng_state()):
            self.random_draws = True  # drawn between the last step and this one: forward, loss, batch
        self.lr = max([self.lr, *(_lr(group) for group in getattr(optimizer, "param_groups", []))])
        grads = self._grads()
        if not self.counts and self.main and grads:
            torch.save(grads, f"{self.out}.grads")
        for name, grad in grads.items():
            peak = self.peaks.get(name)
            self.peaks[name] = grad.abs() if peak is None or peak.shape != grad.shape else peak.maximum(grad.abs())

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.counts[id(optimizer)] = self.counts.get(id(optimizer), 0) + 1
        self._rng = _rng_state()
        if self.max_steps is not None and min(self.counts.values()) >= self.max_steps:
            self.capped = True
            raise StepCap(0)

    def _grads(self) -> dict[str, torch.Tensor]:
        """The gradients of every prepared model, as CPU tensors; on every rank: gathering a sharded gradient
        is collective."""
        return {name: full_cpu(p.grad) for model, _ in self.models for name, p in model.named_parameters()
                if p.grad is not None}

    def _write_facts(self) -> None:
        if not self.main:
            return
        facts = {"models": len(self.models), "batches": sum(int(getattr(ld, "steps_taken", 0)) for ld in self.loaders),
                 "loaders": len(self.loaders), "steps": max(self.counts.values(), default=0), "capped": self.capped,
                 "random_draws": self.random_draws, "lr": self.lr}
        with open(f"{self.out}.json", "w") as f:
            json.dump(facts, f)
        if self.peaks:
            torch.save(self.peaks, f"{self.out}.gradpeak")


def _lr(group: dict) -> float:
    """A param group's learning rate as a float (it may be a tensor, or absent in a custom optimizer)."""
    lr = group.get("lr", 0.0)
    try:
        return float(lr)
    except (TypeError, ValueError):
        return 0.0


def _rng_state() -> torch.Tensor:
    """torch's global generator state (CPU; CUDA's appended when initialised): equal states, no draws."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return torch.cat(states)
