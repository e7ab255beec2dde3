"""Readable multi-rank output: every rank's output goes to its own files, the console shows chosen ranks,
and a block of lines that N ranks print alike appears once, marked ``[x N ranks]``.

``ddpkit launch`` asks torchrun to redirect each worker's stdout and stderr into
``<log-dir>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log`` and runs a :class:`ConsoleTail` that
follows those files. A line joins its twin of another rank only where that keeps each shown rank's lines in
order, so a multi-line print stays together; with more than one console rank each line starts with
``[rank0]:`` as torchrun's do.
Both streams of every rank leave in print order (by arrival, within the poll interval): a line waiting for its
twins holds back the lines after it. Whether lines merge is decided by what the ranks print, not by how fast: a
line waits for its twins until every other rank printed it, or printed a later line that another rank shares (it
is past this point), or for at most two seconds (up to ten while runnable processes outnumber the cores).
Progress-bar updates (segments ending in ``\\r``, and the bar's last one) of console ranks are never merged nor
held for twins of their own; they leave after the lines that came before them. An update still without its
``\\r`` is shown once its file has been quiet for a poll or two.

Example::

    ddpkit launch --nproc-per-node 4 --log-dir runs/logs train.py            # console: rank 0
    ddpkit launch --nproc-per-node 4 --console-ranks all train.py            # console: every rank, prefixed
"""

from __future__ import annotations

import codecs
import fcntl
import glob
import json
import os
import re
import shutil
import sys
import threading
import time

from ddpkit.core.reports import block_length

# How long a console line waits at most for its twins from other ranks. Twins are printed by ranks that left a
# collective together, so they are usually a poll apart; on a loaded machine a rank can lag a second or more, and a
# hold of 0.5 s made the same run show "x [x2 ranks]" once and "x" twice another time. A line of one rank only
# (ddpkit.print) waits this long only while no other rank has printed a later shared line (see _flush).
# On a machine with more runnable processes than cores a rank can be off a core for longer, so the hold grows
# with the load, up to _HOLD_MAX_S (a CI machine at load 6 on 2 cores once showed a 2 s lag).
_HOLD_S, _HOLD_MAX_S = 2.0, 10.0
_BAR_QUIET_S = 0.15  # a progress bar's pending update (tqdm writes \r, then the text) is shown once this quiet
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
RUN_MARKER = ".ddpkit-run"  # in every log folder ddpkit made: only those are ever removed


def _hold_s() -> float:
    """How long a line waits at most for its twins: 2 s, more while runnable processes outnumber the cores.

    >>> 2.0 <= _hold_s() <= 10.0
    True
    """
    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # a platform without them: the plain hold
        return _HOLD_S
    return min(_HOLD_MAX_S, _HOLD_S * max(1.0, max(load, _runnable_now()) / max(1, cores)))


def _runnable_now() -> float:
    """Processes runnable at this instant (Linux's /proc/loadavg, 4th field): the one-minute load average lags a
    burst by tens of seconds, the moment a test suite starts many workers at once; 0 where it cannot be read.

    >>> _runnable_now() >= 0
    True
    """
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 0.0


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


def rank_label(ranks: set[int]) -> str:
    """``[rank0]:`` for one rank, runs collapsed for several.

    >>> rank_label({0}), rank_label({0, 1, 2, 5})
    ('[rank0]: ', '[rank0-2,5]: ')
    """
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "[rank" + ",".join(f"{x[0]}-{x[-1]}" if len(x) > 1 else str(x[0]) for x in runs) + "]: "


