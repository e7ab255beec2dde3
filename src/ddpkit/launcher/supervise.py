"""Running a launch: workers under torch's elastic agent, the console tail, and one report when they fail.

:func:`run` takes the :class:`~ddpkit.launcher.config.LaunchConfig` that ``ddpkit launch`` built from its arguments
(the pure steps are in :mod:`ddpkit.launcher.config`), exports the worker variables, checks the port or the other
nodes, and hands the workers to ``torch.distributed.run``. torch's own launcher log lines go to
``LOG_DIR/launcher.log`` (the console shows ddpkit's lines and the script's), and a failure becomes one
report (:func:`ddpkit.launcher.diagnosis.report`).

Example::

    from ddpkit.launcher import supervise
    code = supervise.run(cfg)   # cfg: a LaunchConfig (``ddpkit launch`` parses its argv into one)
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from ddpkit.core import contract, reports
from ddpkit.core.environment import usable_cores
from ddpkit.core.errors import SCRIPT_FAILED, USAGE_ERROR
from ddpkit.launcher import diagnosis, phase_report
from ddpkit.launcher.config import PROG, LaunchConfig, torchrun_argv, worker_env
from ddpkit.launcher.console import ConsoleTail, new_run_dir, parse_ranks, release
from ddpkit.launcher.preflight import check_nodes
from ddpkit.runtime import faults


def run(cfg: LaunchConfig) -> int:
    """Start the workers and wait for them; returns the exit code for the launcher.

    Exit codes: 0 success, 1 a worker failed (one summary: rank, host, exception, traceback), 2 bad
    arguments, 3 a collective timed out (hang report), 128 + N when the launcher got signal N.
    """
    # as a container's PID 1 the launcher gets no signal it has no handler for: SIGTERM would be dropped until
    # torch's agent installs its own (the pre-flight can wait minutes for other nodes before that)
    saved = signal.signal(signal.SIGTERM, _stop)
    try:
        with worker_environment(cfg) as (report_dir, notes):
            return _run_workers(cfg, report_dir, notes)
    except _Stopped as stop:
        print(f"{PROG}: stopped by signal {signal.Signals(stop.signum).name} before any worker started",
              file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        signal.signal(signal.SIGTERM, saved)


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise _Stopped(signum)


@contextlib.contextmanager
def worker_environment(cfg: LaunchConfig) -> Iterator[tuple[str, list[str]]]:
    """This process's environment with the workers' contract added (they inherit it: torch's launcher starts
    them from here), and a report directory; on exit the caller gets its own environment back.

    Only workers under torch's agent are told the report directory: the one child of ``--mode dp`` / single has
    no report and no console filter, so its excepthook stays Python's (a plain traceback).
    """
    report_dir = tempfile.mkdtemp(prefix="ddpkit-report-")
    saved = dict(os.environ)
    env, notes = worker_env(cfg, os.environ, usable_cores())
    if cfg.strategy.multi_process:
        env[contract.REPORT_DIR.name] = report_dir
    else:  # its phase report only
        env[contract.PHASE_DIR.name] = report_dir
    try:
        os.environ.update(env)
        yield report_dir, notes
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


def _run_workers(cfg: LaunchConfig, report_dir: str, notes: list[str]) -> int:
    nodes = f"{cfg.min_nodes}..{cfg.max_nodes}" if cfg.min_nodes not in (None, cfg.max_nodes) else str(cfg.max_nodes)
    if cfg.one_device:
        what = (f"1 process: --mode {cfg.mode} needs >= {cfg.strategy.min_gpus} GPUs and {cfg.gpus} are usable, "
                "so it runs on one device")
    elif not cfg.strategy.multi_process:
        what = f"1 process ({cfg.strategy.title})"
    else:
        what = f"{cfg.nproc_per_node} process(es) x {nodes} node(s), world size up to {cfg.world_size}"
    print(f"{PROG}: " + "; ".join([what, *notes]), file=sys.stderr, flush=True)
    if not cfg.strategy.multi_process:
        code = run_one([sys.executable] + (["-m"] if cfg.module else []) + [cfg.script, *cfg.script_args])
        if code == 0 and os.path.exists(os.path.join(report_dir, phase_report.NAME)):  # its one-row table
            log_dir = new_run_dir(cfg.log_dir, cfg.keep_logs)
            _say_phases(report_dir, log_dir)
            release(log_dir)
        return code
    if cfg.max_nodes > 1 and not cfg.elastic:  # elastic: torch's rendezvous has its own join_timeout
        problem = check_nodes(cfg, cfg.join_timeout_s)
    elif cfg.loopback and cfg.master_port:
        problem = _loopback_port_problem(cfg.master_port)
    else:
        problem = None
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return USAGE_ERROR
    return _supervise(cfg, report_dir)


_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_one(cmd: list[str]) -> int:
    """The one process of ``--mode dp`` / single: it never outlives the launcher, and gets its signals.

    SIGTERM and SIGHUP (and a SIGINT that was not a terminal's Ctrl-C, which reaches the child itself) are
    passed on, the launcher waits for the child and exits 128 + N as the DDP path does. The child asks the
    kernel to SIGKILL it should the launcher die (the workers under torch's agent do the same).
    """
    launcher, got = os.getpid(), []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        got.append(signum)
        if child is not None and not (signum == signal.SIGINT and _terminal_sent_it()):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    saved = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        child = subprocess.Popen(cmd, preexec_fn=lambda: faults.die_with_parent(launcher))
        if got:  # a signal came while the child was being started
            child.send_signal(got[0])
        code = child.wait()  # resumed after each handler (PEP 475)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if got:
        print(f"{PROG}: stopped by signal {signal.Signals(got[0]).name}; the worker was stopped",
              file=sys.stderr, flush=True)
        return 128 + got[0]
    return code


def _terminal_sent_it() -> bool:
    """True when this process group is its terminal's foreground group: a Ctrl-C went to the child too."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal
        return False


def _loopback_port_problem(port: int) -> str | None:
    """A one-line error when ``port`` cannot be bound on 127.0.0.1 (checked before anything is spawned)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            return (f"--master-port {port} is not free on 127.0.0.1 ({exc.strerror}); pick a free port or drop "
                    "--master-port (a free one is then chosen)")
    return None


def torchrun_args(argv: list[str]):
    """torch's launcher parser over ``argv``, options taken by their whole names only: with torch's prefix
    matching, a script's own ``--n 3`` or ``--nproc 2`` after its path was read as an abbreviation of the
    launcher's options and stopped the launch ("ambiguous option: --n could match --nnodes, ...").

    >>> torchrun_args(["--nproc-per-node", "1", "train.py", "--n", "3"]).training_script_args
    ['--n', '3']
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False
    return parser.parse_args(argv)


def _supervise(cfg: LaunchConfig, report_dir: str) -> int:
    """torch's launcher runs the workers; the console tail shows them; a failure becomes one report."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from ddpkit.launcher import rendezvous
    rendezvous.register()

    log_dir = new_run_dir(cfg.log_dir, cfg.keep_logs)
    print(f"{PROG}: per-rank logs in {log_dir}", file=sys.stderr, flush=True)
    # elastic: this node's rank is known only after the rendezvous, so the console counts from its first rank
    tail = ConsoleTail(log_dir, parse_ranks(cfg.console_ranks, cfg.world_size),
                       0 if cfg.elastic else cfg.node_rank * cfg.nproc_per_node, cfg.nproc_per_node,
                       reports.block_tag(report_dir))
    tail.start()
    restarts = RestartNotice(tail.say, None if cfg.elastic else tail.first_rank, cfg.max_restarts)
    try:
        with torch_logs(os.path.join(log_dir, "launcher.log"), cfg.verbose, restarts):
            torchrun(torchrun_args(torchrun_argv(cfg, log_dir)))
    except ChildFailedError as exc:
        tail.stop()
        _say_phases(report_dir, log_dir)
        _say_restarts(report_dir, log_dir, restarts.causes)
        first = first_local_rank(exc, tail.first_rank)
        code, text = failure_report(exc, report_dir, stderr_tails(log_dir, first), stderr_times(log_dir, first))
        print(text, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        tail.stop()
        print(stopped(exc.sigval, report_dir), file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        tail.stop()
        release(log_dir)  # the run is over: a later launch may rotate its folder out
    _say_phases(report_dir, log_dir)
    _say_restarts(report_dir, log_dir, restarts.causes)
    if warning := no_group_warning(cfg, report_dir):
        print(warning, file=sys.stderr, flush=True)
    return 0


def _say_phases(report_dir: str, log_dir: str) -> None:
    if text := phase_report.summary(report_dir, log_dir):
        print(text, file=sys.stderr, flush=True)


def stopped(sig: signal.Signals, report_dir: str) -> str:
    """The launcher's last words when a signal stopped the run; after a Ctrl-C, where each rank stood (the
    agent passes SIGINT on, and every worker past ``ddpkit.init()`` dumps its stacks on it)."""
    text = f"{PROG}: stopped by signal {sig.name}; workers were stopped"
    attempts = sorted((d for d in os.listdir(report_dir) if d.startswith("attempt")), key=lambda d: int(d[7:]))
    if sig != signal.SIGINT or not attempts:
        return text
    lines = diagnosis.stands(os.path.join(report_dir, attempts[-1]))
    return "\n".join([f"{text}; where each rank was:", *lines]) if lines else text


def no_group_warning(cfg: LaunchConfig, report_dir: str) -> str | None:
    """A line when N processes finished and none called ``ddpkit.init()``: N copies of the script each ran
    the whole job alone, which exits 0 and looks like success. A script that forms its own group with
    torch.distributed (its text says init_process_group) is not warned about."""
    n = cfg.nproc_per_node
    if n < 2 or glob.glob(os.path.join(report_dir, "attempt*", "stack-rank*.txt")):
        return None
    if not cfg.module:
        with contextlib.suppress(OSError), open(cfg.script, encoding="utf-8", errors="replace") as f:
            if "init_process_group" in f.read():
                return None
    return (f"{PROG}: warning: {n} processes ran and exited 0, and none called ddpkit.init(): each ran the whole "
            f"script on its own ({n} independent copies, no process group); call state = ddpkit.init() at the "
            "start of the script")


class RestartNotice(logging.Handler):
    """torch's agent logs each failed attempt of this node's workers ("failed (exitcode: C) local_rank: L ...");
    one that a restart follows is said on the console at once (launcher.log has the rest).

    ``first_rank``: the global rank of local rank 0 (None: elastic, known only after the rendezvous).
    """

    def __init__(self, say, first_rank: int | None, max_restarts: int):
        super().__init__(logging.ERROR)
        self.say, self.first_rank, self.max_restarts, self.failed = say, first_rank, max_restarts, 0
        self.causes: dict[int, str] = {}  # attempt -> who failed in it, as torch's agent saw it

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if not str(record.msg).startswith("failed (exitcode: ") or len(args) < 2:
            return
        self.failed += 1
        if self.failed > self.max_restarts:
            return  # the last attempt: the failure report follows
        code, local = int(str(args[0])), int(str(args[1]))
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        who = f"local rank {local}" if self.first_rank is None else f"rank {self.first_rank + local}"
        self.causes[self.failed - 1] = f"{who} {how}"
        self.say(f"{PROG}: {who} {how}; restarting: attempt {self.failed + 1} of {self.max_restarts + 1}")


def _say_restarts(report_dir: str, log_dir: str, causes: dict[int, str]) -> None:
    for line in restarted_attempts(report_dir, log_dir, causes):
        print(line, file=sys.stderr, flush=True)


def restarted_attempts(report_dir: str, log_dir: str, causes: dict[int, str] | None = None) -> list[str]:
    """One line for each attempt a restart followed (every attempt but the last): its first failure, and the
    log that keeps its traceback (the report of a recovered failure is never printed otherwise). ``causes``:
    attempt -> the rank torch's agent saw fail (``rank 1 killed by SIGKILL``), for an attempt whose only
    exceptions are its peers' consequences.

    Example line: ``ddpkit launch: attempt 1 failed (rank 1 raised ValueError: bad batch; its traceback:
    runs/logs/<run>/attempt_0/1/stderr.log); restarted``
    """
    folders = {int(os.path.basename(p)[8:]): p for p in glob.glob(os.path.join(log_dir, "*", "attempt_*"))}
    lines, causes = [], causes or {}
    for attempt in sorted(folders)[:-1]:
        errors = diagnosis.records(os.path.join(report_dir, f"attempt{attempt}"))
        own = [e for e in errors if not reports.peer_lost(e["message"])]
        if not own and attempt in causes:
            what = f"{causes[attempt]}; the logs: {folders[attempt]}"
        elif own := own or errors:
            first = min(own, key=lambda e: e["time"])
            what = (f"rank {first['rank']} raised {diagnosis.said(first, first_line=True)}; its traceback: "
                    f"{os.path.join(folders[attempt], str(first['local_rank']), 'stderr.log')}")
        else:
            what = f"no rank raised a Python exception; the logs: {folders[attempt]}"
        # counted from 1, as the restart notice counts them (torch's folders count from 0)
        lines.append(f"{PROG}: attempt {attempt + 1} failed ({what}); restarted")
    return lines


@contextlib.contextmanager
def torch_logs(path: str, verbose: bool, *extra: logging.Handler):
    """torch's launcher log lines (W/E ... api.py: "failed (exitcode ...)", "Sending closing signal") go to
    ``path`` instead of the console, which shows ddpkit's lines and the script's; ``--verbose`` keeps both.
    ``extra`` handlers see them too."""
    logger = logging.getLogger("torch.distributed")  # torch gives it its own stderr handler
    saved = logger.handlers[:]
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.handlers = (saved if verbose else []) + [handler, *extra]
    try:
        yield
    finally:
        logger.handlers = saved
        handler.close()


def stderr_tails(log_dir: str, first_rank: int, size: int = 8192) -> dict[int, str]:
    """The end of each local worker's stderr in its newest attempt, by global rank."""
    tails: dict[int, str] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stderr.log")),
                       key=lambda p: int(p.split("attempt_")[1].split(os.sep)[0])):
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            tails[first_rank + int(os.path.basename(os.path.dirname(path)))] = f.read().decode("utf-8", "replace")
    return tails


