"""``ddpkit bench``'s second communication figure: the phase report of its default timing runs (issue 29).

Every timing run goes through ``ddpkit launch`` with the phase report turned on (off by default; the bench sets
``DDPKIT_PHASE_WINDOW=200`` unless the environment gives another): rank 0 leaves
``phases.json`` (every rank's ms per step in data, compute, comm, optimizer, other) in the run's log folder.
From the default runs at the largest process count, the bench takes the *slowest rank's* ``comm / step``: the
rank the others wait for waits for no peer itself, so its ``comm`` is the communication no compute hid, the
part of the step the same run with communication skipped saves. A faster rank's ``comm`` also holds its wait
for the slowest one. The report's means leave its first window (200 steps, warm-up) out once a run is past it.

Example::

    >>> figures = phase_figures([{"share": 0.1, "rank": 1, "steps": 9}, {"share": 0.3, "rank": 0, "steps": 9}])
    >>> figures["phase_comm_share"], figures["phase_comm_share_ci95"], figures["phase_comm_ranks"]
    (0.2, [0.1, 0.3], [1, 0])
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from ddpkit.commands.bench.stats import median_interval
from ddpkit.core import straggler

MAX_BYTES = 1 << 20  # a report is ~200 bytes a rank


def phase_comm(report_dir: str) -> dict[str, Any] | None:
    """The slowest rank's (most time of its own: step - comm) comm / step from ``report_dir/phases.json``,
    with that rank and its step count; None without a readable report (``--phase-window 0``, or rank 0 never
    reached its shutdown).

    >>> phase_comm("/nonexistent") is None
    True
    """
    try:
        with open(os.path.join(report_dir, "phases.json"), "rb") as f:
            ranks = straggler.parse_report(f.read(MAX_BYTES))["ranks"]
    except (OSError, straggler.ReportError):
        return None
    slowest = max(ranks, key=lambda w: straggler.step_ms(w) - w["ms"]["comm"], default=None)
    if slowest is None or straggler.step_ms(slowest) <= 0:
        return None
    return {"share": slowest["ms"]["comm"] / straggler.step_ms(slowest), "rank": slowest["rank"],
            "steps": slowest["steps"]}


def phase_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median share over the default runs that left a report, its interval, and each run's slowest rank
    (nothing when no run left one)."""
    if not runs:
        return {}
    shares = [r["share"] for r in runs]
    return {"phase_comm_share": statistics.median(shares), "phase_comm_share_ci95": list(median_interval(shares)[:2]),
            "phase_comm_ranks": [r["rank"] for r in runs]}


def phase_line(result: dict[str, Any]) -> str:
    """The report's line for it (or why there is none).

    >>> phase_line({"rows": [{"nproc": 2}], "phase_comm_share": 0.08, "phase_comm_share_ci95": [0.07, 0.1]})[:60]
    'communication wait: 8% of the step at 2 processes on the slo'
    """
    if "phase_comm_share" not in result:
        return ("communication wait: no phase report from the default runs (DDPKIT_PHASE_WINDOW=0 turns it off, "
                "or rank 0 did not reach its shutdown)")
    low, high = result["phase_comm_share_ci95"]
    return (f"communication wait: {result['phase_comm_share']:.0%} of the step at {result['rows'][-1]['nproc']} "
            f"processes on the slowest rank ({low:.0%}-{high:.0%}; the default runs' phase report: blocked in the "
            "all-reduce after the last gradient, warm-up steps included)")
