"""A checkpoint directory on disk: names, manifests, checksums, and the commit that replaces one atomically.

``<directory>/ckpt-<step>`` is a committed checkpoint. While rank 0 writes one it is ``ckpt-<step>.tmp-<pid>``
(or ``.tmp-sharded``); a step saved again has its old copy renamed aside to ``ckpt-<step>.replaced-<pid>``
(``-<n>`` added while that name is taken: a leftover that could not be removed) before the new one takes the
name, and removed after. A crash at any point of that leaves a whole checkpoint
of the step: before the second rename the copy set aside is the step's checkpoint (:func:`by_commit` lists it
while the name is free), after it the new one is.

Example::

    install("runs/exp/ckpt-0000000005.tmp-41", "runs/exp/ckpt-0000000005")   # replaces an older ckpt-5 too
    newest_valid("runs/exp")                                                  # 'runs/exp/ckpt-0000000005'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Collection
from typing import Any, BinaryIO

from ddpkit.checkpoint import confine
from ddpkit.core import contract, process
from ddpkit.core.atomic import write_file

_NAME = re.compile(r"^ckpt-(\d{10})$")
_TMP_PID = re.compile(r"\.tmp-(\d+)$")
_ASIDE = re.compile(r"^(ckpt-\d{10})\.replaced-\d+(?:-\d+)?$")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return _digest(f)


def _digest(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files(directory: str) -> list[str]:
    """Every file under ``directory``, as sorted relative paths (``shards/__0_0.distcp``)."""
    found = [os.path.relpath(os.path.join(root, name), directory)
             for root, _, names in os.walk(directory) for name in names]
    return sorted(found)


def hashes(directory: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> sha256 and size of these files under ``directory``, each fsynced first."""
    out = {}
    for name in names:
        file = os.path.join(directory, name)
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        out[name] = {"sha256": sha256(file), "bytes": os.path.getsize(file)}
    return out


def validate(path: str, part: tuple[int, int] = (0, 1)) -> str | None:
    """None when ``path`` is a complete checkpoint whose files all match the manifest, else the reason.
    ``part=(i, n)`` hashes only every n-th file from the i-th (the ranks of a job share the reads).
    Every name is confined to ``path`` as a regular file before it is opened (:mod:`ddpkit.checkpoint.confine`)."""
    return confine.directory_problem(path) or _matching(path, lambda files: sorted(files)[part[0]::part[1]])


def unchanged(path: str, names: list[str]) -> str | None:
    """None when each of ``names`` (files of checkpoint ``path``) matches the manifest as this process sees it,
    else the reason. A rank checks so the files it is about to read: :func:`validate` splits the hashing between
    the ranks, which proves nothing of a file on a node whose copy another rank did not hash."""
    return _matching(path, lambda files: names)


def _matching(path: str, pick: Callable[[dict[str, Any]], list[str]]) -> str | None:
    """None when the files ``pick`` takes of the manifest's are there and match it, else the reason."""
    try:
        listed = confine.read_json(path, "manifest.json")
        problem = _listing_problem(listed)
        if problem:
            return problem
        for name in pick(listed["files"]):
            meta = listed["files"].get(name)
            problem = f"{name} is not in the manifest" if meta is None else _mismatch(path, name, meta)
            if problem:
                return problem
    except OSError as exc:
        return f"unreadable file ({exc})"
    except ValueError as exc:  # confine.UnsafeCheckpoint: its one line says what, what was expected, what to do
        return str(exc)
    return None


