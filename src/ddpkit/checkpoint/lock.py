"""One job per checkpoint directory: a lock file that names the process holding it and outlives a crash.

Two jobs saving into one directory delete each other's checkpoints (``keep=``, and the leftovers of saves killed
midway). So rank 0 takes ``<directory>/.ddpkit-lock`` at its first restore or save; the file holds who took it::

    {"host": "node-a", "pid": 4242, "start": "81234", "job": "ddpkit-1712", "since": 1712000000.0,
     "token": "5d1e..."}

and a second job is refused with one line naming that holder. The holder is the process (host, pid and its
start time), never the job id: that is "none" for every static launch and "ddpkit" for every elastic one, so two
unrelated jobs share it. The holder gives the lock back when its Checkpointer goes or the process ends (at exit,
after an uncaught exception too). A lock is taken over only when its holder is dead: on the same host its pid is
gone (or is another process now: ``start`` differs); from another host, whose pids cannot be checked, it has not
been touched for :data:`STALE_S` seconds (the holder touches it every :data:`BEAT_S`). A restart of the same
launch (torchrun's ``--max-restarts``) has a new rank 0 and the old one is dead, so it takes the lock over.

The takeover is atomic: the stale file is first renamed to a name of this process's own (one renamer wins), and
only if what was renamed is the lock judged stale is the new one linked in (``os.link``: only one creator wins);
the file is read back to confirm the token. The holder checks at each save, and its heartbeat at each beat, that
the file still holds its token: a holder whose lock another job took over saves no more there (one line).

A lock file that is not ddpkit's (no JSON object, a field of the wrong type or out of range, a directory or a
symlink where the file belongs) is refused, not taken over: whatever wrote it may still be writing there, and
refusing loses nothing (the line says to remove the file).

Example::

    lock = DirectoryLock("runs/exp")
    problem = lock.acquire()      # None: this process holds it; else the one line that refuses the job
    ...
    lock.release()                # only while the file still holds this process's token
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import stat
import threading
import time
import uuid
import weakref
from typing import Any

from ddpkit.checkpoint.disk import _alive, run_id
from ddpkit.core import process

LOCK = ".ddpkit-lock"
BEAT_S = 30.0  # how often the holder touches its lock, for the hosts that cannot check its pid
STALE_S = 120.0  # untouched this long, a lock of another host's job is that of a job that is gone
PID_MAX = 1 << 22  # Linux's largest pid_max: a pid above it (or below 1) names no process
LIMIT = 4096  # a lock ddpkit writes is ~200 bytes


class DirectoryInUse(RuntimeError):
    """Another live job holds the checkpoint directory (or a lock file that is not ddpkit's is there): raised on
    every rank alike, at this job's first restore or save."""


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc's field 22): a pid taken again by a new process after
    the holder died has another one. None where /proc is not there, or for a pid no process can have."""
    if type(pid) is not int or not 1 <= pid <= PID_MAX:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # the fields after the command name start at field 3
    except (OSError, IndexError):
        return None


def _identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
            "job": run_id(), "since": time.time(), "token": uuid.uuid4().hex}


def _invalid(held: Any) -> str | None:
    """Why ``held`` (a lock file's JSON) is no lock ddpkit wrote; None when it is one. Every field is checked
    here, before any is used: a ``since`` of 1e300 would make time.localtime raise on rank 0 alone.

    >>> _invalid({"host": "a", "pid": 0, "start": None, "job": "j", "since": 0.0, "token": "t"})
    "'pid' is 0, expected a process id 1..4194304"
    """
    if not isinstance(held, dict):
        return f"it holds a JSON {type(held).__name__}, expected an object"
    for key in ("host", "job", "token"):
        value = held.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= 255:
            return f"{key!r} is {str(value)[:40]!r}, expected a string of 1..255 characters"
    pid = held.get("pid")
    if type(pid) is not int or not 1 <= pid <= PID_MAX:  # type(): True is no pid
        return f"'pid' is {str(pid)[:40]}, expected a process id 1..{PID_MAX}"
    start = held.get("start")
    if start is not None and (not isinstance(start, str) or not start.isdigit() or len(start) > 20):
        return f"'start' is {str(start)[:40]!r}, expected null or the process's start time as a string of digits"
    since: Any = held.get("since")
    if type(since) not in (int, float) or not math.isfinite(since) or not 0 <= since <= 1e11:  # type(): no bool
        return f"'since' is {str(since)[:40]}, expected seconds since 1970 (0..1e11)"
    return None


def _load(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the holder, None) for a lock ddpkit wrote at ``path``; (None, None) when there is none; (None, why) when
    what is there is no lock of ddpkit's. Never follows a symlink, never blocks on a FIFO, reads at most
    :data:`LIMIT` bytes."""
    try:
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "no regular file"
            return None, f"it is {kind}, expected a regular file"
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None, "it is no regular file"
            data = f.read(LIMIT + 1)
    except FileNotFoundError:
        return None, None  # none, or given back this moment
    except OSError as exc:
        return None, f"it cannot be read ({exc.strerror or exc})"
    if len(data) > LIMIT:
        return None, f"it holds more than {LIMIT} bytes"

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is no number")

    try:
        held = json.loads(data, parse_constant=no_constant)  # NaN, Infinity: refused
    except (ValueError, RecursionError) as exc:
        return None, f"it is not JSON ({str(exc)[:60]})"
    problem = _invalid(held)
    return (None, problem) if problem else (held, None)


def read(directory: str) -> tuple[dict[str, Any] | None, str | None]:
    """``directory``'s lock: see :func:`_load`."""
    return _load(os.path.join(directory, LOCK))


def _mine(held: dict[str, Any]) -> bool:
    """``held`` names this very process (another Checkpointer of it took the lock)."""
    return held["host"] == socket.gethostname() and held["pid"] == os.getpid() \
        and held["start"] == _process_start(os.getpid())


def live_holder(directory: str, held: dict[str, Any] | None) -> bool:
    """``held`` (a valid lock of ``directory``) belongs to a process that may still be running."""
    if held is None:
        return False
    if held["host"] == socket.gethostname():
        if not _alive(held["pid"]):
            return False
        now = _process_start(held["pid"])
        return not (now and held["start"] and now != held["start"])  # the pid is another process's now
    try:  # another host: its pids mean nothing here, the holder's heartbeat does
        return time.time() - os.stat(os.path.join(directory, LOCK)).st_mtime < STALE_S
    except OSError:
        return False


def other_job(directory: str) -> dict[str, Any] | None:
    """The holder of ``directory``'s lock when it is another live process, else None (an equal job id is no
    reason: every static launch has the job id "none")."""
    held, _ = read(directory)
    if held is None or _mine(held):
        return None
    return held if live_holder(directory, held) else None


def blocking(directory: str) -> str | None:
    """The line that refuses a job in ``directory`` (another live holder, or a lock file not ddpkit's), or None."""
    held, bad = read(directory)
    if bad:
        return not_ours(directory, bad)
    return refusal(directory, held) if held is not None and not _mine(held) and live_holder(directory, held) \
        else None


def _when(since: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))  # since: checked finite, 0..1e11


def refusal(directory: str, held: dict[str, Any]) -> str:
    same = " (the same job id: another launch)" if held["job"] == run_id() else ""
    return (f"checkpoint directory {directory} is in use by another job (job {held['job']}, pid {held['pid']} on "
            f"{held['host']}, since {_when(held['since'])}){same}, and this job {run_id()} was about to use it: two "
            f"jobs in one directory delete each other's checkpoints; pick another directory, or stop that job first "
            f"(its lock {os.path.join(directory, LOCK)} goes when it ends; one of a job that died is taken over)")


def not_ours(directory: str, why: str) -> str:
    return (f"checkpoint directory {directory} has a lock file {os.path.join(directory, LOCK)} that is not ddpkit's "
            f"({why}); this job does not save beside whatever wrote it: if no job uses the directory, remove that "
            "file, or pick another directory")


class DirectoryLock:
    """This process's hold on one directory's lock (rank 0's); see the module doc."""

    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, LOCK)
        self.token: str | None = None
        self.lost: str | None = None  # the line once another job took the lock over
        self._stop = threading.Event()

    def acquire(self) -> str | None:
        """Take the lock; None when this process holds it (again: checked still ours), else the refusal line."""
        if self.token is not None:
            return self.check()
        mine = _identity()
        tmp = f"{self.path}.{os.getpid()}-{mine['token'][:8]}"
        try:
            return self._take(tmp, mine)
        except OSError:  # no lock where no file can be written (a full disk): the save itself then raises the
            return None  # documented OSError; something in the lock's place is no OSError here (refused above)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def _take(self, tmp: str, mine: dict[str, Any]) -> str | None:
        with open(tmp, "w") as f:
            json.dump(mine, f)
        for _ in range(5):  # each round ends in a hold, a refusal, or one stale lock moved aside
            try:
                _create(tmp, self.path, mine)
            except FileExistsError:
                held, bad = read(self.directory)
                if bad:
                    return not_ours(self.directory, bad)
                if held is None:
                    continue  # given back this moment
                if _mine(held) and any(other.token == held["token"] for other in list(_HELD)):
                    return self._hold(held["token"])  # another Checkpointer of this process holds it: shared
                if not _mine(held) and live_holder(self.directory, held):
                    return refusal(self.directory, held)
                self._evict(held, mine["token"])
                continue
            now, _ = read(self.directory)
            if now is None or now["token"] != mine["token"]:  # another job's lock, put back or linked meanwhile
                return refusal(self.directory, now) if now else not_ours(self.directory, "it changed as it was made")
            return self._hold(mine["token"])
        return (f"checkpoint directory {self.directory}: its lock {self.path} kept changing while this job took it "
                "over (other jobs are starting there too); start one job per directory")

    def _hold(self, token: str) -> str | None:
        """Hold the lock that holds ``token``: None, what :meth:`acquire` says for a lock held."""
        self.token, self.lost = token, None
        self._stop.clear()
        threading.Thread(target=self._beat, name="ddpkit-checkpoint-lock", daemon=True).start()
        process.on_shutdown(_release_all, always=True)  # an exit, even after an uncaught exception, gives it back
        _HELD.add(self)
        return None

    def _evict(self, stale: dict[str, Any], token: str) -> None:
        """Move the lock judged ``stale`` out of the way. The rename is atomic and only one renamer gets the file;
        a file renamed that is not ``stale`` (another job took the lock over first) is put back at once."""
        aside = f"{self.path}.stale-{token[:12]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job moved it first: the next round sees what is there now
        moved, _ = _load(aside)
        if moved is None or moved["token"] != stale["token"]:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)  # its holder's again; where a third job linked meanwhile, it sees at its save
        with contextlib.suppress(OSError):
            os.remove(aside)

    def check(self) -> str | None:
        """None while the file still holds this process's token; else the line that stops this job's saves."""
        if self.lost is None and self.token is not None:
            held, bad = read(self.directory)
            if held is None and bad is None:
                time.sleep(0.2)  # a starting job may have it renamed aside for a moment: it puts it back
                held, bad = read(self.directory)
            if held is None or held["token"] != self.token:
                who = (f"job {held['job']}, pid {held['pid']} on {held['host']}" if held else
                       f"a file that is not ddpkit's ({bad})" if bad else "nothing: the file is gone")
                self.lost = (f"checkpoint not saved: this job's lock {self.path} now holds {who}; another job took "
                             f"the directory {self.directory} over (this job looked dead to it), and two jobs there "
                             "delete each other's checkpoints; stop the other job, or save into another directory")
                self._stop.set()
        return self.lost

    def _beat(self) -> None:
        """Touch the lock now and then: hosts that cannot check this pid see the job alive by it. A lock taken
        over stops the beat (and the next save)."""
        while not self._stop.wait(BEAT_S):
            if self.check() is not None:
                return
            with contextlib.suppress(OSError):  # a directory unreachable for a while: the next beat tries again
                os.utime(self.path)

    def release(self) -> None:
        """Give the lock back, if the file still holds this process's token (else another job took it over)."""
        token, self.token = self.token, None
        self._stop.set()
        _HELD.discard(self)
        if token is not None and any(other.token == token for other in list(_HELD)):
            return  # another Checkpointer of this process still holds it, and gives it back in its turn
        held, _ = read(self.directory)
        if token is not None and held is not None and held["token"] == token:
            with contextlib.suppress(OSError):  # a lock left behind is a stale one: the next job takes it over
                os.remove(self.path)


def verdict(lock: DirectoryLock | None) -> str | None:
    """Rank 0's decision on ``lock`` as a line (None: held), never an exception: the other ranks learn it from
    rank 0 in a collective, so rank 0 must reach that collective whatever the file holds."""
    if lock is None:
        return None
    try:
        return lock.acquire()
    except Exception as exc:  # a defect here must still reach the other ranks as one line
        return f"checkpoint directory {lock.directory}: its lock {lock.path} could not be checked " \
               f"({type(exc).__name__}: {str(exc)[:120]}); remove that file if no job uses the directory"


def _create(tmp: str, path: str, mine: dict[str, Any]) -> None:
    """``path`` made from ``tmp`` only if it does not exist (FileExistsError else): a hard link is atomic and
    the file is whole when it appears; a file system without hard links gets an exclusive create instead."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)


_HELD: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()


def _release_all() -> None:
    for lock in list(_HELD):
        lock.release()
