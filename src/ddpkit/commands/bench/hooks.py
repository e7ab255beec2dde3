"""``ddpkit bench``'s hooks in each timing run (the ``bench`` entry point of ``ddpkit.tools``).

:func:`ddpkit.commands.bench.command.run_once` sets ``DDPKIT_TOOL=ddpkit.commands.bench.hooks:from_env`` and the
variables read here. Each training loader stops after K batches (``DDPKIT_MAX_STEPS``) and records when it hands out
each batch; at shutdown every rank writes ``<out>/rank<r>.json``:
``{"times", "ddp", "global_batch", "mode", "device"}``, where ``ddp`` lists what each DDP wrap holds (gradient bytes,
bucket cap: bench skips the bucket sizes that cannot change this model's buckets). One timing run skips gradient
communication (``DDPKIT_BENCH_NO_COMM``), the candidate settings override CommConfig fields (``DDPKIT_COMM``).

Example::

    >>> hooks = from_env({"DDPKIT_MAX_STEPS": "9", "DDPKIT_COMM": '{"bucket_mb": 5}'})
    >>> hooks.max_steps, hooks.comm_config(None).bucket_mb
    (9, 5)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ddpkit.core import contract
from ddpkit.runtime.instrument import Hooks, OnShutdown
from ddpkit.strategies.comm import CommConfig, skip_hook


class BenchHooks(Hooks):
    def __init__(self, out: str | None = None, max_steps: int | None = None, no_comm: bool = False,
                 comm: dict[str, Any] | None = None):
        self.out, self.max_steps, self.no_comm, self.comm = out, max_steps, no_comm, comm
        self.wrapped: list[dict[str, int]] = []  # one entry per DDP wrap of this process

    def comm_config(self, config: CommConfig | None) -> CommConfig | None:
        """The script's CommConfig, with the candidate setting's fields on top."""
        if not self.comm:
            return config
        return dataclasses.replace(config, **self.comm) if config else CommConfig(**self.comm)

    def on_ddp(self, wrapped: nn.Module) -> bool:
        if self.out is not None:
            grads = sum(p.numel() * p.element_size() for p in wrapped.parameters() if p.requires_grad)
            self.wrapped.append({"grad_bytes": grads, "bucket_bytes": int(getattr(wrapped, "bucket_bytes_cap", 0))})
        if self.no_comm:
            wrapped.register_comm_hook(None, skip_hook)  # type: ignore[operator]
        return self.no_comm

    def on_loader(self, loader: Any, rank: int, describe: Callable[[], dict[str, Any]],
                  on_shutdown: OnShutdown) -> None:
        """Stop ``loader`` after ``max_steps`` batches in all (its passes together) and time each hand-out."""
        times: list[float] = []

        def handed_out() -> bool:
            if self.max_steps is not None and len(times) >= self.max_steps:
                return False  # the cap: this batch is not handed out, the pass ends
            times.append(time.perf_counter())
            return True

        loader.observe(handed_out)
        if self.out is None:
            return
        path = os.path.join(self.out, f"rank{rank}.json")

        def write() -> None:
            with open(path, "w") as f:
                json.dump({"times": times, "ddp": self.wrapped, **describe()}, f)

        on_shutdown(write)


def from_env(environ: Mapping[str, str]) -> BenchHooks:
    """The hooks of one timing run, from the variables :func:`ddpkit.commands.bench.command.run_once` set."""
    return BenchHooks(out=contract.BENCH_OUT.text(environ), max_steps=contract.MAX_STEPS.number(environ),
                      no_comm=contract.BENCH_NO_COMM.flag(environ), comm=_comm_fields(contract.COMM.text(environ)))


def _comm_fields(text: str | None) -> dict[str, Any] | None:
    """DDPKIT_COMM's CommConfig fields, checked here: a bad value is one line naming the variable, at init.

    >>> _comm_fields('{"bucket_mb": 5}'), _comm_fields(None)
    ({'bucket_mb': 5}, None)
    """
    if not text:
        return None
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not an object")
        CommConfig(**fields)  # unknown fields and bad values fail now, not at the first DDP wrap
    except (ValueError, TypeError) as exc:
        raise contract.ContractError(f"{contract.COMM.name}={text!r} is not a JSON object of CommConfig fields "
                                     f"({exc}); pass e.g. '{{\"bucket_mb\": 25}}' or unset it") from None
    return fields
