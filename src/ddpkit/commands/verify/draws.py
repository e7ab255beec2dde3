"""Random draws in a training step, told from a defect: the re-run with other draws, and what it decides.

A script that draws random numbers inside its training steps (a GAN's noise, a VAE's sampling, random masking)
cannot match one process exactly at N: each rank draws its own numbers for its part of the batch. Such a FAIL
may be only the draws. So the one-process run is repeated with other draws (torch's generator reseeded at the
first training forward: the same initial weights, other numbers in every step), and its distance from the first
one-process run is what the draws alone make. The N-process run is no farther from the one-process run than
:data:`FACTOR` times that: "cannot compare exactly" (exit 5), not FAIL. Farther: a FAIL beyond what the draws make.
A defect smaller than the draws' own spread cannot be seen this way; the line says how to compare exactly.

Example::

    >>> decided({"max_abs_diff": 0.02, "draws_floor": 0.015})[0]
    'cannot compare'
    >>> verdict, line = decided({"max_abs_diff": 0.9, "draws_floor": 0.015}); verdict, line[:60]
    ('fail', 'the runs differ by 0.9, 60x what other random draws make (0.')
"""

from __future__ import annotations

FACTOR = 3.0  # two independent draws' runs differ by about the same: a margin over the spread of that distance
EXACTLY = ("make the draw optional (a flag of the script) and turn it off for verify, or fix its generator's seed "
           "per step the same on every rank")


def worth_rerun(result: dict) -> bool:
    """A FAIL of finite weights where the steps drew random numbers."""
    return not result["passed"] and not result["non_finite"] and bool(result.get("random_draws")) \
        and result.get("max_abs_diff") is not None


def decided(result: dict) -> tuple[str, str]:
    """(``cannot compare`` or ``fail``, the line) from the FAIL's ``max_abs_diff`` and ``draws_floor``: the
    distance between the one-process run and its re-run with other draws (None: the re-run failed)."""
    diff, floor = result["max_abs_diff"], result.get("draws_floor")
    if floor is None:
        return "fail", result.get("cause") or ""
    if floor == 0:
        return "fail", (f"the runs differ by {diff:.3g}, and other random draws change nothing (the draws do not "
                        f"reach the weights compared): {result.get('cause') or 'rank-dependent code'}")
    if diff <= FACTOR * floor:
        return "cannot compare", (
            f"cannot compare exactly: random draws during the training steps (noise, sampling, masking) differ "
            f"between 1 process and N by design; the runs differ by {diff:.3g}, and two one-process runs "
            f"with other draws differ by {floor:.3g} (decided by that re-run): within what the draws make. To "
            f"compare exactly, {EXACTLY}")
    return "fail", (f"the runs differ by {diff:.3g}, {diff / floor:.3g}x what other random draws make ({floor:.3g}; "
                    f"decided by a one-process re-run with other draws): beyond the draws, rank-dependent code (a "
                    f"branch on the rank, a loss or scale that depends on the per-process batch, per-rank "
                    f"statistics)")
