"""The replicas' last check when the ranks cannot meet in a collective at the end: they ended more than the exit
wait apart (rank 0 writing a last checkpoint alone), or the script destroyed its group itself
(``dist.destroy_process_group()``, what most DDP scripts end with).

Each rank posts its fingerprints (per model, its per-tensor sums, its optimizer steps since the last check that
agreed) to the job's store, which outlives the group; a rank that finds every rank's post compares them (the last
to post always does). What differs is named as a check in training names it (:mod:`ddpkit.strategies.replicas`),
but the cause only where the step counts tell it: the tensors themselves do not travel through the store.

Example (two ranks' posts of one model, rank 1's first tensor changed)::

    >>> mine = {"agreed": 12, "seen": 40, "steps": 28, "sums": [5, 7]}
    >>> line = differing([mine, dict(mine, sums=[6, 7])], ["0.weight", "0.bias"], [0, 1])
    >>> line[:80]
    'replicas out of sync at step 41 (equal at step 12): rank 1 differs from rank 0 ('
    >>> line[line.index(" in '"):][:71]
    " in '0.weight': the weights differ (the ranks ended more than 5 s apart"
"""

from __future__ import annotations

import json
import os
from typing import Any

from ddpkit.strategies import replica_repair, replicas

_MAX_POST = 1 << 20  # bytes of one rank's post: 64 models of a few thousand tensors
APART = "the ranks ended more than 5 s apart"
DESTROYED = "the script destroyed its process group itself"
_FIELDS = {"agreed": int, "seen": int, "steps": int, "sums": list}


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
        out[str(r.serial)] = {"agreed": r.agreed, "seen": r.seen, "steps": since,
                              "sums": [int(s) for s in replicas._fingerprint(r.tensors).tolist()]}
    return json.dumps(out)


def parse(raw: bytes | None) -> dict[str, dict[str, Any]] | None:
    """A peer's :func:`post`, or None when it is missing or not one a rank of this job wrote."""
    if raw is None or len(raw) > _MAX_POST:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    for entry in value.values():
        if not isinstance(entry, dict) or any(type(entry.get(k)) is not t for k, t in _FIELDS.items()) or \
                any(type(s) is not int for s in entry["sums"]):
            return None
    return value


def compare(raws: list[bytes | None], apart: str = APART) -> str | None:
    """The line for replicas that differ at the end, from every rank's post (``raws[rank]``); None when they
    agree, or when a post is missing (a rank that posts later compares). ``apart``: why there was no collective."""
    posts = [p for p in map(parse, raws) if p is not None]
    if len(posts) < len(raws):
        return None
    for r in _held():
        key = str(r.serial)
        group = [posts[rank] for rank in r.ranks if rank < len(posts)]
        if len(group) != len(r.ranks) or any(key not in p for p in group):  # a model a peer no longer holds
            continue
        line = differing([p[key] for p in group], r.names, r.ranks, apart)
        if line:
            return f"at the end of training: {line}"
    return None


def differing(entries: list[dict[str, Any]], names: list[str], ranks: list[int], apart: str = APART) -> str | None:
    """The message for one model's posts in a replica group (``entries[i]``: job rank ``ranks[i]``'s), or None."""
    rows = [e["sums"] for e in entries]
    if len({len(row) for row in rows}) > 1 or len(rows[0]) != len(names):
        return None  # not the same model on every rank: the start check names that
    if all(row == rows[0] for row in rows):
        return None
    classes: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
        classes.setdefault(tuple(row), []).append(i)
    ordered = sorted(classes.values(), key=lambda members: (-len(members), members[0]))
    majority = ordered[0] if len(ordered[0]) * 2 > len(rows) else None
    tensors = [names[t] for t in range(len(names)) if any(row[t] != rows[0][t] for row in rows)]
    found = _Posted(max(e["seen"] for e in entries) + 1, entries[0]["agreed"], [e["steps"] for e in entries],
                    ordered, majority, majority[0] if majority else 0, tensors, list(ranks))
    found.apart = apart
    return found.message(at_exit=True)


class _Posted(replica_repair.Finding):
    """A finding from the posts: the step counts are there, the tensors are not."""

    apart = APART

    def why(self) -> str:
        if len(set(self.steps)) > 1:
            return replica_repair.cause(self.steps, 0, 0, 0, 0, 0, 0.0, 0.0, self.job(range(len(self.steps))))
        return (f"the weights differ ({self.apart}: compared through the store, which carries no tensor to name "
                "the cause)")
