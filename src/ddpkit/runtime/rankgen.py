"""A generator of this rank's, for the noise a training step draws.

A script seeded once at the top (``torch.manual_seed(999)``, DCGAN's ``--manualSeed``) seeds every rank alike,
so every rank draws the same noise each step: a GAN's global batch of fakes is then N copies of B/N draws, not B
distinct ones. ``ddpkit convert`` makes such a draw ``torch.randn(b, nz, generator=ddpkit.rank_generator(device))``:
a generator seeded from the script's own seed and the rank, made once per process and device, so a training
function called every epoch goes on with its stream instead of starting it again. Rank 0's equals a one-process
run's, the streams are reproducible and none replays torch's own (a fixed noise drawn after the seed), and
torch's generator (model inits, the script's other draws) is left as it was. ``ddpkit verify`` matches these
draws between one process and N as it matches torch's own, and a ddpkit checkpoint keeps their states.

Example::

    >>> import torch
    >>> g = rank_generator("cpu")
    >>> g is rank_generator("cpu"), g.initial_seed() == first_seed(torch.initial_seed(), ddpkit_rank())
    (True, True)
    >>> first_seed(999, 0), first_seed(999, 1), first_seed(2**64 - 1, 0)  # torch.seed() draws up to 2**64 - 1
    (1001002, 2001005, 1000002)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.core import process

_MADE: dict[str, torch.Generator] = {}  # device -> this process's generator
_MADE_FOR: dict[str, tuple[int, int, int]] = {}  # device -> (pid, rank, seed) it was made for
OFFSET = 1_000_003  # rank r's stream starts at seed + OFFSET * (r + 1): none replays torch's own stream


def ddpkit_rank() -> int:
    """This process's rank (0 before ``ddpkit.init()`` and in one process)."""
    state = process.current().state
    return int(state.rank) if state is not None else 0


def first_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank``'s stream starts from, for torch's seed ``seed``: ``seed + OFFSET * (rank + 1)``,
    wrapped into 63 bits (``torch.seed()`` draws up to 2**64 - 1, beyond which manual_seed refuses)."""
    return (seed + OFFSET * (rank + 1)) % 2**63


def rank_generator(device: Any = None) -> torch.Generator:
    """This rank's generator on ``device`` (a ``torch.device``, a string, None: the CPU), seeded from torch's seed
    (CUDA's for a CUDA device) and the rank the first time it is asked for; the same object after, in this
    process, at this rank and seed: a worker forked from a notebook that drew already, a call before
    ``ddpkit.init()``, or a new ``torch.manual_seed(s)`` with another seed gets a new one."""
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    key, rank = str(where), ddpkit_rank()
    seed = torch.cuda.initial_seed() if where.type == "cuda" else torch.initial_seed()
    made_for = (os.getpid(), rank, seed)
    if _MADE_FOR.get(key) != made_for:
        _MADE[key] = torch.Generator(device=where).manual_seed(first_seed(seed, rank))
        _MADE_FOR[key] = made_for
    return _MADE[key]


def made() -> Iterator[torch.Generator]:
    """The generators made so far (``ddpkit verify`` watches and reseeds them as it does torch's own)."""
    return iter(list(_MADE.values()))


def states() -> dict[str, torch.Tensor]:
    """This rank's generators' states by device type (``cpu``, ``cuda``: its own device), for a checkpoint: the
    same names on every rank, so they gather."""
    mine = (os.getpid(), ddpkit_rank())
    return {torch.device(key).type: g.get_state() for key, g in _MADE.items() if _MADE_FOR[key][:2] == mine}


def set_state(kind: str, state: torch.Tensor) -> None:
    """The generator of ``kind`` (``cpu``; ``cuda``: this rank's device) set to a saved state (a resume)."""
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"a generator for {kind!r:.20}, expected cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        return  # (saved on GPUs, resumed on a CPU: its draws there are the CPU's)
    rank_generator(kind).set_state(state)


def is_rank_generator(generator: Any) -> bool:
    return any(generator is g for g in _MADE.values())
