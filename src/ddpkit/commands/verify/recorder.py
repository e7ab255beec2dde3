"""Inside each run of ``ddpkit verify``: the step cap, what the run did, and the step-1 gradients.

:class:`Recorder` is created by verify's hooks (:mod:`ddpkit.commands.verify.hooks`) in a verify run only. It

- stops the run with a clean ``SystemExit(0)`` right before any optimizer's (K+1)-th step. Each optimizer
  counts its own steps: a GAN's two optimizers, each stepping once an iteration, have both taken K steps
  then, and a warm-up optimizer that stopped early cannot hold the cap off. A loader that simply ran dry at
  the cap broke loops that re-create their iterator (``except StopIteration: it = iter(loader)``); exiting
  does not depend on the loop's shape, and the shutdown hooks still save the weights as they are after K
  steps. Until an optimizer steps, the training loaders are capped at K batches: a hand-written update
  (``q -= lr * q.grad``) fires no step hook, so that is its cap;
- turns off dropout given as a float attribute (``nn.MultiheadAttention(dropout=)``, ``nn.LSTM/GRU(dropout=)``,
  a GPT block's ``self.dropout`` for ``scaled_dot_product_attention``): no Dropout module holds it;
- saves every prepared model's final weights (``model<i>.`` prefixes with two models or more) and writes, on
  rank 0, each model's gradients at its optimizer's first step (``<out>.grads``), each element's largest
  |gradient| over all the steps (``<out>.gradpeak``: :mod:`ddpkit.commands.verify.noise` excuses elements that only
  ever got float noise) and the facts (``<out>.json``, written early with ``finished: false`` so a run that
  ends by ``os._exit`` is told apart from one that prepared nothing): models prepared, training batches
  handed out by ddpkit loaders, optimizer steps, which cap stopped the run, whether a global random generator
  (torch's, Python's ``random``, numpy's) was drawn from between one optimizer step and the next (noise, a
  Dataset's augmentation; not a DataLoader's seed draw at ``iter()``), and which, and the largest learning
  rate any optimizer stepped with.
  ``ddpkit verify`` refuses what it cannot compare and names a FAIL's likely cause from them.

Example (what verify reads back)::

    {"models": 1, "batches": 4, "steps": 3, "capped": true, "cap": "steps", "random_draws": false, "lr": 0.001,
     "finished": true}
"""

from __future__ import annotations

import json
import os
import random
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import default_collate, default_convert

from ddpkit.commands.verify.masked import masked_labels
from ddpkit.commands.verify.matched import MatchedDraws
from ddpkit.commands.verify.samples import SampleSeeded
from ddpkit.data.global_batch import GlobalBatchSampler
from ddpkit.runtime import rankgen

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
        for name in ("dropout", "dropout_p", "attn_dropout_p", "dropout_prob", "attention_dropout", "attn_dropout",
                     "dropout_rate"):
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


def _autocast_dtype(module: nn.Module) -> str | None:
    """The dtype autocast runs this forward in (``bfloat16``), for the module's device type (the CPU and CUDA
    for a module without parameters); None when off. A device autocast does not know (meta) counts as off."""
    first = next(module.parameters(), None)
    for kind in [first.device.type] if first is not None else ["cuda", "cpu"]:
        try:
            if torch.is_autocast_enabled(kind):
                return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")
        except RuntimeError:  # "unknown device type for autocast": meta, a backend without autocast
            continue
    return None


DRAWS_OFFSET = 7919  # added to the seed of the re-run with other draws (any other seed does)


