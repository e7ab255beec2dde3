"""Warm interpreters for the processes the suite starts: a server that imported torch once forks each one.

Most of a test's launch used to be interpreters importing torch (2-3 s each on a 2-core machine): the launcher
of ``ddpkit launch``, a one-process reference run, ``ddpkit verify``'s own process. :func:`run` hands such a
command to a server (started once per pytest process, torch and ddpkit's launcher imported) that forks it: the
child takes the command's stdin/stdout/stderr, working directory, environment, argv and a session of its own,
reseeds what a fresh interpreter seeds at random (torch's default generator, numpy's, ``random``), and runs
the script or module as ``python`` would (``__main__``, ``sys.argv``, ``sys.path[0]``, exit code, atexit).
The ranks torch's elastic agent starts in such a command (``ddpkit launch``, ``torchrun``) are forked too, from a
zygote the command forked first, so that they are the agent's children as after an ``exec`` (tests/zygote.py).

Known differences, none of which a test here depends on: every forked process of one pytest process has the
same string-hash secret (a set of strings iterates in the same order on every rank; a test about that sets
``PYTHONHASHSEED``, which makes its command cold); a forked process leaves as the interpreter does (threads,
atexit, standard streams) but without tearing its modules down (~1 s of a core each), so a file a script left
open and unflushed would lose its buffer; and ``-m`` of a missing module names the shim, not the interpreter.

A command is forked only where forking cannot change what it does; :func:`warmable` says which: the
interpreter is ``sys.executable``, the options are ``-u``/``-B`` then ``-m mod``, ``-c code`` or a script, and
no variable read at interpreter or torch start-up (``PYTHON*``, thread counts, allocators, devices) differs
from the server's. Anything else, and ``DDPKIT_TEST_WARM=0``, runs as a plain subprocess.

Example (what ``conftest.run_cmd`` does)::

    done = warm.run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "train.py"],
                    env=env, cwd=tmp, timeout=180)   # None: not warmable, run it with Popen
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import zygote

# What the server imports once: what ddpkit's launcher and a one-process run import anyway.
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.distributed.elastic.multiprocessing",
            "numpy", "ddpkit", "ddpkit.commands.cli", "ddpkit.launcher.supervise", "ddpkit.runtime.group",
            "ddpkit.data.loader", "ddpkit.strategies.ddp", "tqdm",
            # what a rank imports in ddpkit.init() and prepare_model (torch.compiler.disable imports dynamo: ~2 s)
            "ddpkit.strategies.ddp_wrapper", "ddpkit.runtime.phases", "torch._dynamo")
# Read when an interpreter or torch starts: a command that sets them otherwise than the server runs cold.
# (NCCL_* is read when a communicator is made, well after the fork: ddpkit's launcher sets NCCL_SOCKET_IFNAME.)
_STARTUP_VARS = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC", "CUDA_", "KMP_", "GOMP_", "TORCH_CUDA",
                 "PYTORCH_CUDA", "LOGLEVEL", "LANG", "LC_",
                 # read when dynamo is imported (the server preloads it)
                 "TORCH_COMPILE", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_LOGS")
_MAX = 1 << 20
_PYTHON = sys.executable  # the interpreter itself (a forked child's sys.executable is the shim)


def warmable(cmd: list[str], env: dict[str, str], server_env: dict[str, str]) -> bool:
    """True where forking ``cmd`` from the server runs what ``exec`` would.

    >>> warmable([sys.executable, "-u", "-m", "ddpkit", "launch"], {"A": "1"}, {"A": "2"})
    True
    >>> warmable([sys.executable, "-X", "dev", "t.py"], {}, {}), warmable(["python3", "t.py"], {}, {})
    (False, False)
    >>> warmable([sys.executable, "t.py"], {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "1"})
    False
    """
    if not cmd or cmd[0] != sys.executable or "0" in (os.environ.get("DDPKIT_TEST_WARM"), env.get("DDPKIT_TEST_WARM")):
        return False
    args = cmd[1:]
    while args and args[0] in ("-u", "-B"):
        args = args[1:]
    if not args or (args[0].startswith("-") and (args[0] not in ("-m", "-c") or len(args) < 2)):
        return False
    keys = {k for k in (*env, *server_env) if k.startswith(_STARTUP_VARS)}
    return all(env.get(k) == server_env.get(k) for k in keys)


# --- the client side (the pytest process) ---------------------------------------------------------------------

_server: dict = {}
_starting = threading.Lock()  # two threads' first commands (a test's thread pool) start one server


def run(cmd: list[str], env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess | None:
    """Run ``cmd`` forked from the warm server; None where it is not :func:`warmable` (run it cold).

    Returns a CompletedProcess as ``Popen.communicate`` gives one (text, returncode -N for a signal); raises
    ``subprocess.TimeoutExpired`` (its session killed first, output kept) after ``timeout`` seconds.
    """
    with _starting:
        if not _server:
            _start()
    if not _server.get("sock") or not cmd or cmd[0] != sys.executable:
        return None
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        conn.connect(_server["sock"])
        _send(conn, {"argv": cmd, "env": env, "cwd": str(cwd)}, [null, out_w, err_w])
        first = _reply(conn)
    except OSError:  # the server is gone: the command runs cold
        first = {}
    finally:
        for fd in (null, out_w, err_w):  # the child holds its own copies
            os.close(fd)
    if "pid" not in first:  # not warmable: the server sent nothing on
        for fd in (out_r, err_r):
            os.close(fd)
        conn.close()
        return None
    return _wait(cmd, conn, first["pid"], out_r, err_r, timeout)


def _send(conn: socket.socket, request: dict, fds: list[int]) -> None:
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)


def _reply(conn: socket.socket) -> dict:
    line = b""
    while not line.endswith(b"\n"):
        got = conn.recv(1)
        if not got:
            return {}
        line += got
    return json.loads(line)


def _wait(cmd, conn, pid, out_r, err_r, timeout):
    """Collect both streams and the child's status (a ``{"status": ..}`` line)."""
    sel = selectors.DefaultSelector()
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    for fd in (out_r, err_r, conn.fileno()):
        sel.register(fd, selectors.EVENT_READ)
    replies, status, killed = b"", None, False
    deadline = time.monotonic() + timeout
    while len(sel.get_map()) > 1 or status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            if killed:
                break
            _kill(pid)
            killed, deadline = True, time.monotonic() + 30
            continue
        for key, _ in sel.select(left):
            if key.fd == conn.fileno():
                data = conn.recv(65536)
                replies += data
                *lines, replies = replies.split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    status = msg.get("status", status)
                if not data:
                    sel.unregister(key.fd)
                    status = -signal.SIGKILL if status is None else status  # the server went away
                continue
            data = os.read(key.fd, 65536)
            if data:
                chunks[key.fd].append(data)
            else:
                sel.unregister(key.fd)
    sel.close()
    conn.close()
    out, err = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
    os.close(out_r)
    os.close(err_r)
    if killed:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, status, out, err)


