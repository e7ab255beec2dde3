"""Each of verify's runs starts from the checkpoints the first one found: the ones a run saves are removed after it.

A script that saves a checkpoint and resumes from it when it is there (Beta-VAE's ``checkpoints/main/last``, a
``if os.path.exists(ckpt): load``) would otherwise make the N-process run resume from the one-process run's
checkpoint, and compare a run of K steps with one of none; and a user's next real run would resume from verify's
5-step checkpoint. So the files under the working directory and the script's folder are listed before each run,
and the new ``torch.save`` archives it leaves (a zip with a ``data.pkl``: what ``torch.save`` writes) and
TensorBoard event files are removed after it, with the folders it made that are then empty. Anything else stays:
a dataset the run downloaded is read again by the next run, not fetched again. A checkpoint that was there before
and that a run changed cannot be put back: it is named, once. What is removed is said, by path: another process of
the user that saves a checkpoint (or writes a new TensorBoard event file) in the same folder while verify runs would
lose it (its file looks like the run's), and would read why. A tree of more than 20000 files is not listed (a
dataset beside the script): said, and nothing is removed.

Example::

    >>> import os, tempfile, torch
    >>> root = tempfile.mkdtemp(); _ = open(os.path.join(root, "data.txt"), "w").write("x")
    >>> before = listing([root])
    >>> os.makedirs(os.path.join(root, "ckpt")); torch.save({"step": 5}, os.path.join(root, "ckpt", "last"))
    >>> _ = open(os.path.join(root, "downloaded.bin"), "w").write("y")
    >>> [os.path.basename(p) for p in undo(before)[0]], sorted(os.listdir(root))
    (['last'], ['data.txt', 'downloaded.bin'])
"""

from __future__ import annotations

import dataclasses
import os
import stat as stat_module
import time
import zipfile

# folders no training run writes a file of its own to, or whose files come and go on their own
SKIP = {".git", "__pycache__", ".venv", "venv", "env", "site-packages", "node_modules", ".ipynb_checkpoints"}
# the temporary folders of verify's runs (command.py names them so), this one's and another verify's beside it: a
# script in /tmp saw its own weights removed, and set 29's measurers one verify remove another's, which then said
# "the script prepared no model"
OWN = "ddpkit-verify-"
LIMIT = 20000  # a tree of more files is no project folder (a home directory, a dataset): nothing is listed


@dataclasses.dataclass
class Listing:
    """The files (path -> (size, modification time)) and folders under ``roots`` when a run started."""

    roots: list[str]
    files: dict[str, tuple[int, int]]
    folders: set[str]
    started: int  # time.time_ns() at the listing: only what is newer is removed
    complete: bool  # False: more than LIMIT files, nothing is removed


# a file's modification time comes from the kernel's coarse clock, up to a tick (<= 10 ms) behind time.time_ns():
# a checkpoint written just after the listing could look older than it (a landing CI's flake of this doctest)
COARSE_NS = 100_000_000


def listing(roots: list[str]) -> Listing:
    """Every file and folder under ``roots`` (each root once; the skipped folders not entered)."""
    started = time.time_ns()
    files: dict[str, tuple[int, int]] = {}
    folders: set[str] = set()
    real = sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)})
    unique = [r for r in real if not any(r.startswith(other.rstrip(os.sep) + os.sep) for other in real)]
    for path, is_dir, stat in _walk(unique):
        if len(files) > LIMIT:
            return Listing(unique, {}, set(), started, False)
        if is_dir:
            folders.add(path)
        elif stat is not None:
            files[path] = (stat.st_size, stat.st_mtime_ns)
    return Listing(unique, files, folders, started, True)


def undo(before: Listing) -> tuple[list[str], list[str]]:
    """Remove the checkpoints the run saved (then the folders it made, once empty, deepest first): (those removed,
    the checkpoints it saved over that were there before, which cannot be put back)."""
    if not before.complete:
        return [], []
    changed, made, removed = [], [], []
    for path, is_dir, stat in _walk(before.roots):
        if is_dir:
            if path not in before.folders:
                made.append(path)
        elif stat is None or not stat_module.S_ISREG(stat.st_mode):  # a pipe, a socket: opening it could block
            continue
        elif path not in before.files:
            if stat.st_mtime_ns >= before.started - COARSE_NS and (_saved(path) or _events(path)):
                _remove(path)
                removed.append(path)
        elif (stat.st_size, stat.st_mtime_ns) != before.files[path] and _saved(path):
            changed.append(path)
    for folder in sorted(made, key=len, reverse=True):
        try:
            os.rmdir(folder)  # only once empty: a file someone else put there stays, and its folder with it
        except OSError:
            pass
    return removed, changed


def _walk(roots: list[str]):
    """(path, is a folder, its stat or None) under ``roots``; links are not followed (nor removed as folders)."""
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(OWN) and
                       not os.path.islink(os.path.join(folder, d))]
            for d in dirs:
                yield os.path.join(folder, d), True, None
            for name in names:
                path = os.path.join(folder, name)
                try:
                    yield path, False, os.lstat(path)
                except OSError:  # gone between the listing and the stat
                    continue


def _saved(path: str) -> bool:
    """A ``torch.save`` archive: a zip whose records sit under one folder with a ``data.pkl``."""
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            return any(name == "data.pkl" or name.endswith("/data.pkl") for name in archive.namelist()[:64])
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _events(path: str) -> bool:
    """A TensorBoard event file (``events.out.tfevents.<time>.<host>...``): the run's log, not data. A script that
    refuses to start when its log folder exists (pixel-cnn-pp's ``runs/<name> already exists!``) would stop verify's
    next run on the one before's."""
    return os.path.basename(path).startswith("events.out.tfevents.")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:  # removed meanwhile, or not ours to remove: it stays
        pass
