"""The decision rule of ``ddpkit bench``: when a measured setting may be recommended, with its error rate.

Every repetition runs the default and each setting once, interleaved, so a repetition gives one paired
speed-up per setting (default step time / setting step time). A setting is recommended only when the number
of repetitions in which it was at least ``MIN_GAIN`` faster is too large to be chance: a one-sided sign test
of "median speed-up <= MIN_GAIN", at ``ALPHA`` over all settings tried (Bonferroni). The sign test assumes
nothing about the noise (a shared 2-core box swings by +-30 %, with outliers), only that repetitions are
independent.

Repetitions are adaptive, so the test is a *sequential* one: the bench looks after every repetition from the
first to ``last`` and stops a setting once it crossed the boundary. Looking many times would raise the error
rate; :func:`boundary` instead chooses the wins needed at each look so that a setting at the threshold (each
repetition a fair coin) crosses at *any* look with chance <= ALPHA / settings, computed exactly. Stopping a
setting early because it can no longer win (:func:`settled`) only lowers that chance.

Example::

    >>> boundary(settings=1, first=6, last=6)           # one look: the plain sign test at 5 %
    {6: 6}
    >>> b = boundary(settings=3, first=2, last=20)       # looks after every repetition, 3 settings
    >>> b[2], b[8], b[20]                                # two repetitions can never recommend
    (3, 8, 16)
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from typing import Any

MIN_GAIN = 1.05  # a setting must be faster than the default by this much, with evidence, to be recommended
ALPHA = 0.05  # chance of recommending a setting that is not MIN_GAIN faster, over all the settings tried


def sign_test(wins: int, reps: int) -> float:
    """One-sided sign test: the chance of ``wins`` or more of ``reps`` paired repetitions beating the threshold
    when the setting's true median speed-up is at or below it (each repetition a coin flip at worst).

    >>> sign_test(2, 2), round(sign_test(6, 6), 4), round(sign_test(8, 9), 4)
    (0.25, 0.0156, 0.0195)
    """
    return sum(math.comb(reps, k) for k in range(wins, reps + 1)) / 2 ** reps


def crossing(needed: dict[int, int]) -> float:
    """Chance that a fair-coin sequence of wins reaches ``needed[n]`` wins at some look n (exact, by dynamic
    programming over the win count of the paths that have not crossed yet).

    >>> crossing({2: 2}), crossing({1: 1, 2: 2})
    (0.25, 0.5)
    """
    alive, crossed = {0: 1.0}, 0.0
    for n in range(1, max(needed) + 1):
        step: dict[int, float] = {}
        for wins, p in alive.items():
            step[wins] = step.get(wins, 0.0) + p / 2
            step[wins + 1] = step.get(wins + 1, 0.0) + p / 2
        if n in needed:
            crossed += sum(p for wins, p in step.items() if wins >= needed[n])
            step = {wins: p for wins, p in step.items() if wins < needed[n]}
        alive = step
    return crossed


@functools.lru_cache(maxsize=64)
def _boundary(settings: int, first: int, last: int, alpha: float) -> tuple[tuple[int, int], ...]:
    looks = range(first, last + 1)
    levels = sorted({sign_test(w, n) for n in looks for w in range(n + 1)})
    best = {n: n + 1 for n in looks}  # n + 1 wins: never
    for level in levels:  # the crossing chance only grows with the per-look level: keep the last one that fits
        needed = {n: next((w for w in range(n + 1) if sign_test(w, n) <= level), n + 1) for n in looks}
        if crossing(needed) > alpha / settings:
            break
        best = needed
    return tuple(best.items())


def boundary(settings: int, first: int, last: int, alpha: float = ALPHA) -> dict[int, int]:
    """Wins (of n repetitions at least MIN_GAIN faster) a setting needs at each look n in first..last."""
    return dict(_boundary(max(1, settings), first, last, alpha))


def crossed(gains: Sequence[float], needed: dict[int, int]) -> int | None:
    """The first look at which these paired speed-ups had the wins needed, else None."""
    wins = 0
    for n, gain in enumerate(gains, 1):
        wins += gain >= MIN_GAIN
        if n in needed and wins >= needed[n]:
            return n
    return None


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


def settled(gains: Sequence[float], needed: dict[int, int]) -> str | None:
    """Why no more repetitions of this setting are needed, or None while the evidence is still open:
    it crossed the boundary, it can no longer cross it by the last look, or a 95 % interval of its median
    speed-up lies wholly below MIN_GAIN.

    >>> needed = boundary(1, 2, 10)
    >>> settled([1.2] * 8, needed), settled([0.9] * 4, needed), settled([1.0, 1.2], needed)
    ('crossed', 'cannot cross', None)
    """
    if crossed(gains, needed):
        return "crossed"
    n, wins = len(gains), sum(g >= MIN_GAIN for g in gains)
    future = {m: w for m, w in needed.items() if m > n}  # none left: undecided, the repetitions ran out
    if future and all(wins + (m - n) < w for m, w in future.items()):
        return "cannot cross"
    low, high, level = median_interval(gains)
    if level >= 0.95 and high < MIN_GAIN:
        return "below"
    return None


def summary(values: Sequence[float]) -> dict[str, float | list[float]]:
    """Median, the interval of :func:`median_interval` and its coverage, as JSON fields."""
    low, high, level = median_interval(values)
    return {"median": statistics.median(values), "ci95": [low, high], "ci_level": level}


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