def _text(data: bytes) -> str:
    """Bytes as ``Popen(text=True)`` reads them: the locale's encoding, strict, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _start() -> None:
    """The server for this pytest process, with the environment every test command starts from
    (``conftest.run_cmd``'s, without any one test's additions)."""
    _server["sock"] = None
    if os.environ.get("DDPKIT_TEST_WARM") == "0":
        return
    folder = tempfile.mkdtemp(prefix="ddpkit-warm-")
    atexit.register(shutil.rmtree, folder, True)
    sock = os.path.join(folder, "sock")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(folder, "server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, sock], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log)
    if proc.stdout.readline().strip() == b"ready":
        _server.update(sock=sock, proc=proc)


# --- the server side -----------------------------------------------------------------------------------------

def serve(path: str, server_env: dict[str, str]):
    """Accept commands until stdin closes (the pytest process ended); in a forked child, return its request.

    A command that is not :func:`warmable` is answered ``{}`` (its sender runs it cold); a sender that goes
    away before its child ended (a shim killed with SIGKILL) takes the child's session with it.
    """
    shim = _write_shim(os.path.join(os.path.dirname(path), "python"), path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(0.05):
            if key.fd == sys.stdin.fileno():
                if not os.read(key.fd, 1024):
                    for pid in children:
                        _kill(pid)
                    return None
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                try:  # a sender that died half-way, or a fork that failed, is that sender's problem only
                    request, fds = _receive(conn)
                except (OSError, ValueError, struct.error):
                    conn.close()
                    continue
                if not warmable(request["argv"], request["env"], server_env):
                    for fd in fds:
                        os.close(fd)
                    with contextlib.suppress(OSError):
                        conn.sendall(b"{}\n")
                    conn.close()
                    continue
                try:
                    pid = os.fork()
                except OSError:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                if pid == 0:
                    sel.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    return request, fds, conn, shim, server_env
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                children[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            else:  # a sender's end closed (or sent something): its child goes with it
                sel.unregister(key.fileobj)
                _kill(key.data)
        _reap(children, sel)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, fds, _, _ = socket.recv_fds(conn, _MAX, 3)
    size = struct.unpack("!I", msg[:4])[0]
    while len(msg) < 4 + size:
        msg += conn.recv(_MAX)
    return json.loads(msg[4:4 + size]), fds


def _reap(children: dict[int, socket.socket], sel: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(conn)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall(json.dumps({"status": code}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


_SHIM = """#!{python} -IS
# What the warm server's children see as sys.executable: a command is forked from the server where it can be,
# a worker under torch's agent (its parent must be the agent) and anything else is an exec of the interpreter.
import json, os, signal, socket, struct, sys
PYTHON, SOCK = {python!r}, {sock!r}
argv = [PYTHON, *sys.argv[1:]]
reply = {{}}
if "TORCHELASTIC_RUN_ID" not in os.environ:
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(SOCK)
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # inherited: the child keeps it
        body = json.dumps({{"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                           "sigint_ignored": ignored}}).encode()
        socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
        replies = conn.makefile("rb")
        reply = json.loads(replies.readline() or b"{{}}")
    except (OSError, ValueError):
        reply = {{}}
if "pid" not in reply:
    os.execv(PYTHON, argv)
def forward(signum, frame):
    try:  # the child leads a session of its own: what it started is in its group
        os.killpg(reply["pid"], signum)
    except OSError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
line = replies.readline()
status = json.loads(line)["status"] if line else -signal.SIGKILL
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
os._exit(status)
"""


def _write_shim(path: str, sock: str) -> str:
    with open(path, "w") as f:
        f.write(_SHIM.format(python=sys.executable, sock=sock))
    os.chmod(path, 0o755)
    return path


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def child(request: dict, fds: list[int], conn: socket.socket, shim: str, server_env: dict[str, str]) -> int:
    """Become the command: its session, streams, directory, environment, seeds; then run it as python does.
    What it starts with ``sys.executable`` goes through ``shim``: forked from the server too where it can be;
    the ranks torch's agent starts in it are forked from a zygote forked here first (tests/zygote.py)."""
    conn.close()
    sys.executable = shim
    _streams(fds, session=True)
    worker = zygote.start(lambda argv, env: warmable(argv, env, server_env)) \
        if zygote.runs_an_agent(request["argv"]) else None
    if worker is not None:  # this process is a rank the command's agent asked the zygote for
        request, fds = worker
        _streams(fds, session=request["session"])
        zygote.take_attributes(request)
        sys.executable = _PYTHON  # what a rank's own subprocesses start is an exec, as it was before the zygote
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # (found again from TMPDIR, as a fresh interpreter does: the server's may be cached)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("sigint_ignored") else signal.default_int_handler)
    options = request["argv"][1:3]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or "-u" in options
    encoding, errors = sys.stdout.encoding, sys.stdout.errors  # what this interpreter's locale gave its streams
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding, errors=errors)
    sys.stdout = sys.__stdout__ = _stream(1, unbuffered, False, encoding, errors)
    sys.stderr = sys.__stderr__ = _stream(2, unbuffered, True, encoding, "backslashreplace")
    sys.orig_argv = [sys.executable, *request["argv"][1:]]
    if "multiprocessing.process" in sys.modules:  # where a spawned child finds a script named relatively
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.getcwd()
    _reseed()
    return _run_python(request["argv"][1:])


def _streams(fds: list[int], session: bool) -> None:
    """A session of its own (as ``start_new_session``), and ``fds`` as stdin, stdout and stderr."""
    if session:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)


def _stream(fd: int, unbuffered: bool, line: bool, encoding: str, errors: str) -> io.TextIOWrapper:
    """A standard stream as the interpreter opens it on a pipe (``-u``: no buffer at all; stderr: by line)."""
    raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115 (the process's own stream)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding, errors=errors,
                            write_through=unbuffered, line_buffering=line)


def _reseed() -> None:
    """What a fresh interpreter draws at random (``random`` reseeds itself after a fork)."""
    import torch

    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run_python(argv: list[str]) -> int:
    """``python [-u] (-m mod | -c code | script) args``, in a new ``__main__`` as the interpreter makes one."""
    import importlib.machinery
    import runpy
    import types

    while argv[0] in ("-u", "-B"):
        argv = argv[1:]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            path = os.path.abspath(argv[0])  # the interpreter makes __main__'s file absolute (3.9+)
            sys.path[0] = os.path.dirname(path)
            try:
                with open(path, "rb") as f:
                    source = f.read()
            except OSError as exc:
                print(f"{_PYTHON}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
                      file=sys.stderr)
                return 2
            main.__dict__.update(__file__=path, __cached__=None, __spec__=None, __package__=None,
                                 __loader__=importlib.machinery.SourceFileLoader("__main__", path))
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as stop:
        return _exit_code(stop.code)
    except BaseException as exc:
        # the traceback starts at the script's frame, as the interpreter's does (not in this function)
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        # as the interpreter's PyErr_Print: atexit code reads them to tell a failed script (ddpkit's shutdown)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc.with_traceback(tb), tb
        sys.excepthook(type(exc), exc, tb)
        # the interpreter ends itself with SIGINT then, once threads and atexit are done (_exit)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _exit(code: int) -> None:
    """Leave as the interpreter does (wait for threads, run atexit, flush the standard streams) but without
    tearing down torch's modules and heap: ~1 s of a core per process, and a forked one copies each page it
    frees. A file a command left open and unflushed would lose its buffer: none of the suite's scripts does."""
    import threading as threads

    threads._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    import importlib

    started_with = dict(os.environ)  # before the imports: inductor's import sets TORCHINDUCTOR_CACHE_DIR
    for name in _PRELOAD:
        importlib.import_module(name)
    forked = serve(sys.argv[1], started_with)
    if forked is None:
        sys.exit(0)
    _exit(child(*forked))
