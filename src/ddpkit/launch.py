"""``ddpkit launch``: a thin front end over torch's elastic launcher (``torch.distributed.run``).

A pipeline of pure steps, each testable on its own::

    argv --parse_args--> Namespace --LaunchConfig(...)--> validated config
         --torchrun_argv / worker_env--> what torchrun gets --run--> exit code

Example::

    ddpkit launch --nproc-per-node 2 examples/digits.py --epochs 3
    ddpkit launch --mode dp train.py            # one process, DataParallel over every GPU
    ddpkit launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py

Flags are spelled as torchrun spells them. Bad arguments exit with code 2 and one line, before anything
is spawned.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from ddpkit import faults
from ddpkit.logs import ConsoleTail, parse_ranks
from ddpkit.preflight import check_nodes

USAGE_ERROR = 2
PROG = "ddpkit launch"


class LaunchError(ValueError):
    """Bad launcher input; the message is one line that names what was received and what to do."""


def _count(value: str, name: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise LaunchError(f"{name} must be >= {minimum}, got {number}")
    return number


def resolve_nproc(value: str, gpus: int, cpus: int) -> int:
    """``N``, ``gpu`` (every visible GPU), ``cpu`` (every core) or ``auto`` (GPUs if any, else cores).

    >>> resolve_nproc("auto", gpus=0, cpus=8), resolve_nproc("3", gpus=0, cpus=8)
    (8, 3)
    """
    if value in ("auto", "gpu", "cpu"):
        if value == "gpu" and gpus == 0:
            raise LaunchError("--nproc-per-node gpu, but no CUDA GPU is visible; give a number or 'cpu'")
        return gpus if value in ("gpu", "auto") and gpus > 0 else cpus
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"--nproc-per-node must be a positive integer or auto|gpu|cpu, got {value!r}") from None
    if number < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {number}; pass 1 or more processes per node")
    return number


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Everything a launch needs, checked on construction."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    mode: str = "ddp"
    max_restarts: int = 0
    module: bool = False
    resume: bool = False
    log_dir: str = os.path.join("runs", "logs")
    console_ranks: str = "0"
    join_timeout: float = 600.0

    def __post_init__(self):
        if self.mode not in ("ddp", "dp"):
            raise LaunchError(f"--mode must be ddp or dp, got {self.mode!r}")
        if not self.module and not os.path.isfile(self.script):
            raise LaunchError(f"script {self.script!r} not found (cwd {os.getcwd()}); pass the path of a .py file")
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise LaunchError(f"--nproc-per-node and --nnodes must be >= 1, got {self.nproc_per_node} and {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes {self.nnodes}, "
                              f"got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.nnodes > 1 and not self.master_addr:
            raise LaunchError(f"--nnodes {self.nnodes} needs --master-addr (the address of node 0) on every node")
        try:
            parse_ranks(self.console_ranks, self.world_size)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        if self.mode == "dp" and (self.nnodes > 1 or self.nproc_per_node > 1):
            raise LaunchError("--mode dp runs one process on one node (DataParallel drives every GPU from it); "
                              "drop --nproc-per-node/--nnodes or use --mode ddp")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`LaunchError` (one line, exit 2) instead of printing the whole usage."""

    def error(self, message: str):
        raise LaunchError(message)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Run a training script as N data-parallel processes (torchrun underneath).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="processes on this node: N, gpu, cpu or auto (default 1)")
    p.add_argument("--nnodes", default="1", help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", default="0", help="index of this node, 0..nnodes-1")
    p.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (multi-node)")
    p.add_argument("--master-port", "--master_port", default=None,
                   help="port on node 0; single-node default: a free port the store binds itself")
    p.add_argument("--mode", default="ddp", help="ddp (one process per device) or dp (one process, DataParallel)")
    p.add_argument("--max-restarts", "--max_restarts", default="0", help="restart the group this many times on failure")
    p.add_argument("--resume", action="store_true",
                   help="ddpkit.Checkpointer restores the newest valid checkpoint (sets DDPKIT_RESUME=1)")
    p.add_argument("--log-dir", default=os.path.join("runs", "logs"),
                   help="per-rank stdout/stderr files go under LOG_DIR/<time>-<pid>/ (default runs/logs)")
    p.add_argument("--console-ranks", default="0", help="ranks shown on the console: 0 (default), 0,2 or all")
    p.add_argument("--join-timeout", default="600",
                   help="multi-node: seconds to wait for every node to join before failing (default 600)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def parse_args(argv: Sequence[str], gpus: int | None = None, cpus: int | None = None) -> LaunchConfig:
    """argv (without the program name) -> validated :class:`LaunchConfig`; raises :class:`LaunchError`."""
    ns = build_parser().parse_args(list(argv))
    if gpus is None:
        gpus = _visible_gpus()
    nproc = resolve_nproc(ns.nproc_per_node, gpus, cpus or os.cpu_count() or 1)
    port = None if ns.master_port is None else _count(ns.master_port, "--master-port", 1)
    return LaunchConfig(
        script=ns.script, script_args=tuple(ns.script_args), nproc_per_node=nproc,
        nnodes=_count(ns.nnodes, "--nnodes", 1), node_rank=_count(ns.node_rank, "--node-rank", 0),
        master_addr=ns.master_addr, master_port=port, mode=ns.mode,
        max_restarts=_count(ns.max_restarts, "--max-restarts", 0), module=ns.module, resume=ns.resume,
        log_dir=ns.log_dir, console_ranks=ns.console_ranks, join_timeout=_seconds(ns.join_timeout, "--join-timeout"))


def _seconds(value: str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise LaunchError(f"{name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise LaunchError(f"{name} must be > 0, got {seconds}")
    return seconds


def _visible_gpus() -> int:
    import torch  # the launcher needs torch anyway; imported only once arguments parse

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_argv(cfg: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """The ``torchrun`` arguments for a DDP launch.

    Single node without ``--master-port``: c10d rendezvous on ``localhost:0``, so the store binds a free
    port itself (no find-then-bind race, never a taken 29500). With ``log_dir``, every worker's stdout and
    stderr go to files there (and only there: the console tail decides what to show).
    """
    argv = ["--nproc-per-node", str(cfg.nproc_per_node), "--max-restarts", str(cfg.max_restarts)]
    if log_dir:
        argv += ["--log-dir", log_dir, "--redirects", "3"]
    if cfg.nnodes == 1 and cfg.master_port is None:
        argv += ["--standalone"]
    else:
        argv += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank),
                 "--master-addr", cfg.master_addr or "127.0.0.1", "--master-port", str(cfg.master_port or 29500)]
    if cfg.module:
        argv += ["--module"]
    return argv + [cfg.script, *cfg.script_args]


def worker_env(cfg: LaunchConfig, environ: Mapping[str, str], cores: int) -> tuple[dict[str, str], list[str]]:
    """Variables to add for the workers, and a note for each one the user did not set.

    OMP_NUM_THREADS: cores shared among the local processes, so N processes do not oversubscribe the CPU.
    DDPKIT_MODE: tells ``ddpkit.init()`` in the script which mode the launch asked for.
    DDPKIT_RESUME=1 (``--resume``): ``ddpkit.Checkpointer`` restores the newest valid checkpoint.
    PYTHONUNBUFFERED=1 (DDP, when unset): worker output goes through log files and must not sit in buffers.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's store shared, restarted groups failed to form in
    5 of 11 tries here (gloo "Connection refused", pytorch#135712); unshared, 9 of 9 succeeded.
    """
    local = 1 if cfg.mode == "dp" else cfg.nproc_per_node
    env = {"DDPKIT_MODE": cfg.mode}
    if cfg.mode == "ddp" and "PYTHONUNBUFFERED" not in environ:
        env["PYTHONUNBUFFERED"] = "1"  # output goes to log files; without this, prints would wait for exit
    if cfg.resume:
        env["DDPKIT_RESUME"] = "1"
    if cfg.max_restarts > 0:
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"))
    notes = []
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(max(1, cores // local))
        notes.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} ({cores} cores / {local} local processes; "
                     "set it to override)")
    return env, notes


def run(cfg: LaunchConfig) -> int:
    """Start the workers and wait for them; returns the exit code for the launcher.

    Exit codes: 0 success, 1 a worker failed (one summary: rank, host, exception, traceback), 2 bad
    arguments, 3 a collective timed out (hang report), 128 + N when the launcher got signal N.
    """
    report_dir = tempfile.mkdtemp(prefix="ddpkit-report-")
    try:
        code = _run_workers(cfg, report_dir)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    return code


def _run_workers(cfg: LaunchConfig, report_dir: str) -> int:
    env, notes = worker_env(cfg, os.environ, os.cpu_count() or 1)
    env["DDPKIT_REPORT_DIR"] = report_dir
    os.environ.update(env)  # inherited by the workers torchrun spawns
    what = ("1 process (DataParallel)" if cfg.mode == "dp"
            else f"{cfg.nproc_per_node} process(es) x {cfg.nnodes} node(s), world size {cfg.world_size}")
    print(f"{PROG}: " + "; ".join([what, *notes]), file=sys.stderr, flush=True)
    if cfg.mode == "dp":
        cmd = [sys.executable] + (["-m"] if cfg.module else []) + [cfg.script, *cfg.script_args]
        return subprocess.call(cmd)
    if cfg.nnodes > 1:
        problem = check_nodes(cfg, cfg.join_timeout)
        if problem:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return USAGE_ERROR
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    log_dir = os.path.join(cfg.log_dir, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    os.makedirs(log_dir, exist_ok=True)
    print(f"{PROG}: per-rank logs in {log_dir}", file=sys.stderr, flush=True)
    tail = ConsoleTail(log_dir, parse_ranks(cfg.console_ranks, cfg.world_size),
                       cfg.node_rank * cfg.nproc_per_node, cfg.world_size)
    tail.start()
    try:
        torchrun(get_args_parser().parse_args(torchrun_argv(cfg, log_dir)))
    except ChildFailedError as exc:
        tail.stop()
        code, text = failure_report(exc, report_dir)
        print(text, file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        tail.stop()
        print(f"{PROG}: stopped by signal {exc.sigval.name}; workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        tail.stop()
    return 0


def failure_report(exc, report_dir: str) -> tuple[int, str]:
    """(exit code, text) for a failed run: ddpkit's report of the last attempt, else torch's failure."""
    crashed = {rank: _how(failure) for rank, failure in exc.failures.items()}
    attempts = sorted((d for d in os.listdir(report_dir) if d.startswith("attempt")), key=lambda d: int(d[7:]))
    report = faults.summarize(os.path.join(report_dir, attempts[-1]), crashed) if attempts else None
    if report is not None:
        return report
    rank, failure = exc.get_first_failure()
    return faults.EXIT_WORKER_FAILED, (f"{PROG}: rank {rank} (pid {failure.pid}) {_how(failure)}, without a Python "
                                       "exception (a crash, os._exit, or a script that never called ddpkit.init)")


def _how(failure) -> str:
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddpkit launch``; returns the exit code."""
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    return run(cfg)
