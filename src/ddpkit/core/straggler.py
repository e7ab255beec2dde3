"""Which rank is slow, and in which phase: the verdict over every rank's phase times, and the report format.

Each rank's :class:`~ddpkit.runtime.phases.PhaseClock` sums, per training step, the time spent in each of
:data:`PHASES`; rank 0 gathers the ranks' windows through the group's store and asks :func:`verdict`. The
launcher prints :func:`table` from the report rank 0 leaves (``phases.json``). Torch-free: both sides share it.

A rank is a straggler when one of its own phases (not ``comm``, the waiting) takes at least
:data:`RATIO` times the other ranks' median for that phase, the excess is at least :data:`SHARE` of the
step, and the others wait for it: a slow rank makes every other rank wait, so the others' median ``comm``
exceeds its own by at least :data:`WAITED` of what it loses. When every
rank is slow alike, no rank stands out and there is no straggler (a slow job, not a slow rank).

Example::

    >>> fast = {"data": 1.0, "compute": 10.0, "comm": 30.0, "optimizer": 1.0, "other": 0.0}
    >>> slow = dict(fast, data=31.0, comm=1.0)
    >>> found = verdict([window(0, fast), window(1, fast), window(2, slow)])
    >>> found["rank"], found["phase"], round(found["ratio"], 1)
    (2, 'data', 31.0)
    >>> verdict([window(0, fast), window(1, fast)]) is None
    True
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

# the order a step meets them; "comm" is communication not hidden behind compute (waiting for the peers)
PHASES = ("data", "compute", "comm", "optimizer", "other")
OWN = ("data", "compute", "optimizer", "other")  # what a rank does itself: where a straggler's time goes
WORDS = {"data": "data loading", "compute": "compute (forward + backward)", "comm": "communication wait",
         "optimizer": "the optimizer step", "other": "the rest of the loop"}
RATIO = 1.5  # x the other ranks' median: well above the step-to-step noise of a healthy job (a few %)
SHARE = 0.10  # of the median step: a phase that is 3x of almost nothing slows nobody
WAITED = 0.5  # of the excess: at least this much more waiting on the other ranks than on this one
VERSION = 1
MAX_RANKS = 1 << 16  # a report naming more ranks than this is not one ddpkit wrote


class ReportError(ValueError):
    """A phase report or window that ddpkit did not write (or a truncated one)."""


def window(rank: int, ms: dict[str, float], steps: int = 1, host: str = "", local_rank: int | None = None,
           index: int = 0) -> dict[str, Any]:
    """One rank's window: mean milliseconds per step in each phase over ``steps`` steps."""
    return {"v": VERSION, "rank": rank, "local_rank": rank if local_rank is None else local_rank, "host": host,
            "window": index, "steps": steps, "ms": {p: float(ms.get(p, 0.0)) for p in PHASES}}


def step_ms(win: dict[str, Any]) -> float:
    return sum(win["ms"].values())


