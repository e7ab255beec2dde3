"""One job per checkpoint directory: a lock file that names the job holding it and outlives a crash.

Two jobs saving into one directory delete each other's checkpoints (``keep=``, and the leftovers of saves killed
midway). So rank 0 takes ``<directory>/.ddpkit-lock`` at its first save; the file holds who took it::

    {"host": "node-a", "pid": 4242, "start": "81234", "job": "ddpkit-1712-9f3c", "since": 1712000000.0,
     "token": "5d1e..."}

and a second job's first save is refused with one line naming that job. The holder gives it back when its
Checkpointer goes or the process ends (at exit, after an uncaught exception too). A lock left by a job that died
is taken over: on the same host its pid is gone (or is another process now: ``start``, the process's start
time, differs); from another host, whose pids cannot be checked, it has not been touched for :data:`STALE_S`
seconds (the holder touches it every :data:`BEAT_S`). The same job again (a restart under ``--max-restarts``:
the same job id) takes its own lock over, so a resumed run is never refused by the run it resumes.

Example::

    lock = DirectoryLock("runs/exp")
    problem = lock.acquire()      # None: this process holds it; else the one line that refuses the job
    ...
    lock.release()                # only while the file still holds this process's token
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from ddpkit.checkpoint import confine
from ddpkit.checkpoint.disk import _alive, run_id
from ddpkit.core import process

LOCK = ".ddpkit-lock"
BEAT_S = 30.0  # how often the holder touches its lock, for the hosts that cannot check its pid
STALE_S = 120.0  # untouched this long, a lock of another host's job is that of a job that is gone


class DirectoryInUse(RuntimeError):
    """Another live job holds the checkpoint directory: raised on every rank at this job's first save."""


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc's field 22): a pid taken again by a new process after
    the holder died has another one. None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # the fields after the command name start at field 3
    except (OSError, IndexError):
        return None


def _identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start(os.getpid()),
            "job": run_id(), "since": time.time(), "token": uuid.uuid4().hex}


def read(directory: str) -> dict[str, Any] | None:
    """The lock's holder; None when there is no lock, or the file is no lock ddpkit wrote (taken over then)."""
    try:
        held = confine.read_json(directory, LOCK, limit=4096)
    except (OSError, ValueError):
        return None
    keys = {"host": str, "pid": int, "job": str, "token": str}
    ok = isinstance(held, dict) and all(type(held.get(k)) is t for k, t in keys.items())
    return held if ok else None


def live_holder(directory: str, held: dict[str, Any] | None) -> bool:
    """``held`` (a lock of ``directory``) belongs to a job that may still be running."""
    if held is None:
        return False
    if held["host"] == socket.gethostname():
        if not _alive(held["pid"]):
            return False
        now = _process_start(held["pid"])
        return not (now and held.get("start") and now != held["start"])  # the pid is another process's now
    try:  # another host: its pids mean nothing here, the holder's heartbeat does
        return time.time() - os.stat(os.path.join(directory, LOCK)).st_mtime < STALE_S
    except OSError:
        return False


def other_job(directory: str) -> dict[str, Any] | None:
    """The holder of ``directory``'s lock when it is another live job (its saves are in flight), else None."""
    held = read(directory)
    if held is None or held["job"] == run_id() or held["pid"] == os.getpid() and held["host"] == socket.gethostname():
        return None
    return held if live_holder(directory, held) else None


def refusal(directory: str, held: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"])) \
        if isinstance(held.get("since"), (int, float)) else "an unknown time"
    return (f"checkpoint directory {directory} is in use by another job (job {held['job']}, pid {held['pid']} on "
            f"{held['host']}, since {since}), and this job {run_id()} was about to save into it: two jobs in one "
            f"directory delete each other's checkpoints; pick another directory, or stop that job first (its lock "
            f"{os.path.join(directory, LOCK)} goes when it ends; one of a job that died is taken over)")


class DirectoryLock:
    """This process's hold on one directory's lock (rank 0's); see the module doc."""

    def __init__(self, directory: str):
        self.directory, self.path = directory, os.path.join(directory, LOCK)
        self.token: str | None = None
        self._stop = threading.Event()

    def acquire(self) -> str | None:
        """Take the lock (again: a no-op while held). None when this process holds it, else the refusal line."""
        if self.token is not None:
            return None
        mine = _identity()
        tmp = f"{self.path}.{os.getpid()}-{mine['token'][:8]}"
        try:
            return self._take(tmp, mine)
        except OSError:  # no lock where none can be written: the save itself then says what the disk refused
            return None
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def _take(self, tmp: str, mine: dict[str, Any]) -> str | None:
        with open(tmp, "w") as f:
            json.dump(mine, f)
        try:
            _create(tmp, self.path, mine)
        except FileExistsError:
            held = other_job(self.directory)
            if held is not None:
                return refusal(self.directory, held)
            os.replace(tmp, self.path)  # a dead job's, this job's own, or no lock ddpkit wrote: taken over
            now = read(self.directory)
            if now is not None and now["token"] != mine["token"]:  # another job took it over at the same moment
                return refusal(self.directory, now)
        self.token = mine["token"]
        self._stop.clear()
        threading.Thread(target=self._beat, name="ddpkit-checkpoint-lock", daemon=True).start()
        process.on_shutdown(_release_all, always=True)  # an exit, even after an uncaught exception, gives it back
        _HELD.add(self)
        return None

    def _beat(self) -> None:
        """Touch the lock now and then: hosts that cannot check this pid see the job alive by it."""
        while not self._stop.wait(BEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # a directory gone or unreachable for a while: the next beat tries again

    def release(self) -> None:
        """Give the lock back, if the file still holds this process's token (else another job took it over)."""
        token, self.token = self.token, None
        self._stop.set()
        _HELD.discard(self)
        if token is not None and (read(self.directory) or {}).get("token") == token:
            try:
                os.remove(self.path)
            except OSError:
                pass  # a lock left behind is a stale one: the next job takes it over


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
