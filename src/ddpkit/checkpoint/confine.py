"""Files read from a checkpoint directory stay inside it, and are regular files.

A checkpoint directory is written by whoever can write it, and so is every name in it: a manifest entry, a shard
file, ``state.pt``. A name that is absolute or climbs out with ``..``, a symlink out of the directory, or a file
that is no regular file (``/dev/zero`` never ends; a FIFO blocks ``open()`` until a writer comes) would make a
reader read outside the checkpoint or hang for ever. Every reader of a checkpoint opens its files here: the name
is checked, the file opened with ``O_NONBLOCK`` (a FIFO's open returns at once) and checked again with ``fstat``
on what was opened, so a file swapped after the check is still refused.

Example::

    with open_inside("runs/exp/ckpt-0000000005", "state.pt") as f:   # UnsafeCheckpoint for a FIFO, ../x, /dev/zero
        data = f.read()
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

# a manifest lists each file in ~150 bytes: 8 MiB is 50,000 files (an fsdp save writes one a rank), and bounds
# json.load (a manifest padded to 60 MB was read in 9.7 s, 1.6 GB)
LIMIT_JSON = 8 << 20
ADVICE = "it was not written by ddpkit: remove it, or restore another checkpoint"


class UnsafeCheckpoint(ValueError):
    """A checkpoint whose files ask for something ddpkit does not load (crafted, or not from ddpkit / torch)."""


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "no regular file")


def _refuse(root: str, name: str, found: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"{os.path.join(root, name)!r} refused: {name!r} is {found}, expected a regular file "
                            f"inside {root}; {ADVICE}")


def inside(root: str, name: str) -> str:
    """The path of ``name`` under ``root`` once it is known to be a regular file inside ``root`` (a symlink only
    to such a file); :class:`UnsafeCheckpoint` otherwise, before anything is opened."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise _refuse(root, str(name), "no file name")
    if os.path.isabs(name):
        raise _refuse(root, name, "an absolute path")
    if ".." in name.replace(os.sep, "/").split("/"):
        raise _refuse(root, name, "a path with '..' that leaves the directory")
    path = os.path.join(root, name)
    try:
        mode = os.lstat(path).st_mode
        # every component, not the last one alone: a folder of the checkpoint linked elsewhere (shards -> another
        # run's shards, ext -> /etc) leads out of it as surely as a linked file
        real = os.path.realpath(path)
        if os.path.commonpath([real, os.path.realpath(root)]) != os.path.realpath(root):
            raise _refuse(root, name, f"a path through a symlink to {real}, outside the checkpoint")
        if stat.S_ISLNK(mode):
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                raise _refuse(root, name, f"a symlink to {_kind(mode)} ({real})")
    except OSError as exc:  # missing, or a loop of links: no file a reader could use
        raise _refuse(root, name, f"unreadable ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise _refuse(root, name, _kind(mode))
    return path


def open_inside(root: str, name: str) -> BinaryIO:
    """``name`` under ``root`` opened for reading, once :func:`inside` accepts it and ``fstat`` of what was
    opened says it is a regular file still."""
    path = inside(root, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse(root, name, f"unreadable ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped since inside() looked
        os.close(fd)
        raise _refuse(root, name, _kind(mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_json(root: str, name: str, limit: int = LIMIT_JSON) -> Any:
    """The JSON value in ``name`` under ``root`` (at most ``limit`` bytes); :class:`UnsafeCheckpoint` otherwise."""
    with open_inside(root, name) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeCheckpoint(f"{os.path.join(root, name)!r} refused: it holds more than {limit} bytes, expected "
                               f"a manifest of at most that; {ADVICE}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[...": nesting past the parser's stack
        raise UnsafeCheckpoint(f"{os.path.join(root, name)!r} refused: it is not JSON ({str(exc)[:120]}); "
                               f"{ADVICE}") from None


def directory_problem(path: str) -> str | None:
    """Why ``path`` is no checkpoint directory of its own (None when it is one): a symlink leads elsewhere, whose
    files are not this run's and which retention must never delete through."""
    if os.path.islink(path):
        return (f"it is a symlink to {os.path.realpath(path)}, expected a directory of its own; restore that "
                "checkpoint by its own path, or copy it in")
    if not os.path.isdir(path):
        return "it does not exist" if not os.path.lexists(path) else "it is no directory"
    return None
