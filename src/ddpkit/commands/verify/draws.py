"""Random draws in a training step, told from a defect: the re-runs with other draws, and what they decide.

A script that draws random numbers during its training steps (a GAN's noise, a VAE's sampling, random masking)
cannot match one process exactly at N: each rank draws its own numbers for its part of the batch. Such a FAIL
may be only the draws. So the one-process run is repeated twice with other draws (torch's generator reseeded at
the first training forward: the same initial weights, other numbers in every step), and per tensor, the farther
of the two re-runs from the first one-process run is what the draws alone make there (its floor). Every tensor
of the N-process run no farther from the one-process run than :data:`FACTOR` times its floor (more for a tensor of
fewer than :data:`SMALL` elements: :func:`factor`; plus the tolerance): "cannot compare exactly" (exit 5), not
FAIL. One farther: a FAIL that names it. Draws that move no weight in either re-run are no cause at all: the FAIL
stands and its cause is read as if there were none.
A defect smaller than the draws' own spread cannot be seen this way; the line says how to compare exactly.

Example (per tensor: the N-process run's distance, then each re-run's)::

    >>> import torch
    >>> one = {"w": torch.zeros(3)}
    >>> near = measure(one, {"w": torch.full((3,), 0.02)}, [{"w": torch.full((3,), 0.015)}], {}, 1e-5, 1e-4)
    >>> decided(near)[0], decided(measure(one, {"w": torch.ones(3)}, [{"w": torch.full((3,), 0.015)}], {},
    ...                                   1e-5, 1e-4))[0]
    ('cannot compare', 'fail')
"""

from __future__ import annotations

import torch

FACTOR = 3.0  # the re-runs' spread: 12 seeds of the suite's VAE case ended within 1.7x of one re-run's distance
SMALL = 16  # elements: a tensor with fewer is allowed FACTOR x SMALL / n (:func:`factor`)
RERUNS = 2  # one-process re-runs with other draws: the floor is the farther of them, per tensor
EXACTLY = "make the draw optional (a flag of the script: noise, augmentation) and turn it off for verify"


def factor(n: int) -> float:
    """How many times the draws' spread a tensor of ``n`` compared elements may be from the one-process run. The
    distance of a few elements swings far more from one draw to another than that of many (a 1-element bias
    ended 7.8x its spread in a correct run, about as often as a ratio of two normals passes that): small tensors
    get room in proportion, from :data:`SMALL` elements down.

    >>> factor(1000), factor(8), factor(1)
    (3.0, 6.0, 48.0)
    """
    return FACTOR * max(1.0, SMALL / max(n, 1))


def worth_rerun(result: dict) -> bool:
    """A FAIL of finite weights where the steps drew random numbers, or may have where verify cannot see it (a
    training loader's worker processes: a Dataset's augmentation draws there, seeded per rank)."""
    return not result["passed"] and not result["non_finite"] and bool(
        result.get("random_draws") or result.get("loader_workers") or result.get("unrepeatable")) and \
        result.get("max_abs_diff") is not None


def named(sources: list[str], workers: bool, unrepeatable: bool = False) -> str:
    """Where the draws came from, as the line says it.

    >>> named(["random", "torch"], True)
    "torch's generator, Python's random, and the loader's worker processes (a Dataset's augmentation)"
    """
    names = {"torch": "torch's generator", "random": "Python's random", "numpy": "numpy's generator"}
    said = [names[s] for s in ("torch", "random", "numpy") if s in sources]
    if workers:
        said.append("the loader's worker processes (a Dataset's augmentation)")
    if unrepeatable:
        said.append("a Dataset whose sample differs when fetched twice with every generator seeded (an augmentation "
                    "drawing from a generator of its own, such as albumentations' Compose without seed=)")
    return ", ".join(said[:-1]) + (", and " if len(said) > 2 else " and ") + said[-1] if len(said) > 1 else \
        (said[0] if said else "")


def _distance(a: torch.Tensor, b: torch.Tensor, skip: torch.Tensor | None) -> float:
    """The L2 distance over the elements compared (steadier than the largest one: a tensor's largest gap between
    two runs of independent noise swung 0.1x-3x from one seed to another, its L2 distance far less)."""
    gap = a.double() - b.double()
    if skip is not None and skip.shape == gap.shape:
        gap = gap.masked_fill(skip, 0.0)
    return float(gap.norm()) if gap.numel() else 0.0


def measure(one: dict, many: dict, others: list[dict], skip: dict, atol: float, rtol: float) -> dict:
    """Per tensor, the N-process run's distance from the one-process run against the draws' own spread (the
    farthest apart of the one-process run and its re-runs, every pair): the tensor most beyond :data:`FACTOR`
    times it (None: none is), the largest spread, whether any draw reached a weight."""
    worst, floor, reached = None, 0.0, False
    runs = [one, *others]
    for name, ref in one.items():
        if name not in many or not ref.is_floating_point() or any(name not in o for o in others):
            continue
        mask = skip.get(name)
        gap = _distance(ref, many[name], mask)
        spread = max(_distance(a[name], b[name], mask) for i, a in enumerate(runs) for b in runs[i + 1:])
        floor, reached = max(floor, spread), reached or spread > 0
        tolerance = (atol + rtol * (float(ref.abs().max()) if ref.numel() else 0.0)) * ref.numel() ** 0.5
        allowed = factor(ref.numel() - (int(mask.sum()) if mask is not None and mask.shape == ref.shape else 0)) \
            * spread + tolerance
        if gap > allowed and (worst is None or gap - allowed > worst[3]):
            worst = (name, gap, spread, gap - allowed)
    return {"worst": None if worst is None else list(worst[:3]), "floor": floor, "reached": reached}


def decided(measured: dict) -> tuple[str, str]:
    """(``cannot compare`` or ``fail``, the line) from :func:`measure`'s answer."""
    worst, floor = measured["worst"], measured["floor"]
    whence = f"; from {measured['sources']}" if measured.get("sources") else ""
    if worst is None:
        return "cannot compare", (
            f"cannot compare exactly: random draws during the training steps (noise, sampling, masking, "
            f"augmentation{whence}) differ "
            f"between 1 process and N by design, and every tensor is within {FACTOR:g}x of what other draws make "
            f"in it (two one-process re-runs with other draws moved a tensor by up to {floor:.3g}, L2). To compare "
            f"exactly, {EXACTLY}")
    name, gap, spread = worst
    beyond = f"{gap / spread:.3g}x what other random draws make there ({spread:.3g}; L2 distances)" if spread else \
        "and other random draws do not move it at all"
    return "fail", (f"{name!r} differs by {gap:.3g}, {beyond}; decided by two one-process re-runs with other draws: "
                    f"beyond the draws, rank-dependent code (a branch on the rank, a loss or scale that depends on the "
                    f"per-process batch, per-rank statistics)")
