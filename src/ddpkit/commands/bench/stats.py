"""The decision rule of ``ddpkit bench``: when a measured setting may be recommended, with its error rate.

Every repetition runs the default and each setting once, interleaved, so a repetition gives one paired
speed-up per setting (default step time / setting step time). A setting is recommended only when its
speed-ups are beyond chance at least ``MIN_GAIN``: a one-sided Wilcoxon signed-rank test of the log
speed-ups against log(MIN_GAIN), at ``ALPHA`` over all settings tried (Bonferroni). The rank test uses the
sizes of the differences, not only their signs (a sign test needs ~1.5x the repetitions for the same power on
this machine's noise), and assumes only independent repetitions whose log speed-ups are symmetric about
their centre: exactly true for a setting that changes nothing (its runs and the default's are exchangeable),
which is the false recommendation the rule guards against.

Repetitions are adaptive, so the test is a *sequential* one: the bench looks after every repetition from the
first to ``last`` and stops a setting once it crossed the boundary. Looking many times would raise the error
rate; :func:`boundary` instead raises the bar (one z threshold for every look) until a setting at the
threshold crosses at *any* look with chance <= ALPHA / settings. Under that null the signed-rank statistics
of all looks are distribution-free, so the threshold comes from 100,000 simulated null sequences (seeded,
5 % below the target to cover the simulation's error). Stopping a setting early because it can no longer
cross (:func:`settled`) only lowers that chance.

Example::

    >>> b = boundary(settings=3, first=2, last=20)       # looks after every repetition, 3 settings
    >>> round(b[2], 2) == round(b[20], 2), round(b[20], 1)
    (True, 2.5)
    >>> crossed([1.2] * 8, b), crossed([1.2] * 9, b)     # 9 repetitions all faster: the fewest that can pass
    (None, 9)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

MIN_GAIN = 1.05  # a setting must be faster than the default by this much, with evidence, to be recommended
ALPHA = 0.05  # chance of recommending a setting that is not MIN_GAIN faster, over all the settings tried
PATHS = 100_000  # simulated null sequences behind each boundary
MARGIN = 0.95  # aim this far below ALPHA / settings: the simulation's error at 100,000 paths is ~2.5 % of it


def signed_rank_z(gains: Sequence[float]) -> float:
    """Standardised Wilcoxon signed-rank statistic of log(gain / MIN_GAIN); large when the gains exceed it.

    >>> round(signed_rank_z([1.2, 1.1, 1.3]), 2), round(signed_rank_z([1.0, 0.9, 1.2]), 2)
    (1.6, -0.53)
    """
    return _z(_w_plus(gains), len(gains))


def _w_plus(gains: Sequence[float]) -> int:
    """The sum of the ranks of |log(gain / MIN_GAIN)| over the gains above MIN_GAIN."""
    d = [math.log(g / MIN_GAIN) for g in gains]
    order = sorted(range(len(d)), key=lambda i: abs(d[i]))
    return sum(rank for rank, i in enumerate(order, 1) if d[i] > 0)


def _z(w: Any, n: int) -> Any:
    """W+ of n repetitions standardised by its null mean and spread (works on floats and tensors)."""
    return (w - n * (n + 1) / 4) / math.sqrt(n * (n + 1) * (2 * n + 1) / 24)


def _most(n: int) -> float:
    """The largest z that n repetitions can give (all faster): what a look at n can reach at best."""
    return float(_z(n * (n + 1) / 2, n))


@functools.lru_cache(maxsize=4)
def _null_z(length: int) -> Any:
    """z of every prefix (1..length) of PATHS null sequences: a (PATHS, length) tensor, seeded."""
    import torch

    d = torch.randn(PATHS, length, generator=torch.Generator().manual_seed(20261201), dtype=torch.float64)
    columns = []
    for n in range(1, length + 1):
        ranks = d[:, :n].abs().argsort(dim=1).argsort(dim=1) + 1
        w = (ranks * (d[:, :n] > 0)).sum(1).double()
        columns.append(_z(w, n))
    return torch.stack(columns, 1)


@functools.lru_cache(maxsize=64)
def _threshold(settings: int, first: int, last: int, alpha: float) -> float:
    z = _null_z(max(last, 20))[:, first - 1:last].max(dim=1).values.sort(descending=True).values
    allowed = int(alpha / settings * MARGIN * PATHS)  # paths allowed to cross at some look
    return float(z[allowed]) + 1e-9  # strictly above the (allowed+1)-th largest: at most `allowed` cross


def boundary(settings: int, first: int, last: int, alpha: float = ALPHA) -> dict[int, float]:
    """The z a setting's signed-rank statistic must reach at each look n in first..last."""
    threshold = _threshold(max(1, settings), first, last, alpha)
    return {n: threshold for n in range(first, last + 1)}


