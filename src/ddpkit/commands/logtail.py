"""Running the user's script for ``ddpkit verify`` and ``ddpkit bench``, and showing the end of its output.

A script's output is whatever bytes it printed: a latin-1 file name, a progress bar cut mid-character. Reading
it as strict UTF-8 crashed verify and bench with a UnicodeDecodeError in place of the output the user needed,
so it is decoded with ``errors="replace"``; the tail starts at a line's beginning, not mid-word.

Example::

    run_logged([sys.executable, "train.py"], {"OMP_NUM_THREADS": "1"}, "/tmp/run.log")  # ScriptFailed on exit != 0
    print(log_tail("/tmp/run.log"))
"""

from __future__ import annotations

import os
import subprocess

from ddpkit.core.errors import ScriptFailed


def log_tail(path: str, limit: int = 2000) -> str:
    """The last whole lines of the file at ``path`` that fit in ``limit`` characters, undecodable bytes
    replaced (see :func:`whole_lines`)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        offset = max(0, f.tell() - 4 * limit - 4)  # a UTF-8 character is at most 4 bytes
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    return whole_lines(text, limit, complete=offset == 0)


def whole_lines(text: str, limit: int, complete: bool = True) -> str:
    """The end of ``text`` in at most ``limit`` characters, from a line's start; the last line alone, cut,
    when it is longer than ``limit``. ``complete``: ``text`` is the whole output (its first line is whole).

    >>> whole_lines("first line\\nsecond \\ufffd line\\n", 20)
    'second \\ufffd line\\n'
    >>> whole_lines("one\\ntwo\\n", 20), whole_lines("a very long last line", 6)
    ('one\\ntwo\\n', 't line')
    """
    if complete and len(text) <= limit:
        return text
    tail = text[-limit:]
    if len(text) > limit and text[-limit - 1] == "\n":  # the tail starts a line already
        return tail
    cut = tail.find("\n")
    return tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail


def run_logged(cmd: list[str], env: dict[str, str], log: str) -> None:
    """Run ``cmd`` with ``env`` added, output to ``log``; a non-zero exit raises :class:`ScriptFailed` with the
    end of the output."""
    with open(log, "w") as out:
        code = subprocess.call(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise ScriptFailed(f"`{' '.join(cmd)}` exited {code}; its output ends with:\n{log_tail(log)}")
