"""The fault reports' format, shared by the two processes that use it: a worker writes it
(:mod:`ddpkit.runtime.faults`), the launcher reads it (:mod:`ddpkit.launcher.diagnosis`, ``console``,
``supervise``). Kept here, below both, so the writer and the reader cannot drift apart.

In a launch's report directory each rank writes ``error-rank<R>.json`` (its exception), ``stack-rank<R>.txt`` (its
stacks) and, once it passed the final barrier, ``finished-rank<R>``. A worker's traceback goes into its stderr
log inside a block that the console tail leaves out::

    >>> print(traceback_block("KeyError: 'x'", "t1"))
    ddpkit: --- traceback [t1], the next 2 lines (kept in this rank's log) ---
    KeyError: 'x'
    ddpkit: --- end of traceback [t1] ---
"""

from __future__ import annotations

import hashlib
import os
import re

# the block's first line carries the launch's tag (a user's line cannot end up equal to it by chance) and how many
# lines follow (so a message holding a line like the block's end cannot end it early, and a block cut short hides
# no more than its own lines)
_BLOCK = re.compile(r"^ddpkit: --- traceback \[(?P<tag>\w+)\], the next (?P<n>\d+) lines "
                    r"\(kept in this rank's log\) ---$")
# either marker line of a block, whatever its tag
_MARKER = re.compile(r"^ddpkit: --- (traceback \[\w+\], the next \d+ lines|end of traceback \[\w+\]) ")
# what a rank raises when a peer died first: a consequence, not a root cause
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL communicator was aborted", re.IGNORECASE)


def finished_path(report_dir: str, rank: int) -> str:
    """The file a rank creates once every rank passed the final barrier.

    >>> finished_path("/tmp/r/attempt0", 3)
    '/tmp/r/attempt0/finished-rank3'
    """
    return os.path.join(report_dir, f"finished-rank{rank}")


def block_tag(launch_report_dir: str) -> str:
    """The tag of a launch's traceback blocks, from its report directory (a fresh temporary one per launch).

    >>> block_tag("/tmp/ddpkit-report-abc") == block_tag("/tmp/ddpkit-report-abc") != block_tag("/tmp/other")
    True
    """
    return hashlib.sha256(os.path.abspath(launch_report_dir).encode()).hexdigest()[:12]


def traceback_block(text: str, tag: str) -> str:
    r"""``text`` as a block the console leaves out: a first line with ``tag`` and the count of lines after it.

    A carriage return inside would end a console line early: it is written as ``\r``.

    >>> print(traceback_block("Traceback (most recent call last):\nKeyError: 'x'", "t1"))
    ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---
    Traceback (most recent call last):
    KeyError: 'x'
    ddpkit: --- end of traceback [t1] ---
    """
    body = text.rstrip().replace("\r", "\\r").split("\n") + [f"ddpkit: --- end of traceback [{tag}] ---"]
    return "\n".join([f"ddpkit: --- traceback [{tag}], the next {len(body)} lines (kept in this rank's log) ---",
                      *body])


def block_length(line: str, tag: str | None) -> int:
    """How many lines after ``line`` belong to a traceback block (0: ``line`` starts none). ``tag`` None: any.

    >>> block_length("ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---", "t1")
    3
    >>> block_length("ddpkit: --- traceback [t1], the next 3 lines (kept in this rank's log) ---", "t2")
    0
    """
    m = _BLOCK.match(line)
    return int(m["n"]) if m and tag in (None, m["tag"]) else 0


def block_marker(line: str) -> bool:
    """True for either marker line of a traceback block (of any launch), not for the lines between them.

    >>> block_marker("ddpkit: --- end of traceback [t1] ---"), block_marker("KeyError: 'x'")
    (True, False)
    """
    return bool(_MARKER.match(line))


def peer_lost(message: str) -> bool:
    """True when an exception's message says only that a peer went away (a consequence, not a cause).

    >>> peer_lost("[pair.cc:538] Connection closed by peer"), peer_lost("KeyError: 'x'")
    (True, False)
    """
    return bool(_PEER_LOST.search(message))
