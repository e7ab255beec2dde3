"""A generator of this rank's, for the noise a training step draws.

A script seeded once at the top (``torch.manual_seed(999)``, DCGAN's ``--manualSeed``) seeds every rank alike,
so every rank draws the same noise each step: a GAN's global batch of fakes is then N copies of B/N draws, not B
distinct ones. ``ddpkit convert`` makes such a draw ``torch.randn(b, nz, generator=ddpkit.rank_generator(device))``:
a generator seeded from the script's own seed plus the rank, made once per process and device, so a training
function called every epoch goes on with its stream instead of starting it again. Rank 0's equals a one-process
run's, the streams are reproducible, and torch's own generator (model inits, the script's other draws) is left as
it was. ``ddpkit verify`` matches these draws between one process and N as it matches torch's own.

Example::

    >>> import torch
    >>> g = rank_generator("cpu")
    >>> g is rank_generator("cpu"), g.initial_seed() == torch.initial_seed() + ddpkit_rank()
    (True, True)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.core import process

_MADE: dict[str, torch.Generator] = {}  # device -> this process's generator


def ddpkit_rank() -> int:
    """This process's rank (0 before ``ddpkit.init()`` and in one process)."""
    state = process.current().state
    return int(state.rank) if state is not None else 0


def rank_generator(device: Any = None) -> torch.Generator:
    """This rank's generator on ``device`` (a ``torch.device``, a string, None: the CPU), seeded with
    ``torch.initial_seed() + rank`` the first time it is asked for; the same object after."""
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    key = str(where)
    if key not in _MADE:
        _MADE[key] = torch.Generator(device=where).manual_seed(torch.initial_seed() + ddpkit_rank())
    return _MADE[key]


def made() -> Iterator[torch.Generator]:
    """The generators made so far (``ddpkit verify`` watches and reseeds them as it does torch's own)."""
    return iter(list(_MADE.values()))


def is_rank_generator(generator: Any) -> bool:
    return any(generator is g for g in _MADE.values())
