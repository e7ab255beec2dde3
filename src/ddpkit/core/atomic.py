"""Files that are whole or absent: the one place ddpkit writes a file another process (or a resume) reads.

Example::

    write_atomically("runs/report.json", lambda f: f.write(b'{"ok": true}'))   # a reader never sees half of it
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO


def write_file(path: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into ``path`` (binary) and fsync it: on disk before anything refers to it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """``write(f)`` into a temporary file beside ``path``, fsync, rename: ``path`` is whole or untouched.

    >>> import tempfile; p = os.path.join(tempfile.mkdtemp(), "a.txt")
    >>> write_atomically(p, lambda f: f.write(b"hi")); open(p).read()
    'hi'
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write_file(tmp, write)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