def stderr_times(log_dir: str, first_rank: int) -> dict[int, float]:
    """When each local worker last wrote to its stderr in its newest attempt, by global rank: when it stopped,
    to a precision torch's failure timestamps (whole seconds) lack."""
    times: dict[int, float] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "stderr.log")),
                       key=lambda p: int(p.split("attempt_")[1].split(os.sep)[0])):
        times[first_rank + int(os.path.basename(os.path.dirname(path)))] = os.path.getmtime(path)
    return times


def first_local_rank(exc, default: int) -> int:
    """The global rank of this node's local rank 0, from a failure (elastic: known only after the rendezvous).

    Failures are keyed by global rank, the log folders by local rank: without this, every node of an elastic
    launch but the first would read no stderr tail for its failed ranks.
    """
    return next((rank - failure.local_rank for rank, failure in exc.failures.items()), default)


def failure_report(exc, report_dir: str, tails: dict[int, str] | None = None,
                   times: dict[int, float] | None = None) -> tuple[int, str]:
    """(exit code, text) for a failed run: ddpkit's report of the last attempt, else torch's failure."""
    crashed = {rank: _how(failure) for rank, failure in exc.failures.items()}
    attempts = sorted((d for d in os.listdir(report_dir) if d.startswith("attempt")), key=lambda d: int(d[7:]))
    # killed by a signal after the final barrier: a teardown abort (an exit code is the script's own answer)
    signalled = all(failure.exitcode < 0 for failure in exc.failures.values())
    if attempts and signalled and diagnosis.finished(os.path.join(report_dir, attempts[-1]), crashed):
        how = ", ".join(f"rank {rank} {text}" for rank, text in sorted(crashed.items()))
        return 0, (f"{PROG}: {how}, after every rank had passed the final barrier (in interpreter teardown: "
                   "gloo's destructor, the pytorch#56297 family); the work was done, so the run counts as finished")
    # a local rank torch does not list exited 0 before the failure (the agent stops at the first failure)
    crashed.update({rank: "exited with code 0" for rank in (tails or {}) if rank not in crashed})
    # no attempt folder: no rank reached ddpkit.init(); their stderr tails may still hold a traceback
    report = diagnosis.report(os.path.join(report_dir, attempts[-1]) if attempts else report_dir, crashed, tails,
                              times)
    if report is not None:
        return report
    rank, failure = exc.get_first_failure()
    return SCRIPT_FAILED, (f"{PROG}: rank {rank} (pid {failure.pid}) {_how(failure)}, without a Python "
                                       "exception (a crash, os._exit, or a script that never called ddpkit.init)")


def _how(failure) -> str:
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
