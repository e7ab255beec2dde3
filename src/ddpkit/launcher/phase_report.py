"""The launcher half of the phase report: the per-rank table in the final summary, and ``phases.json`` kept.

Rank 0 leaves ``phases.json`` in the launch's report folder at its shutdown (:mod:`ddpkit.runtime.phases`); the
launcher on rank 0's node reads it once the workers are done, prints one row per rank and the verdict, and keeps
the report in the run's log folder. The file is read as data (:mod:`ddpkit.runtime.phase_json`: bounded in size,
values, numbers and depth, then checked field by field, its verdict recomputed): whatever it holds, the
launcher prints a table or one warning line.

Example::

    text = summary(report_dir, log_dir)   # None when no rank 0 ran here (another node) or the report is off
    if text: print(text)
"""

from __future__ import annotations

import os

from ddpkit.core import atomic, straggler
from ddpkit.runtime import phase_json

NAME = "phases.json"
MAX_BYTES = phase_json.MAX_REPORT_BYTES  # read no more: a larger file is refused unread


def summary(report_dir: str, log_dir: str) -> str | None:
    """The table for the console, with ``phases.json`` copied into ``log_dir``; None without a report."""
    path = os.path.join(report_dir, NAME)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError:
        return None  # not rank 0's node, --phase-window 0, or rank 0 never reached its shutdown
    try:
        if len(raw) > MAX_BYTES:  # read no further than this: its true size is unknown
            raise straggler.ReportError(f"larger than {MAX_BYTES >> 20} MB")
        report = phase_json.report(raw)
    except straggler.ReportError as exc:
        return f"ddpkit: warning: the phase report {path} is unreadable ({exc}); no per-rank table"
    kept = os.path.join(log_dir, NAME)
    try:
        atomic.write_atomically(kept, lambda f: f.write(straggler.dumps(report).encode()))
    except OSError as exc:
        kept = f"not kept: {exc.strerror}"
    # every console line of the launcher's own starts with "ddpkit:", the table's rows too
    lines = [*straggler.table(report).splitlines(), f"phase report: {kept}"]
    return "\n".join(f"ddpkit: {line}" for line in lines)
