"""What every rank must see the same before a save commits or a restore loads: the step, the directory's
checkpoints, each rank's part of a sharded save. Each check is a collective of JSON values (never pickle), and
a difference is one line raised on every rank, naming the ranks that see something else.

A checkpoint directory that is not one shared directory (node-local disks, a per-node path) would otherwise
split the job in silence: in ddp rank 0 resumes step 6 and rank 1 starts from step 0; in fsdp every save
commits without rank 1's shard. What every rank raises then::

    SplitDirectory: ranks disagree on the checkpoint directory runs/exp: rank 0 sees ckpt-0000000006 (2 in all),
    rank 1 sees no checkpoint; it must be one shared directory on every node (...)

Example::

    step = steps_agreed(step, "runs/exp")                 # every rank passed the same step, or all raise
    view_agreed("runs/exp", listing, choice)              # every rank loads the same checkpoint, or all raise
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from itertools import groupby
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint import bounds
from ddpkit.checkpoint.lock import DirectoryInUse, verdict
from ddpkit.runtime.control import broadcast, gather_object

SHARED = "it must be one shared directory on every node (a network file system mounted at the same path everywhere)"


class SplitDirectory(RuntimeError):
    """The ranks do not see the same checkpoint directory; raised on every rank alike."""


def ranks(numbers: list[int]) -> str:
    """Ranks in one phrase, runs of them as ranges.

    >>> ranks([1]), ranks([0, 2, 3, 4, 7])
    ('rank 1', 'ranks 0, 2-4, 7')
    """
    # consecutive ranks share rank - position: each group is one run
    runs = [[n for _, n in run] for _, run in groupby(enumerate(sorted(numbers)), lambda pair: pair[1] - pair[0])]
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return f"rank{'s' if len(numbers) > 1 else ''} {', '.join(parts)}"


def _grouped(values: list[Any], say: Callable[[Any], str]) -> str:
    """``values[rank]`` grouped by value, in the order of the first rank of each: 'ranks 0, 2 <say(v)>, ...'."""
    seen: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        seen.setdefault(say(value), []).append(rank)
    return ", ".join(f"{ranks(who)} {what}" for what, who in seen.items())


def steps_agreed(step: Any, directory: str, lock: Any = None, then: Callable[[], None] = lambda: None) -> int:
    """``step`` as a checkpoint step, once every rank passed the same one (collective; each save's first).

    A step that names no checkpoint, or differing steps, raise ValueError on every rank; ``lock`` (rank 0's
    :class:`~ddpkit.checkpoint.lock.DirectoryLock`, taken here) held by another live job raises
    :class:`DirectoryInUse` on every rank; ``then()`` runs last (the check that the directory is this run's).
    Before anything is written: nothing is committed, ``keep=`` deletes nothing, and a lock taken by this refused
    save is given back.

    >>> steps_agreed(5, "runs/exp")
    5
    """
    try:
        number, problem = bounds.step_number(step), None
    except ValueError as exc:
        number, problem = None, str(exc)
    fresh = lock is not None and lock.token is None
    lock_problem = verdict(lock)  # rank 0's, a line whatever the lock file holds: every rank learns it below
    try:
        number = _same_steps(gather_object([number, problem, lock_problem]), directory)
        then()
        return number
    except Exception:
        if fresh:
            lock.release()  # a refused first save leaves nothing, not even the lock it took
        raise


def lock_agreed(lock: Any) -> None:
    """A job's start (its first restore): rank 0 takes the directory's lock (``lock``, None on the other ranks)
    and every rank raises the same :class:`DirectoryInUse` when another live job holds it, before anything is
    loaded. Collective: rank 0's verdict is broadcast as JSON. Example::

        lock_agreed(DirectoryLock("runs/exp") if state.is_main else None)   # or DirectoryInUse on every rank
    """
    problem = broadcast(verdict(lock))
    if problem:
        raise DirectoryInUse(problem)


def _same_steps(everyone: list[Any], directory: str) -> int:
    bad = next(((r, p) for r, (_, p, _) in enumerate(everyone) if p), None)
    if bad is not None:  # the rank named where the others passed another step
        alone = any(p != bad[1] for _, p, _ in everyone)
        raise ValueError(f"{bad[1]} (on rank {bad[0]})" if alone else bad[1])
    held = next((lp for _, _, lp in everyone if lp), None)
    if held:
        raise DirectoryInUse(held)
    numbers = [n for n, _, _ in everyone]
    if len(set(numbers)) > 1:
        raise ValueError(f"checkpoint not saved: the ranks passed different steps to save() into {directory}: "
                         f"{_grouped(numbers, lambda n: f'step {n}')}; nothing was written or deleted; pass the same "
                         "step on every rank (count it from the loop every rank runs, not from per-rank work)")
    return int(numbers[0])


def listing_view(paths: list[str]) -> dict[str, Any]:
    """What a rank sees of a directory's checkpoints (newest commit first), small whatever their number: the
    newest name, how many, and a digest of all their names in order."""
    names = [os.path.basename(p) for p in paths]
    return {"newest": names[0] if names else None, "count": len(names),
            "digest": hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]}


def _seen(view: dict[str, Any]) -> str:
    """'sees step 6 (ckpt-0000000006, the newest of 2)' or 'sees no checkpoint'."""
    if not view["count"]:
        return "sees no checkpoint"
    name = str(view["newest"])
    step = int(name[5:]) if name[5:].isdigit() else name
    return f"sees step {step} ({name}, the newest of {view['count']})"


def view_agreed(directory: str, view: dict[str, Any]) -> None:
    """Every rank saw the same checkpoints in ``directory`` (``view``: :func:`listing_view`, with ``"loads"``:
    the one it would restore and a digest of its manifest); else :class:`SplitDirectory` on every rank, the
    same line (rank 0's directory named, and the ranks that passed another path)."""
    everyone = gather_object({**view, "directory": os.path.abspath(directory)})
    paths = [v.pop("directory") for v in everyone]
    if all(v == everyone[0] for v in everyone):
        return  # the same checkpoints, wherever each node keeps them: a per-node copy is fine
    if any(v["digest"] != everyone[0]["digest"] for v in everyone):
        said = _grouped(everyone, _seen)
    else:  # the same names, but not the same checkpoint chosen: a copy that differs, or fails its checksum
        said = _grouped(everyone, lambda v: f"would load {v.get('loads') or 'none'} "
                                            f"(manifest {v.get('manifest') or '-'})")
    elsewhere = [r for r, p in enumerate(paths) if p != paths[0]]
    named = f" ({', '.join(f'rank {r} passed {paths[r]}' for r in elsewhere[:3])})" if elsewhere else ""
    raise SplitDirectory(f"ranks disagree on the checkpoint directory {paths[0]}{named}: {said}; {SHARED}, or "
                         "hold a copy of the same checkpoints on each node; nothing was loaded")


def parts_agreed(directory: str, tmp: str, step: int, hashed: dict[str, dict[str, Any]], is_main: bool,
                 newest: Callable[[], str | None]) -> None:
    """Before a sharded commit: rank 0 (which commits) sees every rank's shard in ``tmp`` at the size that rank
    wrote (``hashed``, gathered). Else every rank removes ``tmp`` as it sees it and raises :class:`SplitDirectory`
    naming the ranks whose shards rank 0 does not see. Collective."""
    missing: dict[str, list[str]] = {}
    if is_main:
        for name, meta in sorted(hashed.items()):
            file = os.path.join(tmp, name)
            if not os.path.isfile(file) or os.path.getsize(file) != meta["bytes"]:
                writer = os.path.basename(name).lstrip("_").split("_")[0]
                missing.setdefault(writer, []).append(name)
    missing, directory = broadcast([missing, os.path.abspath(directory)])  # rank 0's: the same line everywhere
    if not missing:
        return
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)  # each rank's view of it: rank 1's own copy on a node-local disk too
    kept = broadcast(newest() if is_main else None)
    who = sorted(int(r) for r in missing if r.isdigit())
    files = ", ".join(n for names in missing.values() for n in names[:2])
    raise SplitDirectory(
        f"checkpoint step {step} was not saved: ranks disagree on the checkpoint directory {directory}: rank 0, "
        f"which commits, does not see the shards that {ranks(who) if who else 'the other ranks'} wrote ({files}); "
        f"{SHARED}; nothing of it was left and "
        f"{f'the newest checkpoint is still {kept}' if kept else 'there is no earlier checkpoint'}")


def shards_present(directory: str, tmp: str, step: int) -> None:
    """Rank 0, before it commits a sharded save written in the background (no per-rank list gathered there):
    every file DCP's ``.metadata`` names is in ``tmp``; else :class:`SplitDirectory` naming the ranks whose
    shards are not there (the rank that failed is told to every rank as any background failure is)."""
    from ddpkit.checkpoint import safeload

    folder = os.path.join(tmp, "shards")
    try:
        named = {getattr(i, "relative_path", "") for i in safeload.read_metadata(folder).storage_data.values()}
        missing = sorted(n for n in named if n and not os.path.isfile(os.path.join(folder, n)))
    except (OSError, ValueError) as exc:  # its reader sizes every file it names: the first one missing
        lost = exc if isinstance(exc, FileNotFoundError) else exc.__context__
        if not isinstance(lost, FileNotFoundError):
            raise
        missing = [os.path.basename(str(lost.filename))]
    if missing:
        who = sorted({int(w) for n in missing if (w := n.lstrip("_").split("_")[0]).isdigit()})
        # short: a background failure reaches the other ranks as its first 200 characters
        raise SplitDirectory(f"rank 0, which commits, does not see the shards of {ranks(who) if who else 'the others'} "
                             f"(shards/{missing[0]}): {directory} is no shared directory on every node")


def loads(path: str | None) -> dict[str, Any]:
    """The checkpoint a rank would restore, for :func:`view_agreed`: its name and a digest of its manifest (a
    per-node copy of another save has the same name, not the same manifest)."""
    if path is None:
        return {"loads": None, "manifest": None}
    import json

    from ddpkit.checkpoint.disk import manifest

    found = manifest(path)
    digest = hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16] if found else None
    return {"loads": os.path.basename(path), "manifest": digest}


def first_reason(reason: str | None) -> str | None:
    """Every rank's ``reason`` (why this rank refused something; None: it did not), and on every rank the first
    refusing rank's, naming it: one rank raising alone would leave the others in their next collective.

    >>> first_reason(None), first_reason("bad")     # one process: its own
    (None, 'bad')
    """
    everyone = gather_object(reason)
    return reason if len(everyone) == 1 else _first_named(everyone)


def _first_named(reasons: list[str | None]) -> str | None:
    """The first rank's reason that is not None, naming the rank (None: every rank's was)."""
    failed = next(((r, why) for r, why in enumerate(reasons) if why), None)
    return None if failed is None else f"{failed[1]} (on {ranks([failed[0]])})"


def path_agreed(directory: str, path: str, reason: str | None) -> str | None:
    """``restore(path)``: every rank loads the same checkpoint, and ``reason`` (why this rank cannot load it;
    None: it can) on every rank the first failing rank's. A rank alone raising would leave the others waiting.
    What is compared is the manifest (its digest, as :func:`latest_agreed` does), not the name: runs/A/ckpt-5 on
    rank 0 and runs/B/ckpt-5 on rank 1 are two checkpoints, and a per-node copy of one is the same one.

    >>> path_agreed("runs/exp", "runs/exp/ckpt-0000000005", None)     # one process: nothing to compare
    """
    mine = loads(path) if reason is None else {"loads": os.path.basename(os.path.normpath(path)), "manifest": None}
    everyone = gather_object([mine["loads"], mine["manifest"], reason])
    if len(everyone) == 1:
        return reason
    failed = _first_named([why for _, _, why in everyone])
    if failed is not None:
        return failed
    if any(seen[:2] != everyone[0][:2] for seen in everyone):
        said = _grouped(everyone, lambda v: f"passed {v[0]} (manifest {v[1] or '-'})")
        raise SplitDirectory(f"ranks disagree on the checkpoint to restore from {directory}: {said}; pass the same "
                             "checkpoint on every rank (one shared path, or identical copies); nothing was loaded")
    return None


def latest_agreed(ckpt: Any) -> str | None:
    """``ckpt.latest()`` (a :class:`~ddpkit.checkpoint.checkpointer.Checkpointer`), once every rank sees the same
    checkpoints and would load the same one: a directory that is not shared is one line on every rank, never
    ranks resuming from different steps. Collective, as ``restore`` is."""
    state = ckpt.state
    if state.world_size == 1 or not dist.is_initialized():
        return ckpt.latest()
    view = listing_view(ckpt.checkpoints())
    if state.strategy.shards:  # latest() validates path by path, collectively: the same paths on every rank first
        view_agreed(ckpt.directory, view)
        chosen = ckpt.latest()
        # then the same manifest: per-node copies of two saves under one name would mix their shards, silently
        view_agreed(ckpt.directory, {**view, **loads(chosen)})
        return chosen
    path: str | None = ckpt.latest()
    view_agreed(ckpt.directory, {**view, **loads(path)})
    return path