class Recorder:
    """One per verify run (see the module's docstring). Models are keyed by order of preparation: with more
    than one (a GAN's generator and discriminator) every name gets a ``model<i>.`` prefix, so each model's
    weights and step-1 gradients are compared, not only the last one's."""

    def __init__(self, out: str, max_steps: int | None, other_draws: int = 0, matched: bool = False):
        self.out, self.max_steps = out, max_steps
        self.probe = f"{out}.unrepeatable"  # made by SampleSeeded, in this process or a loader worker
        self.match = matched  # the steps' torch draws matched from the first training batch on (matched.py)
        self.matching: MatchedDraws | None = None
        self.matchable = True  # every training loader has a batch size of its own (a step loader's is ddpkit's)
        self.other_draws = other_draws  # K: reseed torch at the first training forward (the same init, other draws)
        self.draws_k = other_draws  # K, kept: each training loader's worker seeds move by K too
        self.loader_workers = False  # a training loader's samples are made in worker processes (unseen draws)
        self.models: list[nn.Module] = []
        self.loaders: list[Any] = []
        # steps per optimizer; weak keys: a new optimizer in a later phase may reuse a dropped one's id()
        self.counts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.steps = 0  # the most steps any optimizer took (also one dropped since)
        self.capped = self.random_draws = False
        self.autocast: str | None = None  # the low-precision dtype a training forward ran under (bfloat16)
        self.main = False
        self._rng: tuple | None = None  # the generators' states at the step's first forward
        self.draw_sources: set[str] = set()  # which generators the steps drew from: torch, numpy, random
        self.first: dict[int, dict[str, torch.Tensor]] = {}  # model index -> its gradients at its first step
        self.peaks: dict[str, torch.Tensor] = {}  # model<i>.name -> largest |gradient| per element so far
        self.lr = 0.0
        self.masked: int | None = None  # a training loader without count= whose samples hold labels of -100 (-1)
        self.optimizers: set[str] = set()  # the classes of the optimizers that stepped
        self.steps_shape: dict[str, int | None] | None = None  # the first step loader's global batch and limits
        self._hooked = False
        self._matching_on = False

    def _hook(self, is_main: bool, on_shutdown: OnShutdown) -> None:
        self.main = self.main or is_main
        if not self._hooked:
            self._hooked = True
            register_optimizer_step_pre_hook(self._before_step)
            register_optimizer_step_post_hook(self._after_step)
            on_shutdown(self._at_shutdown)
        self._write_facts(finished=False)  # a run that ends by os._exit leaves this: prepared, never saved

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        global _ACTIVE
        _ACTIVE = self
        self.models.append(model)
        # a module-level hook, not this recorder's method: torch.save(model) pickles the model's hooks, and a
        # recorder (its loaders' observers, weak references) cannot be pickled
        model.register_forward_pre_hook(_on_forward)
        self._hook(is_main, on_shutdown)

    def on_loader(self, loader: Any, is_main: bool, on_shutdown: OnShutdown, rank: int = 0) -> None:
        """A training loader. Until an optimizer steps, it is capped at K batches: a hand-written update
        (``q -= lr * q.grad``, no torch.optim) fires no step hook, so the batch cap is its only cap."""
        self.matchable = self.matchable and isinstance(getattr(loader, "batch_size", None), int)
        if self.match and self.matching is None and self.matchable:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            self.matching = MatchedDraws(loader.batch_size, rank, world)
        if self.matching is not None and hasattr(loader, "watch_fetch"):
            loader.watch_fetch(self.matching.fetch)  # (a fetch's draws are the samples', not the step's)
        loader.observe(self._on_batch)
        if not self.steps and self.max_steps is not None:  # K batches in all: a script may build one per epoch
            cap = max(0, self.max_steps - self._batches())
            # once an optimizer steps its cap governs (a loop may re-create iterators): the loader runs uncapped
            loader.observe(lambda: self.steps > 0 or loader.steps_taken < cap)
        self.loaders.append(loader)
        if getattr(loader, "num_workers", 0) > 0:
            # draws there are not seen here; a Dataset's (augmentation) are each sample's own in verify's runs
            # (samples.py): only a collate_fn's, or an unindexed dataset's, may still differ between the runs
            seeded = isinstance(getattr(loader, "dataset", None), SampleSeeded)
            custom = getattr(loader, "collate_fn", default_collate) not in (default_collate, default_convert)
            self.loader_workers = self.loader_workers or custom or not seeded
            generator = getattr(loader, "generator", None)
            if self.draws_k and generator is not None:  # the workers' seeds come from it at iter(): other draws
                generator.manual_seed((generator.initial_seed() + DRAWS_OFFSET * self.draws_k) % 2**63)
        if self.masked is None and getattr(loader, "count", None) is None:
            self.masked = masked_labels(loader)
        sampler = getattr(loader, "batch_sampler", None)
        if self.steps_shape is None and isinstance(sampler, GlobalBatchSampler):
            self.steps_shape = {"global_batch": sampler.global_batch, "micro_batch_size": sampler.micro_batch_size,
                                "accumulation_steps": sampler.accumulation_steps}
        self._hook(is_main, on_shutdown)

    def _on_batch(self) -> None:
        """At each training batch handed out (its fetch done: a loader's seed draw at ``iter()`` is behind): the
        draws of the first step count from here, not from its first forward (a GAN draws ``z`` before ``G(z)``: a
        one-step run saw no draw); and in the matched re-run, its draws are matched from here on (what was drawn
        before, the init or a fixed noise, is the script's own)."""
        self._steps_begin()
        if self.matching is not None and self.loaders:  # a pass's short last batch: its draws are its rows
            self.matching.batch = _next_batch(self.loaders[0], self.matching.batch)
        if self.matching is not None and not self._matching_on:
            self._matching_on = True
            self.matching.__enter__()  # for the rest of the run: the step cap or the script's end closes it

    def _steps_begin(self) -> None:
        """The steps' draws count from here (the first training batch, or the first training forward of a loop
        that takes no ddpkit batch); the re-runs with other draws reseed here, once: what was drawn before (the
        init) stays, every draw of the steps changes."""
        if self._rng is None:
            if self.other_draws:
                _reseed(torch.initial_seed() + DRAWS_OFFSET * self.other_draws)
                self.other_draws = 0
            self._rng = _rng_state()

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        # a plain DataLoader draws its base seed from the global generator at iter(), which is no draw of the step
        if torch.is_grad_enabled():
            self._steps_begin()
        if self.autocast is None and torch.is_grad_enabled():
            self.autocast = _autocast_dtype(module)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.max_steps is not None and self.counts.get(optimizer, 0) >= self.max_steps:
            # right before an optimizer's (K+1)-th step: a GAN's two optimizers have each taken K steps, and
            # a warm-up optimizer that stopped early cannot hold the cap off (it counts its own steps)
            self.capped = True
            raise StepCap(0)
        drawn = _drawn(self._rng, _rng_state()) if self._rng is not None else []
        if drawn:  # drawn during the step: forward, loss (noise, random masking), a Dataset's augmentation
            self.random_draws = True
            self.draw_sources.update(drawn)
        self.optimizers.update(c.__name__ for c in type(optimizer).__mro__[:-1])  # a subclass of Adam is Adam
        groups = getattr(optimizer, "param_groups", [])
        self.lr = max([self.lr, *(_lr(group) for group in groups)])
        stepped = {id(p) for group in groups for p in group.get("params", [])}
        for i, model in enumerate(self.models):
            params = dict(model.named_parameters())
            if not any(id(p) in stepped for p in params.values()):
                continue  # another model's optimizer: this model's gradients are not this step's
            grads = {name: full_cpu(p.grad) for name, p in params.items() if p.grad is not None}
            self.first.setdefault(i, grads)  # every rank: gathering a sharded gradient is collective
            for name, grad in grads.items():
                key, peak = f"model{i}.{name}", self.peaks.get(f"model{i}.{name}")
                self.peaks[key] = grad.abs() if peak is None or peak.shape != grad.shape else peak.maximum(grad.abs())

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.counts[optimizer] = self.counts.get(optimizer, 0) + 1
        if self.matching is not None:
            self.matching.next_step()
        self.steps = max(self.steps, self.counts[optimizer])  # > 0: the loaders' batch cap is lifted
        # from one step to the next: a GAN draws its noise before the step's first forward (z = torch.randn(...))
        self._rng = _rng_state()

    def _batches(self) -> int:
        """Training batches handed out by ddpkit loaders so far, all loaders together."""
        return sum(int(getattr(ld, "steps_taken", 0)) for ld in self.loaders)

    def _named(self, per_model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``model<i>.`` prefixes kept with two models or more, dropped with one (names as the script has them)."""
        if len(self.models) > 1:
            return per_model
        return {k.split(".", 1)[1]: v for k, v in per_model.items()}

    def _at_shutdown(self) -> None:
        # on every rank: gathering a sharded (fsdp) model's tensors is collective
        weights = {f"model{i}.{k}": v for i, model in enumerate(self.models) for k, v in cpu_state(model).items()}
        if self.main and self.models:
            torch.save(self._named(weights), self.out)
        self._write_facts(finished=True)

    def cap(self) -> str | None:
        """Which cap stopped the run: ``steps`` (an optimizer's K+1-th step), ``batches`` (no optimizer
        stepped: the loaders' K batches), or None (the script ended by itself)."""
        if self.capped:
            return "steps"
        batches = self._batches()
        return "batches" if not self.steps and self.max_steps and batches >= self.max_steps else None

    def _write_facts(self, finished: bool) -> None:
        if not self.main:
            return
        facts = {"models": len(self.models), "batches": self._batches(),
                 "loaders": len(self.loaders), "steps": self.steps, "capped": self.capped, "cap": self.cap(),
                 "random_draws": self.random_draws, "draw_sources": sorted(self.draw_sources),
                 "loader_workers": self.loader_workers,
                 # a process's first training sample differed fetched twice alike (samples.py: a generator of its own)
                 "unrepeatable": os.path.exists(self.probe),
                 "autocast": self.autocast, "lr": self.lr,
                 "masked_labels": self.masked, "steps_shape": self.steps_shape,
                 "optimizers": sorted(self.optimizers), "finished": finished,
                 "matched_draws": self.matching.matched if self.matching is not None else None,
                 "unmatched_draws": self.matching.unmatched if self.matching is not None else None,
                 "matchable": self.matchable}
        with open(f"{self.out}.json", "w") as f:
            json.dump(facts, f)
        if not finished:
            return
        grads = {f"model{i}.{k}": v for i, per in sorted(self.first.items()) for k, v in per.items()}
        if grads:
            torch.save(self._named(grads), f"{self.out}.grads")
        if self.peaks:
            torch.save(self._named(self.peaks), f"{self.out}.gradpeak")


_ACTIVE: Recorder | None = None  # the recorder of this verify run (one a process)


def _on_forward(module: nn.Module, args: Any) -> None:
    if _ACTIVE is not None:
        _ACTIVE._on_forward(module, args)


def _next_batch(loader: Any, otherwise: int) -> int:
    """The size of the batch a loader is about to hand out: its batch size, or what is left of this rank's part
    of the epoch (a short last batch, which every rank has in proportion: the one-process run's last is N times
    it); ``otherwise`` when the loader does not say."""
    size, sampler = getattr(loader, "batch_size", None), getattr(loader, "sampler", None)
    try:
        total = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return otherwise
    if not isinstance(size, int) or getattr(loader, "drop_last", False):
        return size if isinstance(size, int) else otherwise
    handed = getattr(loader, "_batches", None) or 0
    left = total - handed * size
    return min(size, left) if left > 0 else size


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights; in fsdp mode the model's tensors are shards (DTensor), gathered here."""
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().cpu() for k, v in full.items()}


def _lr(group: dict) -> float:
    """A param group's learning rate as a float (it may be a tensor, or absent in a custom optimizer)."""
    lr = group.get("lr", 0.0)
    try:
        return float(lr)
    except (TypeError, ValueError):
        return 0.0


def _rng_state() -> tuple[torch.Tensor, int, bytes | None]:
    """The global generators' states: torch's (CPU; CUDA's appended when initialised), Python's ``random`` (its
    hash) and numpy's (where the script imported numpy): equal states, no draws."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [s.cpu() for s in torch.cuda.get_rng_state_all()]
    states += [g.get_state().cpu() for g in rankgen.made()]  # (ddpkit.rank_generator's: the step's noise)
    numpy = sys.modules.get("numpy")
    drawn = None
    if numpy is not None:
        _, key, pos, *_ = numpy.random.get_state(legacy=True)
        drawn = key.tobytes() + int(pos).to_bytes(4, "little")
    return torch.cat(states), hash(random.getstate()), drawn


def _drawn(before: tuple, after: tuple) -> list[str]:
    """The generators drawn from between two :func:`_rng_state` looks."""
    names = ("torch", "random", "numpy")
    return [name for name, a, b, in zip(names, before, after)
            if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)]


def _reseed(seed: int) -> None:
    """Every global generator a script's steps may draw from, reseeded (the re-runs with other draws); the seed
    wrapped into 63 bits: a script's ``torch.seed()`` draws up to 2**64 - 1, beyond which manual_seed refuses."""
    seed %= 2**63
    torch.manual_seed(seed)
    for k, generator in enumerate(rankgen.made()):  # (made since: seeded from torch's new seed)
        generator.manual_seed(seed + 7919 * (k + 1))
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
