"""What one of verify's runs left in its temporary folder (:mod:`ddpkit.commands.verify.recorder`): its facts,
the prepared models' initial weights, its step-1 gradients; and whether its weights moved at all."""

from __future__ import annotations

import json
import os

import torch


def facts(out: str) -> dict | None:
    """What a run recorded (:mod:`ddpkit.commands.verify.recorder`); None when it never prepared a model or loader."""
    path = f"{out}.json"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# what a forward in train mode moves without any update: BatchNorm's running statistics (a sample drawn after the
# capped loop, an InfoGAN's ``netG(fixed_noise)`` with no ``eval()``), no sign that anything trained
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def unchanged(final: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> bool:
    """No weight moved; BatchNorm's running statistics may have (a forward is no update).

    >>> w, s = torch.zeros(2), torch.zeros(2)
    >>> moved = {"w": w, "bn.running_mean": s + 1}
    >>> unchanged(moved, {"w": w, "bn.running_mean": s}), unchanged({"w": w + 1}, {"w": w})
    (True, False)
    """
    return final.keys() == initial.keys() and all(torch.equal(final[k], initial[k]) or
                                                  k.rsplit(".", 1)[-1] in STATISTICS for k in final)


def initial(path: str, models: int) -> dict[str, torch.Tensor] | None:
    """The prepared models' initial weights (``<path>.<i>``, written by :mod:`ddpkit.commands.verify.hooks`), named as
    the runs save them: ``model<i>.`` prefixes with two models or more."""
    files = [f"{path}.{i}" for i in range(max(models, 1))]
    if not all(os.path.exists(f) for f in files):
        return None
    weights = [torch.load(f, weights_only=True) for f in files]
    if len(weights) == 1:
        return weights[0]
    return {f"model{i}.{k}": v for i, w in enumerate(weights) for k, v in w.items()}


def grads(out: str, kind: str = "grads") -> dict[str, torch.Tensor] | None:
    """A run's step-1 gradients (``grads``) or largest |gradient| per element (``gradpeak``), if it wrote them."""
    path = f"{out}.{kind}"
    return torch.load(path, weights_only=True) if os.path.exists(path) else None