def _mismatch(path: str, name: str, meta: dict[str, Any]) -> str | None:
    with confine.open_inside(path, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size != meta["bytes"]:
            return f"{name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)"
        if _digest(f) != meta["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def _listing_problem(listed: Any) -> str | None:
    """What is wrong with a manifest's shape (None when nothing): what ddpkit writes is an object whose "files"
    maps each name to its sha256 and size."""
    files = listed.get("files") if isinstance(listed, dict) else None
    if not isinstance(files, dict):
        found = f"a {type(files).__name__}" if isinstance(listed, dict) else \
            f"absent: the manifest is a {type(listed).__name__}, not an object"
        return (f'its manifest\'s "files" is {found}, expected an object of name -> {{"sha256", "bytes"}}; '
                f"{confine.ADVICE}")
    commit = listed.get("commit", 0)
    if type(commit) is not int or not 0 <= commit < MAX_COMMIT:
        return f"its manifest's commit is {str(commit)[:40]!r}, expected a whole number from 0 to {MAX_COMMIT - 1}; " \
            f"{confine.ADVICE}"
    odd = next((n for n in files if posixpath.normpath(n) != n), None)
    if odd is not None:  # ./blob beside blob: one file listed (and hashed) under many names
        return f"its manifest names {odd!r:.80}, expected a plain relative path as ddpkit writes it; " \
            f"{confine.ADVICE}"
    bad = next((n for n, m in files.items() if not isinstance(m, dict) or type(m.get("bytes")) is not int
                or not isinstance(m.get("sha256"), str)), None)
    if bad is not None:
        return (f'its manifest\'s entry for {bad!r} is {files[bad]!r:.80}, expected {{"sha256": <hex>, "bytes": '
                f"<int>}}; {confine.ADVICE}")
    return None


def manifest(path: str) -> dict[str, Any] | None:
    """``path``'s manifest; None when it is unreadable, or no file of the checkpoint's own (a FIFO, /dev/zero, a
    symlink out: :mod:`ddpkit.checkpoint.confine`), or ``path`` itself a symlink (another directory's)."""
    if os.path.islink(path):
        return None
    try:
        found = confine.read_json(path, "manifest.json")
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None


def run_of(path: str) -> str | None:
    return (manifest(path) or {}).get("run")


# a checkpoint's path -> (its directory's inode, its commit number): a save orders every checkpoint of the
# directory by commit, and reading each manifest again made a save take 1.4 s beside 1,500 checkpoints. A
# checkpoint's directory takes its name, manifest written, by a rename (install), and a step saved again is a new
# directory: a name with the inode seen before holds the manifest read before
_NUMBERS: dict[str, tuple[int, int | None]] = {}
MAX_COMMIT = 1 << 62  # commits counted one a save: never reached


def commit_number(path: str, inode: int | None = None) -> int | None:
    """The commit counter in ``path``'s manifest (0 for one written before it existed); None when unreadable.
    Read once per checkpoint directory (``inode``: its inode, when the caller listed it)."""
    if inode is None:
        try:
            inode = os.lstat(path).st_ino
        except OSError:
            return None
    hit = _NUMBERS.get(path)
    if hit is not None and hit[0] == inode:
        return hit[1]
    found = manifest(path)
    number = None if found is None else found.get("commit", 0)
    # a forged 1.5, true, or a count of 4300 digits (every later save's number would exceed what str() writes) is
    # no commit number: that checkpoint reads as unreadable
    number = number if type(number) is int and 0 <= number < MAX_COMMIT else None
    if len(_NUMBERS) > 100_000:  # many directories in one long process: start again
        _NUMBERS.clear()
    _NUMBERS[path] = (inode, number)
    return number


def numbered(directory: str) -> dict[str, int | None]:
    """Every checkpoint in ``directory`` (and each copy set aside, see :func:`by_commit`) -> its commit number:
    one listing, and a manifest read only for a checkpoint directory not seen before."""
    try:
        with os.scandir(directory) as listing:
            inodes = {entry.name: entry.inode() for entry in listing}  # from the listing: no stat
    except OSError:
        return {}
    committed = {n for n in inodes if n.startswith("ckpt-") and _NAME.match(n)}
    aside = [n for n in inodes if ".replaced-" in n and (m := _ASIDE.match(n)) and m.group(1) not in committed]
    base = os.path.join(directory, "")  # joined once: thousands of os.path.join were most of a save's time
    return {(path := base + n): commit_number(path, inodes[n]) for n in [*committed, *aside]}


def by_commit(directory: str) -> list[str]:
    """The checkpoints in ``directory``, newest commit first (then the higher step).

    The only order retention and resume use: after ``restore(path=older)`` or in a directory an earlier run
    left behind, the newest save is not the highest step number. One whose manifest is unreadable comes
    first, so that resuming names it (and skips it) instead of passing over it in silence. A copy set aside by
    a re-save that was killed before the new copy took the name stands for its step (see the module doc)."""
    return ordered(numbered(directory))


def ordered(numbers: dict[str, int | None]) -> list[str]:
    """The paths of :func:`numbered`'s answer, newest commit first (then the higher step)."""
    return sorted(numbers, key=lambda p: (math.inf if numbers[p] is None else numbers[p], p), reverse=True)


def newest_valid(directory: str) -> str | None:
    """The newest checkpoint in ``directory`` that :func:`validate` accepts (no warnings: for tools)."""
    return next((p for p in by_commit(directory) if validate(p) is None), None)


def install(tmp: str, final: str) -> None:
    """Rename the finished ``tmp`` to ``final``; an older ``final`` (the step saved again) is renamed aside
    first and removed once the new one holds the name, so that every moment leaves a whole checkpoint.

    Once ``tmp`` holds the name the checkpoint is committed: a failure after that (the directory's fsync, the
    removal of the old copy) is a warning, never "not saved"."""
    parent = os.path.dirname(final) or "."
    aside = _free_name(f"{final}.replaced-{os.getpid()}")
    if os.path.exists(final):
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError:
        if os.path.exists(aside):
            os.rename(aside, final)  # the old copy takes its name back
        raise
    for attempt in (1, 2):  # EIO from an fsync is not always final; a second failure is reported
        try:
            fsync_dir(parent)
            break
        except OSError as exc:
            if attempt == 2:
                warnings.warn(f"ddpkit: checkpoint {final} was saved, but the fsync of {parent} after its rename "
                              f"failed ({exc.strerror or exc}): a power loss now could lose it; check that disk",
                              stacklevel=3)
    try:
        remove_replaced(parent)
    except OSError:  # the copy set aside stays; the next save or Checkpointer removes it
        pass


def _free_name(name: str) -> str:
    """``name``, or ``name-1``, ``name-2``...: the first that no leftover holds."""
    found, n = name, 0
    while os.path.lexists(found):
        n += 1
        found = f"{name}-{n}"
    return found


def remove_replaced(directory: str) -> None:
    """Remove the copies set aside whose step holds a committed checkpoint again (no reader uses those)."""
    names = set(os.listdir(directory))
    for name in names:
        m = _ASIDE.match(name)
        if m and m.group(1) in names:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def remove_unfinished(directory: str, running: Collection[str] = ()) -> None:
    """Remove the temporary directories of saves that were killed midway (never a committed checkpoint); those in
    ``running`` (absolute paths: this process's background writes) are not leftovers, nor is ``.tmp-<pid>`` of a
    process alive on this host (another process's Checkpointer of the directory, writing now: an evaluation
    watcher must not delete the trainer's save; a pid taken again by another process keeps a leftover a while)."""
    for entry in os.listdir(directory):
        path = os.path.abspath(os.path.join(directory, entry))
        if ".tmp-" not in entry or not entry.startswith("ckpt-") or path in running:
            continue
        writer = _TMP_PID.search(entry)
        if writer and int(writer.group(1)) != os.getpid() and _alive(int(writer.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """A process ``pid`` exists on this host (signal 0 checks without sending; EPERM: it exists, not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def run_id() -> str:
    """Who writes this run's checkpoints: torchrun's job id (the same in every restart of a job; ``ddpkit
    launch`` makes one per launch on one node, ``--rdzv-id`` names it across nodes), else one per process."""
    job = contract.RUN_ID.text(os.environ)
    if job:
        return job
    proc = process.current()
    if proc.run_id is None:  # this process's own, made on first use
        proc.run_id = f"process-{uuid.uuid4().hex[:12]}"
    return proc.run_id


def prepare(directory: str, running: Collection[str] = (), clean: bool = True) -> None:
    """Rank 0, once per Checkpointer: ``directory`` exists and is writable (one line if not), and the leftovers
    of saves killed midway are gone (not the temporary directories in ``running``: this process's writes; none
    when not ``clean``: another live job holds the directory, and they may be its saves in flight)."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-test-{os.getpid()}")
        write_file(probe, lambda f: f.write(b"ok"))
        os.remove(probe)
    except OSError as exc:
        raise PermissionError(f"checkpoint directory {directory!r} is not writable ({exc.strerror}); "
                              "pass a directory this user can write") from None
    if clean:
        remove_unfinished(directory, running)
        remove_replaced(directory)


def commit(directory: str, tmp: str, step: int, keep: int, world_size: int, extra: dict[str, Any],
           write_state: Callable[[BinaryIO], Any], hashed: dict[str, dict[str, Any]] | None = None) -> str:
    """Rank 0's commit of a save: ``state.pt`` (``write_state(f)``) and the manifest into ``tmp``, every file
    fsynced, renamed into place (atomically, also over an older copy of the step: :func:`install`), then the
    oldest commits beyond ``keep`` removed. ``hashed``: the shard files the ranks hashed as they wrote them.

    Example::

        commit("runs/exp", "runs/exp/ckpt-0000000005.tmp-41", 5, 3, 2, {}, lambda f: torch.save(payload, f))
    """
    final = os.path.join(directory, f"ckpt-{step:010d}")
    os.makedirs(tmp, exist_ok=True)
    write_file(os.path.join(tmp, "state.pt"), write_state)
    # state.pt, and the shards of a sharded checkpoint: those the ranks hashed as they wrote them (DCP
    # fsynced them) are taken as they are, the rest (state.pt, DCP's .metadata) hashed and fsynced here
    listed = {**hashes(tmp, [n for n in files(tmp) if n not in (hashed or {})]), **(hashed or {})}
    number = 1 + max((n for n in numbered(directory).values() if n is not None), default=0)
    record = {"format": 1, "step": step, "commit": number, "run": run_id(), "world_size": world_size,
              "extra": extra, "files": listed}
    write_file(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(record).encode()))
    for root, _, _ in os.walk(tmp):
        fsync_dir(root)
    install(tmp, final)  # committed from here: nothing after it may report the save as failed
    try:
        # a damaged one stays; this may run on a background writer thread
        numbers = numbered(directory)
        committed = [p for p in ordered(numbers) if numbers[p] is not None]
        for old in committed[keep:]:  # by commit order: the newest saves, not the highest steps
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        warnings.warn(f"ddpkit: checkpoint {final} was saved, but removing older ones failed ({exc}); "
                      "they are removed at a later save", stacklevel=5)
    return final
