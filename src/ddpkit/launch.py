"""``ddpkit launch``: a thin front end over torch's elastic launcher (``torch.distributed.run``).

A pipeline of pure steps, each testable on its own::

    argv --parse_args--> Namespace --LaunchConfig(...)--> validated config
         --torchrun_argv / worker_env--> what torchrun gets --supervise.run--> exit code

Example::

    ddpkit launch --nproc-per-node 2 examples/digits.py --epochs 3
    ddpkit launch --mode dp train.py            # one process, DataParallel over every GPU
    ddpkit launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py
    ddpkit launch --nnodes 1:4 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 --max-restarts 3 train.py

Flags are spelled as torchrun spells them. Bad arguments exit with code 2 and one line, before anything
is spawned.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from ddpkit import contract, strategy
from ddpkit.cli import OneLineParser, UsageError, usage_error
from ddpkit.environment import usable_cores, visible_gpus
from ddpkit.logs import parse_ranks
from ddpkit.options import Device, choices

LOOPBACK_BACKEND = "ddpkit-loopback"  # ddpkit.rendezvous.BACKEND, named here so argv stays torch-free

PROG = "ddpkit launch"
DEFAULT_MASTER_PORT = 29500  # torchrun's: node 0's port when a multi-node launch names none
DEFAULT_KEEP_LOGS = 20  # launch folders kept under LOG_DIR (launch and spawn alike)


class LaunchError(UsageError):
    """Bad launcher input; the message is one line that names what was received and what to do."""


def _count(value: str, name: str, minimum: int, fix: str = "") -> int:
    """``value`` as an integer >= ``minimum``; ``fix``: how to get what the user likely meant.

    >>> _count("3", "--keep-logs", 0)
    3
    """
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise LaunchError(f"{name} must be >= {minimum}, got {number}" + (f"; {fix}" if fix else ""))
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
    max_nodes: int = 1  # --nnodes N, or MAX of --nnodes MIN:MAX
    min_nodes: int | None = None  # MIN of --nnodes MIN:MAX; None: exactly nnodes
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # set: torch's elastic c10d rendezvous instead of fixed node ranks
    rdzv_id: str = "ddpkit"
    rdzv_conf: str = ""
    master_addr: str | None = None
    master_port: int | None = None
    mode: str = "ddp"
    device: str | None = None  # auto | cpu | cuda; None: the environment's DDPKIT_DEVICE, else auto
    gpus: int = 0  # GPUs the workers may use (0 with --device cpu)
    verbose: bool = False
    max_restarts: int = 0
    module: bool = False
    resume: bool = False
    log_dir: str = os.path.join("runs", "logs")
    console_ranks: str = "0"
    keep_logs: int = DEFAULT_KEEP_LOGS  # launch folders kept under log_dir (0: all)
    join_timeout_s: float = 600.0

    def __post_init__(self):
        try:
            strategy.get(self.mode)
        except ValueError as exc:
            raise LaunchError(f"--{exc}") from None
        if self.device not in (None, *choices(Device)):
            raise LaunchError(f"--device {self.device!r} is not one of {', '.join(choices(Device))}; pass one of them")
        if self.device == "cuda" and self.gpus == 0:
            raise LaunchError("--device cuda, but no CUDA GPU is visible; check nvidia-smi or pass --device cpu")
        if not self.module and not os.path.isfile(self.script):
            raise LaunchError(f"script {self.script!r} not found (cwd {os.getcwd()}); pass the path of a .py file")
        if self.nproc_per_node < 1 or self.max_nodes < 1:
            raise LaunchError(f"--nproc-per-node and --nnodes must be >= 1, got {self.nproc_per_node} and "
                              f"{self.max_nodes}")
        if not 0 <= self.node_rank < self.max_nodes:
            raise LaunchError(f"--node-rank must be in [0, {self.max_nodes - 1}] for --nnodes {self.max_nodes}, "
                              f"got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.elastic:
            self._check_elastic()
        elif self.min_nodes not in (None, self.max_nodes):
            raise LaunchError(f"--nnodes {self.min_nodes}:{self.max_nodes} (a range) needs --rdzv-endpoint HOST:PORT "
                              f"on every node; for a fixed count use --nnodes {self.max_nodes} --master-addr")
        elif self.max_nodes > 1 and not self.master_addr:
            raise LaunchError(f"--nnodes {self.max_nodes} needs --master-addr (the address of node 0) on every node")
        try:
            parse_ranks(self.console_ranks, self.world_size)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        if not self.strategy.multi_process and (self.max_nodes > 1 or self.nproc_per_node > 1):
            raise LaunchError(f"--mode {self.mode} runs one process on one node ({self.strategy.title} drives every "
                              "device from it); drop --nproc-per-node/--nnodes or use --mode ddp")
        self._check_gpus()

    def _check_gpus(self) -> None:
        """Every local process of a multi-process mode on a GPU needs its own: with fewer, several ranks take
        cuda:0 and NCCL fails at the first collective ("Duplicate GPU detected")."""
        n = self.nproc_per_node
        if self.strategy.multi_process and self.device_type == "cuda" and self.gpus < n:
            asked = "--device cuda with " if self.device == "cuda" else ""
            raise LaunchError(f"{asked}{n} processes per node need {n} GPUs (one each: NCCL cannot share one between "
                              f"ranks), {self.gpus} usable; pass --nproc-per-node {self.gpus} or --device cpu")

    def _check_elastic(self) -> None:
        host, _, port = (self.rdzv_endpoint or "").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {self.rdzv_endpoint!r}")
        if not 1 <= (self.min_nodes or self.max_nodes) <= self.max_nodes:
            raise LaunchError(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}")
        if self.master_addr or self.node_rank:
            raise LaunchError("--rdzv-endpoint assigns node ranks itself; drop --master-addr/--node-rank "
                              "(or drop --rdzv-endpoint for fixed node ranks)")

    @property
    def strategy(self) -> strategy.Strategy:
        return strategy.get(self.mode)

    @property
    def one_device(self) -> bool:
        """A one-process mode short of the GPUs it needs (dp with < 2): the workers run single instead."""
        return not self.strategy.multi_process and self.gpus < self.strategy.min_gpus

    @property
    def loopback(self) -> bool:
        """One node with fixed ranks: ddpkit's loopback rendezvous, nothing listens beyond 127.0.0.1."""
        return self.max_nodes == 1 and not self.elastic

    @property
    def elastic(self) -> bool:
        """torch's c10d rendezvous: nodes get their rank on joining, and MIN..MAX of them may take part."""
        return self.rdzv_endpoint is not None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.max_nodes

    @property
    def device_type(self) -> str:
        """Where the workers run: ``cuda`` when GPUs are usable and not refused with ``--device cpu``."""
        return "cuda" if self.device != "cpu" and self.gpus > 0 else "cpu"

    @property
    def node0_port(self) -> int:
        """Node 0's port in a fixed-rank multi-node launch: ``--master-port``, else torchrun's 29500."""
        return self.master_port or DEFAULT_MASTER_PORT


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG,
                      description="Run a training script as N data-parallel processes (torchrun underneath).")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="processes on this node: N, gpu, cpu or auto (default 1)")
    p.add_argument("--nnodes", default="1", help="number of nodes (default 1), or MIN:MAX with --rdzv-endpoint")
    p.add_argument("--node-rank", "--node_rank", default="0", help="index of this node, 0..nnodes-1")
    p.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0 (multi-node)")
    p.add_argument("--master-port", "--master_port", default=None,
                   help="port on node 0; single-node default: a free port the store binds itself")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="HOST:PORT of torch's elastic (c10d) rendezvous; nodes get their rank on joining")
    p.add_argument("--rdzv-id", "--rdzv_id", default="ddpkit", help="job id, the same on every node (elastic)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="torch rendezvous settings, e.g. last_call_timeout=5,join_timeout=600 (elastic)")
    p.add_argument("--mode", default=None,
                   help="ddp (one process per device, the default) or dp (one process, DataParallel); "
                        "default: DDPKIT_MODE when set")
    p.add_argument("--device", default=None,
                   help="auto (GPUs if any), cpu (gloo, whatever GPUs exist) or cuda; default: DDPKIT_DEVICE or auto")
    p.add_argument("--verbose", action="store_true",
                   help="also show torch's own launcher and C++ log lines (otherwise in LOG_DIR/launcher.log)")
    p.add_argument("--max-restarts", "--max_restarts", default="0", help="restart the group this many times on failure")
    p.add_argument("--resume", action="store_true",
                   help="ddpkit.Checkpointer restores the newest valid checkpoint (sets DDPKIT_RESUME=1)")
    p.add_argument("--log-dir", default=os.path.join("runs", "logs"),
                   help="per-rank stdout/stderr files go under LOG_DIR/<time>-<pid>/ (default runs/logs)")
    p.add_argument("--keep-logs", default=str(DEFAULT_KEEP_LOGS),
                   help="keep the newest N launch folders ddpkit made under LOG_DIR, remove older ones (0: keep all; "
                        "default 20)")
    p.add_argument("--console-ranks", default="0", help="ranks shown on the console: 0 (default), 0,2 or all")
    p.add_argument("--join-timeout", default="600",
                   help="multi-node: seconds to wait for every node to join before failing (default 600)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def parse_args(argv: Sequence[str], gpus: int | None = None, cpus: int | None = None,
               environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """argv (without the program name) -> validated :class:`LaunchConfig`; raises :class:`LaunchError`.

    ``environ`` (default ``os.environ``) supplies DDPKIT_MODE / DDPKIT_DEVICE when the flags are absent.
    """
    ns = build_parser().parse_args(list(argv))
    environ = os.environ if environ is None else environ
    mode = _flag_or_env(ns.mode, "--mode", contract.MODE.name, environ)
    mode = "ddp" if mode in (None, "auto") else mode
    device = _flag_or_env(ns.device, "--device", contract.DEVICE.name, environ)
    if gpus is None:
        gpus = visible_gpus() if device != "cpu" else 0
    gpus = 0 if device == "cpu" else gpus
    nproc = resolve_nproc(ns.nproc_per_node, gpus, cpus or usable_cores())
    port = None if ns.master_port is None else _count(ns.master_port, "--master-port", 1)
    low, _, high = ns.nnodes.partition(":")
    return LaunchConfig(
        script=ns.script, script_args=tuple(ns.script_args), nproc_per_node=nproc,
        max_nodes=_count(high or low, "--nnodes", 1), min_nodes=_count(low, "--nnodes", 1) if high else None,
        node_rank=_count(ns.node_rank, "--node-rank", 0), rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id,
        rdzv_conf=ns.rdzv_conf, master_addr=ns.master_addr, master_port=port, mode=mode, device=device, gpus=gpus,
        verbose=ns.verbose, max_restarts=_count(ns.max_restarts, "--max-restarts", 0), module=ns.module,
        resume=ns.resume, log_dir=ns.log_dir, console_ranks=ns.console_ranks,
        keep_logs=_count(ns.keep_logs, "--keep-logs", 0, "pass 0 to keep every log folder"),
        join_timeout_s=_seconds(ns.join_timeout, "--join-timeout"))


def _flag_or_env(flag: str | None, flag_name: str, var: str, environ: Mapping[str, str]) -> str | None:
    """The flag's value, else the variable's; a flag that contradicts the variable is refused, not hidden.

    >>> _flag_or_env(None, "--mode", "DDPKIT_MODE", {"DDPKIT_MODE": "dp"}), _flag_or_env("ddp", "--mode", "X", {})
    ('dp', 'ddp')
    """
    value = environ.get(var) or None
    if flag is not None and value is not None and flag != value:
        raise LaunchError(f"{flag_name} {flag} contradicts {var}={value} in the environment; unset {var} or drop "
                          f"{flag_name}")
    return flag if flag is not None else value


def _seconds(value: str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise LaunchError(f"{name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise LaunchError(f"{name} must be > 0, got {seconds}")
    return seconds


def torchrun_argv(cfg: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """The ``torchrun`` arguments for a DDP launch.

    Single node: ddpkit's loopback rendezvous (:mod:`ddpkit.rendezvous`), whose store listens on 127.0.0.1
    only, on ``--master-port`` or else on a free port it binds itself (no find-then-bind race, never a
    taken 29500). With ``log_dir``, every worker's stdout and stderr go to files there (and only there: the
    console tail decides what to show).
    """
    argv = ["--nproc-per-node", str(cfg.nproc_per_node), "--max-restarts", str(cfg.max_restarts)]
    if log_dir:
        argv += ["--log-dir", log_dir, "--redirects", "3"]
    if cfg.elastic:
        conf = cfg.rdzv_conf if "join_timeout" in cfg.rdzv_conf else \
            ",".join(filter(None, [cfg.rdzv_conf, f"join_timeout={cfg.join_timeout_s:g}"]))
        argv += ["--nnodes", f"{cfg.min_nodes or cfg.max_nodes}:{cfg.max_nodes}", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", cfg.rdzv_endpoint or "", "--rdzv-id", cfg.rdzv_id, "--rdzv-conf", conf]
    elif cfg.loopback:
        argv += ["--rdzv-backend", LOOPBACK_BACKEND, "--rdzv-endpoint", f"127.0.0.1:{cfg.master_port or 0}",
                 "--rdzv-id", f"ddpkit-{os.getpid()}"]
    else:
        argv += ["--nnodes", str(cfg.max_nodes), "--node-rank", str(cfg.node_rank),
                 "--master-addr", cfg.master_addr or "127.0.0.1", "--master-port", str(cfg.node0_port)]
    if cfg.module:
        argv += ["--module"]
    return argv + [cfg.script, *cfg.script_args]


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in ("lo", "lo0") if name in names), None)


LOOPBACK_IFNAME = _loopback_ifname()


def worker_env(cfg: LaunchConfig, environ: Mapping[str, str], cores: int) -> tuple[dict[str, str], list[str]]:
    """Variables to add for the workers, and a note for each one the user did not set.

    OMP_NUM_THREADS: cores shared among the local processes, so N processes do not oversubscribe the CPU.
    DDPKIT_MODE: tells ``ddpkit.init()`` in the script which mode the launch asked for (``single`` for
    ``--mode dp`` with fewer than 2 GPUs: the launcher says so once, up front).
    DDPKIT_DEVICE (``--device``): ``cpu`` keeps the workers on the CPU whatever GPUs exist.
    DDPKIT_LAUNCHER_PID: a worker whose parent is no longer this process exits (orphan guard).
    TORCH_CPP_LOG_LEVEL=ERROR (unless ``--verbose``): torch's C++ warnings stay off the console.
    DDPKIT_RESUME=1 (``--resume``): ``ddpkit.Checkpointer`` restores the newest valid checkpoint.
    PYTHONUNBUFFERED=1 (DDP, when unset): worker output goes through log files and must not sit in buffers.
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo (single node, when unset): the workers' own listening
    sockets bind loopback too, whatever the host name resolves to.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (multi-node restarts): with the agent's store shared, restarted
    groups failed to form in 5 of 11 tries here (gloo "Connection refused", pytorch#135712); unshared, 9 of
    9 succeeded. (Single node needs no such switch: the loopback rendezvous makes a new store each round.)
    """
    multi = cfg.strategy.multi_process
    local = cfg.nproc_per_node if multi else 1
    env = {contract.MODE.name: "single" if cfg.one_device else cfg.mode,
           contract.LAUNCHER_PID.name: str(os.getpid())}
    if cfg.device:
        env[contract.DEVICE.name] = cfg.device
    if not cfg.verbose and contract.CPP_LOG_LEVEL.name not in environ:
        env[contract.CPP_LOG_LEVEL.name] = "ERROR"  # no C++ store warnings while nodes join or leave
    if multi and contract.UNBUFFERED.name not in environ:
        env[contract.UNBUFFERED.name] = "1"  # output goes to log files; without this, prints would wait for exit
    if cfg.resume:
        env[contract.RESUME.name] = "1"
    if cfg.loopback and multi and LOOPBACK_IFNAME:
        for name in (contract.GLOO_IFNAME.name, contract.NCCL_IFNAME.name):
            if name not in environ:
                env[name] = LOOPBACK_IFNAME
    if (cfg.max_nodes > 1 or cfg.elastic) and cfg.max_restarts > 0:
        env.setdefault(contract.UNSHARED_STORE.name, environ.get(contract.UNSHARED_STORE.name, "1"))
    notes = []
    if contract.OMP_THREADS.name not in environ:
        env[contract.OMP_THREADS.name] = str(max(1, cores // local))
        notes.append(f"OMP_NUM_THREADS={env[contract.OMP_THREADS.name]} ({cores} cores / {local} local processes; "
                     "set it to override)")
    return env, notes


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddpkit launch``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not build_parser().parse_args(argv).verbose:
            # read once when torch loads (parse_args may load it): quiet from the first line on
            os.environ.setdefault(contract.CPP_LOG_LEVEL.name, "ERROR")
        cfg = parse_args(argv)
        from ddpkit import supervise

        return supervise.run(cfg)
    except UsageError as exc:  # LaunchError, and argparse's own complaints
        return usage_error(PROG, exc)
    except KeyboardInterrupt:  # Ctrl-C while torch loads: once workers run, torch's agent turns it into a stop
        print(f"{PROG}: stopped by signal SIGINT before any worker started", file=sys.stderr, flush=True)
        return 128 + 2
