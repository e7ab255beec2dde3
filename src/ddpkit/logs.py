"""Readable multi-rank output: every rank's output goes to its own files, the console shows chosen ranks,
and a line that N ranks print alike appears once, marked ``[x N ranks]``.

``ddpkit launch`` asks torchrun to redirect each worker's stdout and stderr into
``<log-dir>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log`` and runs a :class:`ConsoleTail` that
follows those files. Progress-bar updates (segments ending in ``\\r``) of console ranks pass straight through.

Example::

    ddpkit launch --nproc-per-node 4 --log-dir runs/logs train.py            # console: rank 0
    ddpkit launch --nproc-per-node 4 --console-ranks all train.py            # console: every rank
"""

from __future__ import annotations

import glob
import os
import re
import sys
import threading
import time

from ddpkit.faults import block_length

_HOLD_S = 0.5  # how long a console line waits for twins from other ranks before it is printed
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")


def parse_ranks(text: str, world_size: int) -> set[int]:
    """``0``, ``0,2`` or ``all`` -> the set of global ranks shown on the console.

    >>> sorted(parse_ranks("all", 3)), sorted(parse_ranks("0,2", 3))
    ([0, 1, 2], [0, 2])
    """
    if text == "all":
        return set(range(world_size))
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--console-ranks must be 'all' or comma-separated ranks, got {text!r}") from None
    if not ranks or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"--console-ranks {text!r} must name ranks in [0, {world_size - 1}]")
    return ranks


class ConsoleTail:
    """Follows the per-rank log files under ``root`` and writes the console's share of them."""

    def __init__(self, root: str, console_ranks: set[int], first_rank: int, world_size: int,
                 block_tag: str | None = None):
        """``block_tag``: the launch's tag of its workers' traceback blocks (:func:`ddpkit.faults.block_tag`);
        None accepts any tag."""
        self.root, self.console, self.first_rank, self.world = root, console_ranks, first_rank, world_size
        self.tag = block_tag
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, str] = {}
        self.hiding: dict[str, int] = {}  # file -> lines of a worker's traceback block left (its log keeps them)
        # per stream, in arrival order: [first seen, text, ranks that printed it]
        self.pending: dict[str, list[list]] = {"stdout": [], "stderr": []}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ddpkit-console")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Drain what is left and print it; safe to call more than once."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(10)
        self._poll()
        self._flush(force=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._poll()
            self._flush(force=False)

    def _poll(self) -> None:
        for path in glob.glob(os.path.join(self.root, "*", "attempt_*", "*", "std*.log")):
            rank = self.first_rank + int(os.path.basename(os.path.dirname(path)))
            stream = "stdout" if path.endswith("stdout.log") else "stderr"
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            text = self.partial.pop(path, "") + data.decode("utf-8", "replace")
            for segment in re.split(r"(?<=[\r\n])", text):
                if not segment.endswith(("\n", "\r")):
                    self.partial[path] = segment  # incomplete: wait for the rest
                elif segment.endswith("\r") or "\r" in segment:
                    if rank in self.console:  # a progress-bar update: no de-duplication, no delay
                        self._write(stream, segment)
                else:
                    self._line_of(path, stream, _RANK_PREFIX.sub("", segment.rstrip("\n")), rank)

    def _line_of(self, path: str, stream: str, text: str, rank: int) -> None:
        """A whole line from ``path``: a worker's traceback block stays in its log (the launcher's report
        prints the first failure's traceback once, not one per console rank)."""
        if self.hiding.get(path):
            self.hiding[path] -= 1
        elif n := block_length(text, self.tag):
            self.hiding[path] = n
        else:
            self._line(stream, text, rank)

    def _line(self, stream: str, text: str, rank: int) -> None:
        """Join the waiting twin of this line that this rank has not printed yet, or queue a new one."""
        for entry in self.pending[stream]:
            if entry[1] == text and rank not in entry[2]:
                entry[2].add(rank)
                return
        self.pending[stream].append([time.monotonic(), text, {rank}])

    def _flush(self, force: bool) -> None:
        """Print lines in arrival order once all ranks printed them or they waited long enough."""
        now = time.monotonic()
        for stream, queue in self.pending.items():
            while queue and (force or len(queue[0][2]) == self.world or now - queue[0][0] > _HOLD_S):
                _, text, ranks = queue.pop(0)
                if ranks & self.console:
                    mark = f" [x{len(ranks)} ranks]" if len(ranks) > 1 else ""
                    self._write(stream, f"{text}{mark}\n")

    @staticmethod
    def _write(stream: str, text: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(text)
        out.flush()
