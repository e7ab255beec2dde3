"""How the phase clocks of a job exchange their windows and totals: JSON through the group's store, never a
collective, and a bounded number of requests and keys whatever the world size or the run's length.

Each rank writes its window ``i`` under one of two keys of its own (``i % 2``): the next window but one overwrites
it, so nothing is ever deleted and the store holds at most two windows a rank. Rank 0 reads window ``i - 1`` of
every rank with one existence check and one multi-get (two requests a window); a slot that still holds an older
window means that rank is not there yet. At shutdown every rank writes its totals, which rank 0 waits for.
What a peer wrote is read through :mod:`ddpkit.runtime.phase_json` (bounded, then checked field by field): a
crafted window is skipped with one line, crafted totals count their rank as missing.

Example (a store of one process)::

    >>> import torch.distributed as dist
    >>> store = dist.HashStore()
    >>> put(store, key("p/", 0, 0), straggler.window(0, {"data": 1.0}, index=0))
    >>> [w["ms"]["data"] for w in gather(store, "p/", 0, world_size=1)]
    [1.0]
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

from ddpkit.core import straggler
from ddpkit.runtime import phase_json


def key(prefix: str, index: int, rank: int) -> str:
    """Rank ``rank``'s slot for its window ``index``: two slots a rank, used in turn."""
    return f"{prefix}{index % 2}/{rank}"


def put(store: Any, where: str, win: dict[str, Any]) -> None:
    try:
        store.set(where, straggler.dumps(win))
    except RuntimeError:  # the store's host is gone: the run is ending anyway, and the report is no reason to fail
        pass


def gather(store: Any, prefix: str, index: int, world_size: int) -> list[dict[str, Any]]:
    """Every rank's window ``index`` once all are in the store (not all there yet: [])."""
    if index < 0:
        return []
    keys = [key(prefix, index, r) for r in range(world_size)]
    try:
        if not store.check(keys):
            return []
        found = [phase_json.window(raw) for raw in store.multi_get(keys)]
    except (RuntimeError, straggler.ReportError) as exc:
        print(f"ddpkit: warning: phase report: window {index} unreadable ({exc}); skipped", file=sys.stderr,
              flush=True)
        return []
    return found if all(w["window"] == index for w in found) else []  # a slot still holds window index - 2


def final_totals(store: Any, prefix: str, mine: dict[str, Any], world_size: int,
                 wait_s: float) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank's totals (rank 0's own is ``mine``), waiting at most ``wait_s`` for them; and the ranks missing."""
    keys = {r: f"{prefix}total/{r}" for r in range(world_size) if r != mine["rank"]}
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=wait_s))
    except RuntimeError:  # a rank is late or gone: report the ones there
        pass
    windows, missing = [mine], list[int]()
    for rank, where in keys.items():
        try:
            if store.check([where]):
                windows.append(phase_json.window(store.get(where)))
                continue
        except (RuntimeError, straggler.ReportError):
            pass
        missing.append(rank)
    return windows, missing