def others_medians(values: list[float]) -> list[float]:
    """For each position, the median of the other values: one sort, not one median per rank (a job of 40k
    ranks is judged in well under a second).

    >>> others_medians([1.0, 5.0, 3.0])
    [4.0, 2.0, 3.0]
    """
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[i] for i in order]
    where = [0] * n
    for position, i in enumerate(order):
        where[i] = position

    def nth(j: int, gone: int) -> float:  # the j-th smallest once position ``gone`` is removed
        return ranked[j] if j < gone else ranked[j + 1]

    m = n - 1
    return [nth(m // 2, where[i]) if m % 2 else (nth(m // 2 - 1, where[i]) + nth(m // 2, where[i])) / 2
            for i in range(n)]


def verdict(windows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The straggler among ``windows`` (one per rank, same steps), or None: no rank stands out. A rank that saw
    no step (its loader never fetched) has no times to compare: it is left out."""
    windows = [w for w in windows if w["steps"] > 0]
    if len(windows) < 2:
        return None
    step = statistics.median(step_ms(w) for w in windows)
    medians = {p: others_medians([w["ms"][p] for w in windows]) for p in PHASES}
    best: dict[str, Any] | None = None
    for i, win in enumerate(windows):
        for phase in OWN:
            median = medians[phase][i]
            mine = win["ms"][phase]
            excess = mine - median
            ratio = mine / median if median > 0 else math.inf
            # and waited for: the others spend about what it loses waiting (a rank whose own phase holds a wait
            # that the clock could not separate, or a hiccup that made nobody wait, is no straggler)
            waited = medians["comm"][i] - win["ms"]["comm"] >= WAITED * excess
            if excess >= SHARE * step and ratio >= RATIO and waited and (best is None or excess > best["excess_ms"]):
                best = {"rank": win["rank"], "host": win["host"], "local_rank": win["local_rank"],
                        "phase": phase, "ratio": ratio, "ms": mine, "others_ms": median, "excess_ms": excess,
                        "others_wait_ms": medians["comm"][i],
                        "wait_ms": win["ms"]["comm"], "step_ms": step, "steps": win["steps"]}
    return best


def score(windows: list[dict[str, Any]]) -> float:
    """The largest excess of one rank's own phase over the other ranks' median, as a share of the median step
    (0.0: every rank alike; the verdict names a straggler from :data:`SHARE` on, at :data:`RATIO` or more)."""
    windows = [w for w in windows if w["steps"] > 0]
    if len(windows) < 2:
        return 0.0
    step = statistics.median(step_ms(w) for w in windows) or 1.0
    excess = 0.0
    for p in OWN:
        values = [w["ms"][p] for w in windows]
        excess = max(excess, *(v - m for v, m in zip(values, others_medians(values))))
    return excess / step


def describe(found: dict[str, Any] | None, what: str) -> str:
    """One line for the console. ``what``: the span, e.g. "over the last 200 steps".

    >>> describe(None, "over the run")
    "no straggler over the run: no rank's phase is 1.5x the other ranks' median"
    """
    if found is None:
        return f"no straggler {what}: no rank's phase is {RATIO:g}x the other ranks' median"
    where = f"host {found['host']}, " if found["host"] else ""
    if math.isinf(found["ratio"]):  # the others' median is 0: no ratio to give
        how = f"{found['ms']:.1f} ms/step where the other ranks' median is 0"
    else:
        how = f"{found['ratio']:.1f}x the other ranks' median ({found['ms']:.1f} vs {found['others_ms']:.1f} ms/step)"
    return (f"straggler: rank {found['rank']} ({where}local {found['local_rank']}): {WORDS[found['phase']]} {how} "
            f"{what}; "
            f"the other ranks spend {found['others_wait_ms']:.1f} ms/step waiting in communication "
            f"(this rank {found['wait_ms']:.1f})")


def report(windows: list[dict[str, Any]], missing: list[int], warmup: int = 0) -> dict[str, Any]:
    """The run's report: every rank's totals (as windows over the run, the first ``warmup`` steps left out) and
    the verdict over them."""
    return {"v": VERSION, "ranks": sorted(windows, key=lambda w: w["rank"]), "missing": sorted(missing),
            "warmup": warmup, "straggler": verdict(windows)}


def table(rep: dict[str, Any]) -> str:
    """The launcher's final summary: one row per rank, ms per step in each phase, then the verdict."""
    ranks = rep["ranks"]
    steps = max((w["steps"] for w in ranks), default=0)
    if steps == 0:
        return ("no training steps seen (no ddpkit loader fetch, optimizer step or backward of a prepared model): "
                "no per-rank table")
    after = f" after the first {rep['warmup']} (warm-up: compile, caches; left out)" if rep.get("warmup") else ""
    lines = [f"where each rank's time went (ms per step over {steps} steps{after}; comm = waiting for the peers "
             "after the last gradient):",
             "  rank  host              " + "".join(f"{p:>10}" for p in PHASES) + "      step"]
    for w in ranks:
        lines.append(f"  {w['rank']:>4}  {w['host'][:16]:<16}  " + "".join(f"{w['ms'][p]:>10.1f}" for p in PHASES)
                     + f"{step_ms(w):>10.1f}")
    if idle := [str(w["rank"]) for w in ranks if w["steps"] == 0]:
        lines.append(f"  (rank(s) {', '.join(idle)} saw no training step: left out of the verdict)")
    if rep["missing"]:
        lines.append(f"  (no figures from rank(s) {', '.join(map(str, rep['missing']))}: they did not reach "
                     "their shutdown in time)")
    lines.append(describe(rep["straggler"], "over the run"))
    return "\n".join(lines)


def dumps(obj: dict[str, Any]) -> str:
    """A window or report as compact JSON (what goes through the store and into ``phases.json``)."""
    return json.dumps(obj, separators=(",", ":"))


def parse_window(text: str | bytes) -> dict[str, Any]:
    """A window from a peer (JSON, checked field by field: a peer or a file is not trusted to be ddpkit)."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"not JSON ({exc})") from None
    return _checked_window(raw)


def _checked_window(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise ReportError(f"not a ddpkit phase window of version {VERSION}")
    ms = raw.get("ms")
    if not isinstance(ms, dict) or set(ms) != set(PHASES):
        raise ReportError(f"its 'ms' must hold exactly {', '.join(PHASES)}")
    if not all(_finite(ms[p]) and ms[p] >= 0 for p in PHASES):
        raise ReportError("its phase times must be finite numbers >= 0")
    for key in ("rank", "local_rank", "steps", "window"):
        if not _count(raw.get(key)):
            raise ReportError(f"its {key!r} must be an integer in 0..{MAX_RANKS**2}")
    if not isinstance(raw.get("host"), str) or not raw["host"].isprintable():
        raise ReportError("its 'host' must be a string of printable characters")
    return window(raw["rank"], ms, raw["steps"], raw["host"][:256], raw["local_rank"], raw["window"])


def parse_report(text: str | bytes) -> dict[str, Any]:
    """A ``phases.json`` (the launcher reads what rank 0 wrote; checked: the folder may hold anything)."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("v") != VERSION or not isinstance(raw.get("ranks"), list):
        raise ReportError(f"not a ddpkit phase report of version {VERSION}")
    if len(raw["ranks"]) > MAX_RANKS or not isinstance(raw.get("missing"), list):
        raise ReportError("its 'ranks' / 'missing' are not lists of a job's ranks")
    windows = [_checked_window(w) for w in raw["ranks"]]
    missing, warmup = raw["missing"], raw.get("warmup", 0)
    if len(missing) > MAX_RANKS or not all(_count(r) for r in missing):
        raise ReportError("its 'missing' must list ranks")
    if not _count(warmup):
        raise ReportError(f"its 'warmup' must be an integer in 0..{MAX_RANKS**2}")
    return report(windows, missing, warmup)  # the verdict is recomputed: a file's own claim is not repeated


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RANKS**2