def fewest(needed: dict[int, float]) -> int | None:
    """The fewest repetitions at which a look could pass at all (every repetition faster), or None."""
    return next((n for n in sorted(needed) if _most(n) >= needed[n]), None)


def crossed(gains: Sequence[float], needed: dict[int, float]) -> int | None:
    """The first look at which these paired speed-ups reached the boundary, else None."""
    return next((n for n in sorted(needed) if n <= len(gains) and signed_rank_z(gains[:n]) >= needed[n]), None)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median (order statistics) with coverage >= ``level`` where the
    repetitions allow it, else the widest one, [min, max]; returns (low, high, its coverage).

    >>> median_interval([1.0, 1.1, 0.9])[2], median_interval([float(v) for v in range(10)])[:2]
    (0.75, (1.0, 8.0))
    """
    ordered, n = sorted(values), len(values)
    best = (ordered[0], ordered[-1], 1 - 2 * 0.5 ** n)
    for j in range(1, n // 2 + 1):  # [x_j, x_(n-j+1)] (1-based) covers the median with 1 - 2 P(Bin(n, .5) < j)
        coverage = 1 - 2 * sum(math.comb(n, k) for k in range(j)) / 2 ** n
        if coverage < level:
            break
        best = (ordered[j - 1], ordered[n - j], coverage)
    return best


def settled(gains: Sequence[float], needed: dict[int, float]) -> str | None:
    """Why no more repetitions of this setting are needed, or None while the evidence is still open:
    it crossed the boundary, it can no longer cross it by the last look (even if every later repetition
    were faster than every earlier one), or a 95 % interval of its median speed-up lies wholly below MIN_GAIN.

    >>> needed = boundary(1, 2, 10)
    >>> settled([1.2] * 8, needed), settled([0.9] * 6, needed), settled([1.0, 1.2], needed)
    ('crossed', 'cannot cross', None)
    """
    if crossed(gains, needed):
        return "crossed"
    n, w = len(gains), _w_plus(gains)
    future = {m: z for m, z in needed.items() if m > n}  # none left: undecided, the repetitions ran out
    # at best, later repetitions are all faster and larger than any so far: they add the ranks n+1..m
    if future and all(_z(w + (m * (m + 1) - n * (n + 1)) / 2, m) < z for m, z in future.items()):
        return "cannot cross"
    low, high, level = median_interval(gains)
    if level >= 0.95 and high < MIN_GAIN:
        return "below"
    return None


def proportion_interval(hits: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval for a rate seen ``hits`` times in ``n`` trials, by bisection on the
    binomial tails: used for the A/A false-recommendation rate of make bench.

    >>> [round(x, 3) for x in proportion_interval(0, 20)], [round(x, 3) for x in proportion_interval(1, 20)]
    ([0.0, 0.168], [0.001, 0.249])
    """
    def tail_at_least(k: int, p: float) -> float:
        return sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))

    def solve(f: Any, target: float) -> float:  # f increasing in p on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    half = (1 - level) / 2
    low = 0.0 if hits == 0 else solve(lambda p: tail_at_least(hits, p), half)
    high = 1.0 if hits == n else solve(lambda p: tail_at_least(hits + 1, p), 1 - half)
    return low, high
