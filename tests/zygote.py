"""Warm workers: the ranks torch's elastic agent starts are forked from a clean interpreter, as the agent's children.

:mod:`warm` forks the launcher (``ddpkit launch``, ``torchrun``) from a server that imported torch once, but the
ranks the launcher's agent starts used to be real ``exec``s: 2-3 s of a core each to import torch, most of the
suite's time. They cannot be forked from the server (their parent must be the launcher: ddpkit's worker asks the
kernel to kill it when its launcher dies and checks ``getppid()``), nor from the agent (by then it has threads,
a store, logging set up). So every warm-forked command that runs torch's agent (``-m ddpkit``, ``-m
torch.distributed.run``: :func:`runs_an_agent`) first forks a *zygote*, a copy of the server's clean state. The
agent's ``Popen`` of a rank asks the zygote, which forks a middle process that forks the rank and exits; the
launcher is a child subreaper (``PR_SET_CHILD_SUBREAPER``) only while it waits for that answer, so the orphaned
rank is handed to it before the zygote answers with its pid. So the rank's parent is the launcher, as after an
``exec``; the agent waits for it, signals its session and reaps it with the ``Popen`` it got. The rank then
becomes its command as a warm-forked command does (streams, directory, environment, signals, seeds:
``warm.child``), with the launcher's umask, niceness, CPU affinity and resource limits and the interpreter's
own ``sys.executable``.

Only what :func:`warm.warmable` accepts is forked (the interpreter, ``-u``, a script or ``-m``, and no start-up
variable that differs from the server's); anything else, a zygote that is gone, a fork of the launcher (not the
process the zygote answers), or ``DDPKIT_TEST_WARM=0`` is an ``exec`` as ever. Linux only; elsewhere nothing
changes. What a test could see: the zygote is one more child of the launcher (it ignores SIGUSR1, which a
rank's hang report sends to its siblings), and every rank of one pytest process has the same string-hash
secret (a set of strings iterates in the same order on every rank; a test about that sets ``PYTHONHASHSEED``,
which makes its command cold).

Example (what ``warm.child`` does in each command it forks)::

    worker = zygote.start(lambda argv, env: warm.warmable(argv, env, server_env))
    if worker is not None:          # this process is a rank the agent asked for
        request, fds = worker
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_MAX = 1 << 20


def start(accepts):
    """Fork the zygote; in this process install the agent's ``Popen`` of ranks and return None. In a rank the
    zygote forked later, return ``(request, fds)``: its command and its stdin/stdout/stderr."""
    if not sys.platform.startswith("linux"):
        return None
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid:
        theirs.close()
        _install(mine, accepts)
        return None
    mine.close()
    return _serve(theirs)


def runs_an_agent(argv: list[str]) -> bool:
    """Commands whose process runs torch's elastic agent: only they get a zygote (a child of their own).

    >>> runs_an_agent(["python", "-u", "-m", "ddpkit", "launch", "t.py"]), runs_an_agent(["python", "t.py"])
    (True, False)
    """
    args = [a for a in argv[1:] if a not in ("-u", "-B")]
    return args[:1] == ["-m"] and len(args) > 1 and args[1] in ("ddpkit", "torch.distributed.run")


def _serve(sock: socket.socket):
    """The zygote: fork a rank for each request until its launcher's end closes; in a rank, return its request."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # dies with it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a rank's hang report signals the launcher's children
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the launcher's streams stay the launcher's: its reader waits for their end
        os.dup2(null, fd)
    os.close(null)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX, 3)
        except OSError:
            os._exit(0)
        if not msg:
            os._exit(0)
        size = struct.unpack("!I", msg[:4])[0]
        while len(msg) < 4 + size:
            msg += sock.recv(_MAX)
        request = json.loads(msg[4:4 + size])
        pid = _fork_orphan()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            return request, fds
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"pid": pid} if pid else {}).encode() + b"\n")


