"""The hooks of ``ddpkit verify`` and ``ddpkit bench``, kept out of the training path.

:func:`ddpkit.init` reads the tools' variables (:mod:`ddpkit.core.contract`) once and keeps a :class:`Tools`;
``prepare_model`` and ``data_loader`` call its methods, which do nothing in a normal run (:data:`NONE`), so
model.py and data.py never read the environment.

What each tool changes, and why:

- verify: the one-process run multiplies the training batch by N (``batch_scale``, not a
  ``global_batch_size``); both runs stop after K optimizer steps (``max_steps``, :mod:`ddpkit.commands.verify_run`),
  drop the last ``len % N`` training samples (padding would repeat samples only the N-process run sees),
  start from the same initial weights (the one-process run writes them, the other loads them: a script need
  not seed), set dropout to 0 (unless ``--keep-dropout``), save the final weights and the step-1 gradients.
- bench: record batch hand-out times, skip gradient communication for one timing run, override CommConfig.

Example::

    >>> tools = from_env({"DDPKIT_MAX_STEPS": "5", "DDPKIT_BATCH_SCALE": "2"})
    >>> tools.max_steps, tools.batch_scale, NONE.max_steps
    (5, 2, None)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.commands import verify_run
from ddpkit.core import contract, process
from ddpkit.strategies.comm import CommConfig, skip_hook

OnShutdown = Callable[[Callable[[], None]], None]


@dataclasses.dataclass(frozen=True)
class Tools:
    max_steps: int | None = None
    batch_scale: int = 1
    drop_multiple: int | None = None
    verify_init: str | None = None
    keep_dropout: bool = True
    bench_out: str | None = None
    no_comm: bool = False
    comm: dict[str, Any] | None = None
    recorder: verify_run.Recorder | None = None  # verify: step cap, facts and step-1 gradients
    # bench: what each DDP wrap of this process holds (gradient bytes, bucket cap), written with the step times
    wrapped: list[dict[str, int]] = dataclasses.field(default_factory=list)

    # -- model --------------------------------------------------------------------------------------
    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        """Same initial weights, dropout off, final weights saved at shutdown (verify: every prepared model,
        keyed ``model0.``, ``model1.`` ... by order of preparation when there are two or more).

        Called on every rank with the model before wrapping, or, for a meta model in a sharding mode (only
        materialised by the wrap), with the wrapped one: its ``state_dict()`` gathers (collective) and its
        ``load_state_dict`` takes the full weights and keeps this rank's slices.
        """
        if not self.keep_dropout:
            verify_run.dropout_off(model)  # modules and the float attributes of attention and RNN layers
        if self.recorder is not None:
            self.recorder.on_model(model, is_main, on_shutdown)
        if self.verify_init:
            proc = process.current()
            path = f"{self.verify_init}.{proc.models_prepared}"  # one file per prepared model (a GAN has two)
            proc.models_prepared += 1
            if os.path.exists(path):  # the N-process run: start where the one-process run did
                model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            else:
                weights = verify_run.cpu_state(model)  # on every rank: gathering a sharded (fsdp) model is collective
                if is_main:
                    torch.save(weights, path)
        # the recorder saves every prepared model's final weights at shutdown (verify_run.Recorder)

    def comm_config(self, config: CommConfig | None) -> CommConfig | None:
        """The script's CommConfig, with bench's fields on top."""
        if not self.comm:
            return config
        return dataclasses.replace(config, **self.comm) if config else CommConfig(**self.comm)

    def on_ddp(self, wrapped: nn.Module) -> bool:
        """After wrapping in DDP; True when the tool installed its own communication hook."""
        if self.bench_out is not None:  # bench skips the bucket sizes that cannot change this model's buckets
            grads = sum(p.numel() * p.element_size() for p in wrapped.parameters() if p.requires_grad)
            self.wrapped.append({"grad_bytes": grads, "bucket_bytes": int(getattr(wrapped, "bucket_bytes_cap", 0))})
        if self.no_comm:
            wrapped.register_comm_hook(None, skip_hook)  # type: ignore[operator]
        return self.no_comm

    # -- data ---------------------------------------------------------------------------------------
    def train_batch(self, batch_size: int, given_globally: bool = False) -> int:
        """verify's one-process run takes N x the per-process batch; a ``global_batch_size`` is one already."""
        return batch_size if given_globally else batch_size * self.batch_scale

    def uneven(self, uneven: str) -> str:
        return "drop" if self.drop_multiple else uneven

    def on_loader(self, loader: Any, rank: int, describe: Callable[[], dict[str, Any]],
                  on_shutdown: OnShutdown) -> None:
        """A training loader: bench stops it after max_steps and records every batch's hand-out time; verify
        counts its batches and stops the run after max_steps optimizer steps instead (a loader that ran dry
        broke loops that re-create their iterator, see :mod:`ddpkit.commands.verify_run`); it caps the loader at
        max_steps batches only until an optimizer steps (a hand-written update has no step to count)."""
        if self.recorder is not None:
            self.recorder.on_loader(loader, rank == 0, on_shutdown)
            return
        loader.max_steps = self.max_steps
        if self.bench_out is None:
            return
        loader.step_times = []
        path = os.path.join(self.bench_out, f"rank{rank}.json")

        def write() -> None:
            with open(path, "w") as f:
                json.dump({"times": loader.step_times, "ddp": self.wrapped, **describe()}, f)

        on_shutdown(write)


NONE = Tools()


def from_env(environ: Mapping[str, str]) -> Tools:
    """The tools the launching command asked for; :data:`NONE` in a normal run."""
    comm, out = contract.COMM.text(environ), contract.VERIFY_OUT.text(environ)
    max_steps = contract.MAX_STEPS.number(environ)
    return Tools(max_steps=max_steps,
                  batch_scale=contract.BATCH_SCALE.number(environ) or 1,
                  drop_multiple=contract.VERIFY_DROP.number(environ),
                  verify_init=contract.VERIFY_INIT.text(environ),
                  keep_dropout=out is None or contract.KEEP_DROPOUT.flag(environ),
                  bench_out=contract.BENCH_OUT.text(environ), no_comm=contract.BENCH_NO_COMM.flag(environ),
                  comm=json.loads(comm) if comm else None,
                  recorder=verify_run.Recorder(out, max_steps) if out else None)
