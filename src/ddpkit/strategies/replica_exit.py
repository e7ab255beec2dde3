"""The replicas' last check when the ranks cannot meet in a collective at the end: they ended more than the exit
wait apart (rank 0 writing a last checkpoint alone), or the script destroyed its group itself
(``dist.destroy_process_group()``, what most DDP scripts end with).

Each rank posts its fingerprints (per model: its replica group's ranks, its tensors' names and per-tensor sums, its
optimizer steps since the last check that agreed) to the job's store, which outlives the group; a rank that finds
every rank's post compares every replica group of every model (the last to post always does). What differs is
named as a check in training names it (:mod:`ddpkit.strategies.replicas`), but the cause only where the step
counts tell it: the tensors themselves do not travel through the store.

Example (two ranks' posts of one model, rank 1's first tensor changed)::

    >>> mine = {"agreed": 12, "seen": 40, "steps": 28, "sums": [5, 7], "ranks": [0, 1],
    ...         "names": ["0.weight", "0.bias"], "nonfinite": -1}
    >>> line = differing([mine, dict(mine, sums=[6, 7])], APART)
    >>> line[:80]
    'replicas out of sync at step 41 (equal at step 12): rank 1 differs from rank 0 ('
    >>> line[line.index(" in '"):][:71]
    " in '0.weight': cause not told (the ranks ended more than 5 s apart: co"
"""

from __future__ import annotations

import json
import os
from typing import Any

from ddpkit.strategies import replica_repair, replicas
from ddpkit.strategies.consistency import diverged_line

APART = "the ranks ended more than 5 s apart"
DESTROYED = "the script destroyed its process group itself"
# bytes of one rank's post: ~60 a tensor (its name, its sum), so about 500k tensors over all the models it holds
MAX_POST = 32 << 20
_INT64 = (-(1 << 63), 1 << 63)
_FIELDS = {"agreed": int, "seen": int, "steps": int, "nonfinite": int, "sums": list, "ranks": list, "names": list}


def _held() -> list[replicas.Replicas]:
    """The checked models this process made and still holds, in the order the script made them."""
    return sorted((r for r in list(replicas._LIVE) if r.pid == os.getpid() and r.every > 0 and r.tensors),
                  key=lambda r: r.serial)[:replicas._MAX_MODELS]


def post(rank: int) -> str:
    """This rank's fingerprints of every model it holds, as JSON (one read of the weights, where they are)."""
    out = {}
    for r in _held():
        own = r.ranks.index(rank) if rank in r.ranks else 0
        since = r.optimizer_steps - (r.baseline[own] if len(r.baseline) > own else 0)
        bad = -1
        if not r.auto:  # asked for by the script: NaN / inf on every rank is said too, as a check in training does
            bad = next((i for i, t in enumerate(r.tensors) if not bool(t.isfinite().all())), -1)
        out[str(r.serial)] = {"agreed": r.agreed, "seen": r.seen, "steps": since, "nonfinite": bad,
                              "ranks": list(r.ranks), "names": list(r.names),
                              "sums": [int(s) for s in replicas._fingerprint(r.tensors).tolist()]}
    return json.dumps(out)


def parse(raw: bytes, world: int) -> dict[str, dict[str, Any]]:
    """A peer's :func:`post`; ValueError (one line) when it is not one a rank of this job wrote."""
    if len(raw) > MAX_POST:
        raise ValueError(f"a post of {len(raw)} bytes, over {MAX_POST >> 20} MB")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("a post that is not JSON") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) and _valid(v, world) for v in value.values()):
        raise ValueError("a post whose fields are not those of a fingerprint")
    return value


def _valid(entry: dict[str, Any], world: int) -> bool:
    if any(type(entry.get(k)) is not t for k, t in _FIELDS.items()):
        return False
    numbers = [entry[k] for k in ("agreed", "seen", "steps", "nonfinite")] + entry["sums"] + entry["ranks"]
    return all(type(n) is int and _INT64[0] <= n < _INT64[1] for n in numbers) and \
        all(type(r) is int and 0 <= r < world for r in entry["ranks"]) and \
        all(type(n) is str and len(n) <= 1000 for n in entry["names"]) and len(entry["names"]) == len(entry["sums"])


def compare(raws: list[bytes | None], apart: str = APART) -> str | None:
    """The line for replicas that differ at the end, from every rank's post (``raws[rank]``): every replica group
    of every model; None when they agree, or when a post is missing (a rank that posts later compares).
    ValueError (one line) for a post no rank of this job wrote. ``apart``: why there was no collective."""
    if any(raw is None for raw in raws):
        return None
    posts = []
    for rank, raw in enumerate(raws):
        try:
            posts.append(parse(raw or b"", len(raws)))
        except ValueError as exc:
            raise ValueError(f"rank {rank}'s fingerprints: {exc}") from None
    for key in sorted({k for p in posts for k in p}, key=lambda k: (len(k), k))[:replicas._MAX_MODELS]:
        groups = {tuple(p[key]["ranks"]) for p in posts if key in p}
        for group in sorted(groups):
            entries = [posts[r].get(key) for r in group]
            if any(e is None or tuple(e["ranks"]) != group for e in entries):
                continue  # a model a peer no longer holds, or holds in another group: the start check's business
            line = differing([e for e in entries if e is not None], apart)
            if line:
                return f"at the end of training: {line}"
    return None


def differing(entries: list[dict[str, Any]], apart: str = APART) -> str | None:
    """The message for one model's posts in one replica group (``entries[i]``: job rank ``ranks[i]``'s), or None."""
    rows, names = [e["sums"] for e in entries], entries[0]["names"]
    if any(e["names"] != names for e in entries):
        return None  # not the same model on every rank: the start check names that
    if all(row == rows[0] for row in rows):
        bad = {e["nonfinite"] for e in entries}
        return diverged_line(names[bad.pop()]) if len(bad) == 1 and min(bad) >= 0 else None
    classes: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
        classes.setdefault(tuple(row), []).append(i)
    ordered = sorted(classes.values(), key=lambda members: (-len(members), members[0]))
    majority = ordered[0] if len(ordered[0]) * 2 > len(rows) else None
    tensors = [names[t] for t in range(len(names)) if any(row[t] != rows[0][t] for row in rows)]
    found = _Posted(max(e["seen"] for e in entries) + 1, entries[0]["agreed"], [e["steps"] for e in entries],
                    ordered, majority, majority[0] if majority else 0, tensors, list(entries[0]["ranks"]))
    found.apart = apart
    return found.message(at_exit=True)


class _Posted(replica_repair.Finding):
    """A finding from the posts: the step counts are there, the tensors are not."""

    apart = APART

    def why(self) -> str:
        if len(set(self.steps)) > 1:
            return replica_repair.cause(self.steps, 0, 0, 0, 0, 0, 0.0, 0.0, self.job(range(len(self.steps))))
        return f"cause not told ({self.apart}: compared through the store, which carries no tensor to name it)"
