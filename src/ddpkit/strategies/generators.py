"""python's, numpy's and torch's CPU generator states as tensors: fsdp's initialisation draws rank 0's on every
rank (one model, not one per seed), and a checkpoint saves every rank's (:mod:`ddpkit.checkpoint.rng`).

Example::

    >>> import torch
    >>> saved = host(); a = torch.rand(1); set_host(saved); bool(torch.rand(1) == a)
    True
"""

from __future__ import annotations

import random
import sys

import torch


def host() -> dict[str, torch.Tensor]:
    """python's, numpy's (when imported) and torch's CPU generator states, as tensors."""
    version, mt, gauss = random.getstate()
    state = {"python_mt": torch.tensor(mt, dtype=torch.int64),
             "python_gauss": torch.tensor([version, gauss is not None, gauss or 0.0], dtype=torch.float64),
             "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        _, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        state["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        state["numpy_rest"] = torch.tensor([pos, has_gauss, cached], dtype=torch.float64)
    return state


def set_host(state: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`host`."""
    version, has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((int(version), tuple(state["python_mt"].tolist()), gauss if has_gauss else None))
    torch.set_rng_state(state["torch"])
    if "numpy_keys" in state and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        pos, has_gauss, cached = state["numpy_rest"].tolist()
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), cached))
