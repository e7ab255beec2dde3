"""Two runs' final weights compared tensor by tensor: the verdict ``ddpkit verify`` prints.

A tensor fails when a value is out of tolerance or when it holds NaN / inf that the other run does not hold
bitwise (:func:`non_finite`): ``NaN > tol`` is False, so a plain tolerance test would PASS a diverged run.

>>> compare_weights({"w": torch.zeros(2)}, {"w": torch.zeros(2)}, 1e-6, 0)["passed"]
True
"""

from __future__ import annotations

import math

import torch


def compare_weights(reference: dict, candidate: dict, atol: float, rtol: float,
                    labels: tuple[str, str] = ("the reference", "the candidate"), initial: dict | None = None,
                    skip: dict[str, torch.Tensor] | None = None) -> dict:
    """Compare two state dicts; report the first tensor that fails (in state-dict order).

    ``skip``: per tensor, elements left out of the test and of ``max_abs_diff`` (:mod:`ddpkit.commands.verify.noise`);
    ``excused`` counts those of them out of tolerance, ``excused_in`` names their tensors.

    A tensor fails when a value is out of tolerance or when it holds NaN / inf anywhere (see
    :func:`non_finite`), so a PASS means every weight is finite in both. ``max_abs_diff`` is over the
    positions finite in both (a number, never NaN: the JSON stays valid).

    >>> nan = float("nan")
    >>> compare_weights({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, nan])}, 1e-5, 1e-4)["reason"][:75]
    "non-finite values differ in 'w': 2 (the reference) vs nan (the candidate) a"
    """
    missing = sorted(set(reference) ^ set(candidate))
    if missing:
        return {"passed": False, "first_diverging": missing[0], "max_abs_diff": None, "non_finite": False,
                "reason": f"keys differ: {missing[:5]}"}
    first: dict | None = None
    worst, worst_name = 0.0, None
    excused, excused_in, excused_peak = 0, [], 0.0
    for name, ref in reference.items():
        other = candidate[name]
        if ref.shape != other.shape:
            return {"passed": False, "first_diverging": name, "max_abs_diff": None, "non_finite": False,
                    "reason": f"shape {tuple(ref.shape)} vs {tuple(other.shape)}"}
        ref, other = _real(ref), _real(other)
        finite = ref.isfinite() & other.isfinite()
        diff = torch.where(finite, (ref - other).abs(), 0.0)
        skipped = (skip or {}).get(name)
        if skipped is not None:
            out = skipped & (diff > atol + rtol * ref.abs())
            if bool(out.any()):
                excused, excused_peak = excused + int(out.sum()), max(excused_peak, diff[out].max().item())
                excused_in.append(name)
            diff = torch.where(skipped, 0.0, diff)
        peak = diff.max().item() if diff.numel() else 0.0
        if peak > worst:
            worst, worst_name = peak, name
        if first is None:
            # a tensor both runs left as it started (a causal mask of -inf) holds no divergence
            kept = initial is not None and name in initial and _same(ref, other) and _same(ref, _real(initial[name]))
            reason = None if kept else non_finite(name, ref, other, labels)
            if reason:
                first = {"first_diverging": name, "first_max_abs_diff": None, "non_finite": True, "reason": reason}
            elif bool((diff > atol + rtol * ref.abs()).any()):
                first = {"first_diverging": name, "first_max_abs_diff": peak}
    result = {"passed": first is None, "max_abs_diff": worst, "max_abs_diff_at": worst_name,
              "tensors": len(reference), "non_finite": False, "excused": excused, "excused_in": excused_in,
              "excused_max_diff": excused_peak}
    return {**result, **(first or {})}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal everywhere, NaN where the other has NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """float64 values to compare; a complex tensor as its (real, imaginary) pairs (``.double()`` drops the
    imaginary part, NaN included)."""
    return torch.view_as_real(tensor).double() if tensor.is_complex() else tensor.double()