def new_run_dir(log_dir: str, keep: int) -> str:
    """A new folder for one launch's logs under ``log_dir``, marked as ddpkit's and held as in use until
    :func:`release` (or this process's end); of the marked folders only the newest ``keep`` stay (0: all).
    Never removed: a folder in use by a running launch, one without the mark (the user's), one the user renamed.

    Example: ``new_run_dir("runs/logs", keep=20)`` -> ``runs/logs/20260101-120000-4242``.
    """
    base = os.path.join(log_dir, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    path, n = base, 1
    while True:
        try:
            os.makedirs(path)
            break
        except FileExistsError:  # a second launch from this process within the same second
            n += 1
            path = f"{base}-{n}"
    # A lock, not a pid in the marker: the kernel drops it when the holder dies (even SIGKILLed), a reused
    # pid cannot fake it, and it needs no host name to compare on a shared file system. A POSIX lock (lockf),
    # not an flock: it belongs to this process, so children forked from it (spawn's workers, loader workers)
    # that outlive it do not keep the folder. Locked before the mark is written: a marker without its record
    # is never removed, so no rotation can take it in between.
    fd = os.open(os.path.join(path, RUN_MARKER), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    # the name it was given (a folder renamed since is the user's) and the order of removal (names sort by
    # pid within a second)
    os.write(fd, json.dumps({"name": os.path.basename(path), "created_ns": time.time_ns()}).encode())
    _HELD[os.path.abspath(path)] = fd
    if keep > 0:
        older = _marked(log_dir, path)
        for old in older[:max(0, len(older) + 1 - keep)]:
            _remove_unless_in_use(old)
    return path


def release(path: str) -> None:
    """The launch that made ``path`` is over: later launches may rotate its folder out. Safe to repeat."""
    fd = _HELD.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops its lock


_HELD: dict[str, int] = {}  # folder -> the open, locked marker of a launch from this process still running
_NAMED = re.compile(r"\d{8}-\d{6}-\d+(?:-\d+)?")  # the names ddpkit gives (markers before the record held none)


def _marked(log_dir: str, current: str) -> list[str]:
    """ddpkit's log folders under ``log_dir`` but ``current``, still under the name ddpkit gave, oldest first."""
    found = []
    for marker in glob.glob(os.path.join(log_dir, "*", RUN_MARKER)):
        folder = os.path.dirname(marker)
        if os.path.abspath(folder) == os.path.abspath(current):
            continue
        try:
            with open(marker) as f:
                text = f.read().strip()
        except OSError:
            continue
        created = _created(text, os.path.basename(folder))
        if created is not None:
            found.append((created, folder))
    return [folder for _, folder in sorted(found)]


def _created(text: str, name: str) -> int | None:
    """When the folder named ``name`` was made, from its marker; None where it is not removable: renamed by the
    user, or an empty marker (a launch between its mark and its record). An older ddpkit's marker (a bare
    time) recorded no name: the folder is ddpkit's only while its name has ddpkit's form.

    >>> _created('{"name": "20260101-120000-42", "created_ns": 7}', "best-run"), _created("7", "20260101-120000-42")
    (None, 7)
    """
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if isinstance(record, dict):
        created = record.get("created_ns", 0)
        # a marker someone edited (a time that is not an int) is not removable: skipped, the launch goes on
        return created if record.get("name") == name and isinstance(created, int) else None
    return record if isinstance(record, int) and _NAMED.fullmatch(name) else None


def _remove_unless_in_use(folder: str) -> None:
    """Remove ``folder`` if no running launch holds its marker (a non-blocking try of the lock it holds)."""
    if os.path.abspath(folder) in _HELD:  # this process's own launch: POSIX locks never conflict within a
        return  # process, and closing any descriptor of the marker would drop the lock it holds
    try:
        fd = os.open(os.path.join(folder, RUN_MARKER), os.O_RDWR)  # lockf needs a descriptor open for writing
    except OSError:
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: a launch still writes there and its console reads it
        os.close(fd)
        return
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)


class ConsoleTail:
    """Follows the per-rank log files under ``root`` and writes the console's share of them."""

    def __init__(self, root: str, console_ranks: set[int], first_rank: int, local_ranks: int,
                 block_tag: str | None = None):
        """``local_ranks``: how many ranks this node's files hold (ranks ``first_rank`` on): a line all of them
        printed waits for no other node's copy, which this console never sees.
        ``block_tag``: the launch's tag of its workers' traceback blocks (:func:`ddpkit.core.reports.block_tag`);
        None accepts any tag."""
        self.root, self.console, self.first_rank, self.world = root, console_ranks, first_rank, local_ranks
        self.tag = block_tag
        self.prefixed = len(console_ranks) > 1  # who printed a line matters once several ranks are shown
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, str] = {}
        # bytes -> text per file: a UTF-8 character split across two reads is decoded whole
        self.decoders: dict[str, codecs.IncrementalDecoder] = {}
        self.hiding: dict[str, int] = {}  # file -> lines of a worker's traceback block left (its log keeps them)
        # both streams in one queue, in arrival order (the console's print order): [first seen, stream, text,
        # ranks that printed it, raw]; a line waiting for its twins holds back the lines after it, a progress
        # update that came after it too (raw: written as it is, never joined)
        self.pending: list[list] = []
        self.bar: set[str] = set()  # files whose last segment was a progress update (ended with \r)
        self.shown: dict[str, int] = {}  # file -> characters of its pending partial already shown (a quiet bar)
        self.changed: dict[str, float] = {}  # file -> when it last grew
        self._lock = threading.Lock()  # the launcher's own lines (say) and the tail's thread write in turn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ddpkit-console")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Drain what is left, a last line without its newline too, and print it; safe to call more than once."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            self._poll()
            for path in sorted(self.partial):
                text = self.partial.pop(path) + self.decoders[path].decode(b"", final=True)
                if path in self.shown:  # a bar's last update, shown already but for what came after
                    self._progress(path, text[self.shown.pop(path):], label=False)
                elif text:
                    self._whole(path, [text])
            self._flush(force=True)

    def say(self, line: str) -> None:
        """A launcher line on stderr, after every worker line that reached the files before it."""
        with self._lock:
            self._poll()
            self._flush(force=True)
            self._write("stderr", line + "\n")

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                self._poll()
                self._flush(force=False)

    def _poll(self) -> None:
        for path in sorted(glob.glob(os.path.join(self.root, "*", "attempt_*", "*", "std*.log"))):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            self.changed[path] = time.monotonic()
            decoder = self.decoders.setdefault(path, codecs.getincrementaldecoder("utf-8")("replace"))
            self._text(path, self.partial.pop(path, "") + decoder.decode(data))
        self._quiet_bars()

    def _quiet_bars(self) -> None:
        """Show a progress bar's pending update once its file is quiet: tqdm writes ``\r`` and then the text, so
        waiting for the line's end would show every update one update late."""
        now = time.monotonic()
        for path, text in self.partial.items():
            done = self.shown.get(path, 0)
            if path in self.bar and len(text) > done and now - self.changed.get(path, now) >= _BAR_QUIET_S:
                self._progress(path, text[done:], label=not done)
                self.shown[path] = len(text)

    def _text(self, path: str, text: str) -> None:
        """Whole lines go to the queue, progress updates straight out (after the lines before them); a line
        that ends a progress bar (tqdm's last update, ``\r`` then the text and ``\n``) is one of its updates."""
        lines: list[str] = []
        skip = self.shown.pop(path, 0)  # the start of this text is on the console already
        for segment in re.split(r"(?<=[\r\n])", text):
            if not segment:
                continue
            if not segment.endswith(("\n", "\r")):
                self.partial[path] = segment  # incomplete: wait for the rest
                if skip:
                    self.shown[path] = skip
            elif "\r" in segment or path in self.bar:
                self._whole(path, lines)
                lines = []
                self._progress(path, segment[skip:], label=not skip)
                # the bar's last update ('\r' text '\n'), or its erasure (tqdm's leave=False writes blanks and
                # '\r'): the lines after it are lines again
                if segment.endswith("\n") or (segment[:-1] and not segment.strip()):  # a lone '\r' starts one
                    self.bar.discard(path)
                else:
                    self.bar.add(path)
            else:
                lines.append(segment.rstrip("\n"))
            skip = 0
        self._whole(path, lines)

    def _where(self, path: str) -> tuple[str, int]:
        return ("stdout" if path.endswith("stdout.log") else "stderr",
                self.first_rank + int(os.path.basename(os.path.dirname(path))))

    def _progress(self, path: str, segment: str, label: bool = True) -> None:
        """A progress-bar update: no de-duplication, no delay, but after the lines that came before it.
        ``label``: False for the rest of an update whose start (and prefix) is shown already."""
        stream, rank = self._where(path)
        if rank in self.console and segment:
            text = (rank_label({rank}) if self.prefixed and label else "") + segment
            # behind a line of its own rank that waits for twins: forcing that out would decide the merge by
            # timing; lines of other ranks are no reason to wait (their order against this rank's is arrival's)
            if any(rank in entry[3] for entry in self.pending):
                self.pending.append([time.monotonic(), stream, text, {rank}, True])
            else:
                self._write(stream, text)

    def _whole(self, path: str, lines: list[str]) -> None:
        """Whole lines from ``path``: a worker's traceback block stays in its log (the launcher's report prints
        the first failure's traceback once, not one per console rank)."""
        kept = []
        for line in lines:
            line = _RANK_PREFIX.sub("", line)
            if self.hiding.get(path):
                self.hiding[path] -= 1
            elif n := block_length(line, self.tag):
                self.hiding[path] = n
            else:
                kept.append(line)
        stream, rank = self._where(path)
        for line in kept:
            self._line(stream, line, rank)

    def _line(self, stream: str, text: str, rank: int) -> None:
        """Join the waiting twin of this line that this rank has not printed yet, or queue a new one.

        A shown rank joins only a twin queued after its own waiting lines: its lines keep their order, so a
        multi-line print is not merged line by line into another rank's (``[rank1]: value 1`` cannot move
        above ``[rank1]: summary of rank 1:`` by joining rank 0's twin of a line in between).
        """
        queue = self.pending
        for i, entry in enumerate(queue):
            if entry[1] == stream and entry[2] == text and rank not in entry[3] and not entry[4]:
                if rank in self.console and any(rank in later[3] for later in queue[i + 1:]):
                    continue
                entry[3].add(rank)
                return
        queue.append([time.monotonic(), stream, text, {rank}, False])

    def _flush(self, force: bool) -> None:
        """Print lines in arrival order, across both streams, once all ranks printed the first one or it waited
        long enough: a line of one rank (ddpkit's start-up line) holds back the lines printed after it."""
        now, hold = time.monotonic(), _hold_s()
        queue = self.pending
        while queue and (force or queue[0][4] or len(queue[0][3]) == self.world or now - queue[0][0] > hold
                         or self._passed(queue[0][1], queue[0][3])):
            _, stream, text, ranks, raw = queue.pop(0)
            if raw:  # a progress update, as it came
                self._write(stream, text)
                continue
            shown = ranks & self.console
            if shown:
                prefix = rank_label(shown) if self.prefixed else ""
                # the prefix names who printed it; the mark counts the ranks it does not name
                mark = f" [x{len(ranks)} ranks]" if len(ranks) > (len(shown) if self.prefixed else 1) else ""
                self._write(stream, f"{prefix}{text}{mark}\n")

    def _passed(self, stream: str, ranks: set[int]) -> bool:
        """Every rank missing from the first queued line (``ranks`` printed it on ``stream``) is past it: each
        printed a later line on the same stream that another rank printed too, so its own copy would have come
        first (one file is read in order; two streams of one rank may be read out of order within a poll). A
        rank that printed nothing yet may still be on its way: then the line waits for the hold.

        >>> tail = ConsoleTail("/nonexistent", {0}, 0, 2)
        >>> tail.pending = [[0.0, "stdout", "one rank", {0}, False], [0.0, "stdout", "shared", {0, 1}, False]]
        >>> tail._passed("stdout", {0}), tail._passed("stderr", {0})
        (True, False)
        >>> tail.pending[1] = [0.0, "stdout", "rank 0 again", {0}, False]  # rank 1 is not past "one rank"
        >>> tail._passed("stdout", {0})
        False
        """
        later = [entry for entry in self.pending[1:] if entry[1] == stream and not entry[4]]
        missing = set(range(self.first_rank, self.first_rank + self.world)) - ranks
        return all(any(rank in entry[3] and len(entry[3]) > 1 for entry in later) for rank in missing)

    @staticmethod
    def _write(stream: str, text: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.write(text)
        out.flush()