def _fork_orphan() -> int | None:
    """Fork a process whose parent is the launcher (the subreaper): its pid here, 0 in it, None on failure.

    The middle process forks it and exits; the zygote answers only after reaping the middle one, so the rank is
    the launcher's child by the time the launcher waits for it (a wait before that would find no such child)."""
    read, write = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        return None
    if middle == 0:
        os.close(read)
        me = os.getpid()
        try:
            rank = os.fork()
        except OSError:
            os._exit(1)
        if rank:
            os.write(write, str(rank).encode())
            os._exit(0)
        os.close(write)
        while os.getppid() == me:  # until the middle process is gone and the launcher adopted this one
            time.sleep(0.001)
        return 0
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        got = answer.read()
    os.waitpid(middle, 0)
    return int(got) if got else None


def _install(sock: socket.socket, accepts) -> None:
    """The agent's ``Popen`` of a rank (torch's ``SubprocessHandler._popen``) asks the zygote first."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return
    lock = threading.Lock()
    owner = os.getpid()  # a fork of this process (an agent in a multiprocessing child) is no subreaper: it execs

    class ZygotePopen(subprocess.Popen):
        """A ``Popen`` whose child the zygote forked; wait, poll, signals and returncode are Popen's own."""

        def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                           creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                           restore_signals, gid, gids, uid, umask, start_new_session, *rest):
            plain = not (preexec_fn or pass_fds or shell or executable or gid or gids or uid or umask != -1
                         or any(r not in (None, -1) for r in rest))
            argv, env = [str(a) for a in args], dict(env if env is not None else os.environ)
            pid = _ask(sock, lock, argv, env, cwd, start_new_session, (p2cread, c2pwrite, errwrite)) \
                if plain and os.getpid() == owner and accepts(argv, env) else None
            if pid is None:
                return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                              startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                              c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                                              start_new_session, *rest)
            self.pid, self._child_created = pid, True
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def popen(handler, args, env):
        return ZygotePopen(args=args, env=env, stdout=handler._stdout, stderr=handler._stderr,
                           start_new_session=True)

    subprocess_handler.SubprocessHandler._popen = popen


def _ask(sock, lock, argv, env, cwd, session, handles) -> int | None:
    """The zygote's pid for this rank, or None (it is gone): the caller then execs as ever."""
    fds = [handle if handle != -1 else target for target, handle in enumerate(handles)]
    body = json.dumps({"argv": argv, "env": env, "cwd": os.fspath(cwd) if cwd else os.getcwd(),
                       "session": bool(session), **_attributes()}).encode()
    libc = ctypes.CDLL(None, use_errno=True)
    with lock:
        # a subreaper only while the rank is handed over: an orphan of a rank later goes to init, as ever
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return None
        try:
            socket.send_fds(sock, [struct.pack("!I", len(body)) + body], fds)
            line = b""
            while not line.endswith(b"\n"):
                got = sock.recv(1)
                if not got:
                    return None
                line += got
        except OSError:
            return None
        finally:
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    return json.loads(line).get("pid")


_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NPROC",
           "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_MEMLOCK")


def _attributes() -> dict:
    """What an exec'd child inherits from the launcher and a fork of the zygote would not: the launcher may have
    changed them after the zygote was made."""
    mask = os.umask(0)
    os.umask(mask)
    return {"umask": mask, "nice": os.getpriority(os.PRIO_PROCESS, 0), "affinity": sorted(os.sched_getaffinity(0)),
            "limits": {name: resource.getrlimit(getattr(resource, name)) for name in _LIMITS}}


def take_attributes(request: dict) -> None:
    """In a rank: the launcher's umask, niceness, CPU affinity and resource limits."""
    os.umask(request["umask"])
    if request["nice"] > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    os.sched_setaffinity(0, request["affinity"])
    for name, limit in request["limits"].items():
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(getattr(resource, name), tuple(limit))
