"""``ddpkit verify``'s hooks in each of its runs (the ``verify`` entry point of ``ddpkit.tools``).

:func:`ddpkit.commands.verify.command.run_env` sets ``DDPKIT_TOOL=ddpkit.commands.verify.hooks:from_env`` and the
variables read here; the library calls the :class:`~ddpkit.runtime.instrument.Hooks` methods. What verify
changes, and why:

- the one-process run multiplies the training batch by N (``batch_scale``, not a ``global_batch_size``:
  that is the global batch already);
- both runs drop the last ``len % N`` training samples (padding would repeat samples only the N-process run
  sees);
- both start from the same initial weights: the one-process run writes them, the N-process run loads them,
  so a script need not seed;
- dropout is set to 0 (unless ``--keep-dropout``);
- in the float64 re-run of a FAIL, the model is float64 (:mod:`ddpkit.commands.verify.rounding`);
- in the re-runs that measure what rounding alone makes, the initial weights are perturbed by rounding
  (:mod:`ddpkit.commands.verify.perturbed`);
- in the re-run of a FAIL whose steps drew noise, the draws are matched (:mod:`ddpkit.commands.verify.matched`);
- the :class:`~ddpkit.commands.verify.recorder.Recorder` stops both runs after K optimizer steps, saves the final
  weights and the step-1 gradients.

Example::

    >>> hooks = from_env({"DDPKIT_BATCH_SCALE": "2", "DDPKIT_VERIFY_DROP": "2"})
    >>> hooks.train_batch(16), hooks.uneven("pad"), hooks.multiple()
    (32, 'drop', 2)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.commands.verify import nodropout, perturbed, rounding
from ddpkit.commands.verify.recorder import DRAWS_OFFSET, Recorder, cpu_state, dropout_off
from ddpkit.commands.verify.samples import SampleSeeded
from ddpkit.core import contract
from ddpkit.core.atomic import write_atomically
from ddpkit.runtime.instrument import Hooks, OnShutdown


class VerifyHooks(Hooks):
    def __init__(self, batch_scale: int = 1, drop_multiple: int | None = None, init: str | None = None,
                 keep_dropout: bool = True, recorder: Recorder | None = None, float64: bool = False,
                 perturb: int = 0):
        self.batch_scale, self.drop_multiple, self.init, self.float64 = batch_scale, drop_multiple, init, float64
        self.perturb = perturb  # K > 0: the initial weights perturbed by rounding (:mod:`.perturbed`'s re-runs)
        self.keep_dropout, self.recorder = keep_dropout, recorder
        self.models = 0  # models prepared so far: each one's initial weights are a file of its own (a GAN has two)

    def on_model(self, model: nn.Module, is_main: bool, on_shutdown: OnShutdown) -> None:
        """Dropout off, the recorder's hooks, the same initial weights (keyed ``model0.``, ``model1.`` ... by
        order of preparation, with two or more); the recorder saves the final weights at shutdown."""
        if not self.keep_dropout:
            dropout_off(model)  # modules and the float attributes of attention and RNN layers
            nodropout.watch(model)  # and the probabilities its forward hands to functional dropout and sdpa
        if self.float64:  # the re-run that tells rounding from a defect (before the wrap: DDP's buckets are typed)
            rounding.to_float64(model)
        if self.recorder is not None:
            self.recorder.on_model(model, is_main, on_shutdown)
        if self.init:
            path = f"{self.init}.{self.models}"
            self.models += 1
            if os.path.exists(path):  # the N-process run: start where the one-process run did
                model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                if self.perturb:  # (after the load: the same start, rounded otherwise)
                    perturbed.perturb(model, self.perturb)
            else:
                weights = cpu_state(model)  # on every rank: gathering a sharded (fsdp) model is collective
                if is_main:  # (whole or absent: another run's prepare_model reads it)
                    write_atomically(path, lambda f: torch.save(weights, f))

    def train_batch(self, batch_size: int, given_globally: bool = False) -> int:
        """The one-process run takes N x the per-process batch; a ``global_batch_size`` is one already."""
        return batch_size if given_globally else batch_size * self.batch_scale

    def uneven(self, uneven: str) -> str:
        return "drop" if self.drop_multiple else uneven

    def multiple(self) -> int | None:
        return self.drop_multiple

    def dataset(self, dataset: Any) -> Any:
        """Each sample's own random draws (augmentation) seeded from its index, the same in both runs
        (:mod:`ddpkit.commands.verify.samples`); moved by the run's offset in the re-runs with other draws."""
        if self.recorder is None:
            return dataset
        return SampleSeeded(dataset, DRAWS_OFFSET * self.recorder.draws_k, self.recorder.probe)

    def on_loader(self, loader: Any, rank: int, describe: Callable[[], dict[str, Any]],
                  on_shutdown: OnShutdown) -> None:
        """The recorder counts the loader's batches and caps it until an optimizer steps (see
        :meth:`~ddpkit.commands.verify.recorder.Recorder.on_loader`)."""
        if self.recorder is not None:
            self.recorder.on_loader(loader, rank == 0, on_shutdown, rank)


def from_env(environ: Mapping[str, str]) -> VerifyHooks:
    """The hooks of one verify run, from the variables :func:`ddpkit.commands.verify.command.run_env` set."""
    out = contract.VERIFY_OUT.text(environ)
    return VerifyHooks(batch_scale=contract.BATCH_SCALE.number(environ) or 1,
                       drop_multiple=contract.VERIFY_DROP.number(environ), init=contract.VERIFY_INIT.text(environ),
                       keep_dropout=out is None or contract.KEEP_DROPOUT.flag(environ),
                       recorder=Recorder(out, contract.MAX_STEPS.number(environ),
                                         other_draws=contract.VERIFY_DRAWS.number(environ) or 0,
                                         matched=contract.VERIFY_MATCHED.flag(environ)) if out else None,
                       float64=contract.VERIFY_F64.flag(environ),
                       perturb=contract.VERIFY_PERTURB.number(environ) or 0)