def non_finite(name: str, ref: torch.Tensor, other: torch.Tensor, labels: tuple[str, str]) -> str | None:
    """Why ``name`` fails for holding NaN / inf, or None when both are finite everywhere.

    A non-finite value in one run that the other does not hold bitwise (NaN vs a number, +inf vs -inf) is a
    mismatch: ``NaN > tol`` is False, so a plain tolerance test would PASS a diverged run. The same NaN / inf
    in both is no PASS either: both trainings diverged and there is nothing to compare.

    >>> inf = float("inf")
    >>> non_finite("w", torch.tensor([inf]), torch.tensor([-inf]), ("1 process", "2 processes"))[:77]
    "non-finite values differ in 'w': inf (1 process) vs -inf (2 processes) at [0]"
    """
    bad = ~(ref.isfinite() & other.isfinite())
    if not bool(bad.any()):
        return None
    same = (ref == other) | (ref.isnan() & other.isnan())
    mismatch = bad & ~same
    shown = mismatch if bool(mismatch.any()) else bad
    at = tuple(int(i) for i in torch.unravel_index(shown.flatten().nonzero()[0, 0], ref.shape))
    where = f"at {list(at)} ({int(shown.sum())} of {ref.numel()} values)"
    a, b = ref[at].item(), other[at].item()
    check = "check the learning rate, loss scaling and input data"
    if shown is mismatch:
        return (f"non-finite values differ in {name!r}: {a:g} ({labels[0]}) vs {b:g} ({labels[1]}) {where}; "
                f"a run with NaN / inf weights diverged: {check}, and what depends on the per-process batch")
    return (f"both runs diverged: {name!r} holds {a:g} in both {where}; weights that are not finite cannot be "
            f"compared: {check}")


GRADIENT_SHARE = 1e-3  # step-1 gradients apart by more than this share of a tensor's largest |gradient|: no rounding


def gradients_apart(one: dict, many: dict, share: float = GRADIENT_SHARE) -> dict | None:
    """The first tensor whose step-1 gradients differ by more than ``share`` of its own largest |gradient| (the
    runs start from the same weights and the same global batch: only rounding may part them, ~1e-6 of it), as
    a FAIL's fields; None when every tensor agrees. For runs whose weights moved less than the tolerance (a
    warm-up's tiny learning rate): their weights agree whatever the gradients were.

    >>> g = {"w": torch.tensor([1.0, -2.0])}
    >>> gradients_apart(g, {"w": torch.tensor([1.0, -2.0000001])}) is None
    True
    >>> gradients_apart(g, {"w": g["w"] * 1.04})["reason"][-70:]
    'differ by 0.08 (0.04 of their largest 2; rounding parts them by ~1e-6)'
    """
    # (a tensor whose gradient is nothing, a bias before BatchNorm: ~1e-17, held to the others' scale, not its own)
    floor = 1e-4 * max((_real(g).abs().max().item() for g in one.values() if g.numel()), default=0.0)
    for name, ref in one.items():
        other = many.get(name)
        if other is None or other.shape != ref.shape:
            continue
        ref, other = _real(ref), _real(other)
        scale = ref.abs().max().item() if ref.numel() else 0.0
        gap = (ref - other).abs().max().item() if ref.numel() else 0.0
        if gap > share * max(scale, floor) or not math.isfinite(gap):
            return {"passed": False, "first_diverging": name, "first_max_abs_diff": gap, "gradients_decided": True,
                    "reason": f"the weights moved less than the tolerance, and the step-1 gradients of {name!r} "
                              f"differ by {gap:.3g} ({gap / scale if scale else float('inf'):.2g} of their largest "
                              f"{scale:.3g}; rounding parts them by ~1e-6)"}
    return None


def moved_within(start: dict, final: dict, atol: float, rtol: float, names: set[str]) -> bool:
    """Every trained weight (``names``: those with gradients; BatchNorm's running statistics move at any learning
    rate) ended within the tolerance of where it started: equal final weights then prove nothing."""
    shared = {k: final[k] for k in names if k in final and k in start}
    return bool(shared) and len(shared) == len(names) and \
        compare_weights({k: start[k] for k in shared}, shared, atol, rtol)["passed"]
