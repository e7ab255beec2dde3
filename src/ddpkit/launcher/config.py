"""What a launch is: the validated :class:`LaunchConfig`, and what torchrun and the workers get from it.

A pipeline of pure steps, each testable on its own (the argv half is :mod:`ddpkit.commands.launch`)::

    argv --commands.launch.parse_args--> validated LaunchConfig
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

import dataclasses
import ipaddress
import os
import socket
import zlib
from collections.abc import Mapping

from ddpkit.core import contract
from ddpkit.core.errors import UsageError
from ddpkit.core.options import Device, choices
from ddpkit.launcher.console import parse_ranks
from ddpkit.strategies import table as strategy
from ddpkit.strategies.base import Strategy

LOOPBACK_BACKEND = "ddpkit-loopback"  # ddpkit.launcher.rendezvous.BACKEND, named here so argv stays torch-free
LOOPBACK_STATIC_BACKEND = "ddpkit-loopback-static"  # ddpkit.launcher.rendezvous.STATIC_BACKEND
LOOPBACK_ELASTIC_BACKEND = "ddpkit-loopback-c10d"  # ddpkit.launcher.rendezvous.ELASTIC_BACKEND

PROG = "ddpkit launch"
DEFAULT_MASTER_PORT = 29500  # torchrun's: node 0's port when a multi-node launch names none
DEFAULT_KEEP_LOGS = 20  # launch folders kept under LOG_DIR (launch and spawn alike)


class LaunchError(UsageError):
    """Bad launcher input; the message is one line that names what was received and what to do."""


def parse_count(value: str, name: str, minimum: int, fix: str = "") -> int:
    """``value`` as an integer >= ``minimum``; ``fix``: how to get what the user likely meant.

    >>> parse_count("3", "--keep-logs", 0)
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
    phase_window: int | None = None  # steps per window of the phase report (0: off); None: the workers' default
    # the mode itself, looked up once from ``mode`` (every question about it asks this object)
    strategy: Strategy = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            object.__setattr__(self, "strategy", strategy.get(self.mode))
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
    def one_device(self) -> bool:
        """A one-process mode short of the GPUs it needs (dp with < 2): the workers run single instead."""
        return not self.strategy.multi_process and self.gpus < self.strategy.min_gpus

    @property
    def loopback(self) -> bool:
        """One node with fixed ranks: ddpkit's loopback rendezvous, nothing listens beyond 127.0.0.1."""
        return self.max_nodes == 1 and not self.elastic

    @property
    def loopback_nodes(self) -> bool:
        """Several nodes with fixed ranks on this machine (a loopback ``--master-addr``): node 0's stores bind that
        address, and the workers' sockets loopback, as one node's do."""
        return self.max_nodes > 1 and not self.elastic and is_loopback(self.master_addr)

    @property
    def loopback_elastic(self) -> bool:
        """Elastic nodes on this machine (a loopback ``--rdzv-endpoint``): torch's c10d rendezvous with every store
        bound to loopback (:mod:`ddpkit.launcher.rendezvous`)."""
        return self.elastic and is_loopback((self.rdzv_endpoint or "").rpartition(":")[0].strip("[]"))

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


def is_loopback(host: str | None) -> bool:
    """``host`` names this machine's loopback only (127.0.0.0/8, ::1, ``localhost``): nothing beyond it need listen.

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("::1"), is_loopback("10.0.0.1")
    (True, True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface, and other machines may use it


def parse_seconds(value: str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise LaunchError(f"{name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise LaunchError(f"{name} must be > 0, got {seconds}")
    return seconds


def torchrun_argv(cfg: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """The ``torchrun`` arguments for a DDP launch.

    Single node: ddpkit's loopback rendezvous (:mod:`ddpkit.launcher.rendezvous`), whose store listens on 127.0.0.1
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
        backend = LOOPBACK_ELASTIC_BACKEND if cfg.loopback_elastic else "c10d"
        argv += ["--nnodes", f"{cfg.min_nodes or cfg.max_nodes}:{cfg.max_nodes}", "--rdzv-backend", backend,
                 "--rdzv-endpoint", cfg.rdzv_endpoint or "", "--rdzv-id", cfg.rdzv_id, "--rdzv-conf", conf]
    elif cfg.loopback:
        argv += ["--rdzv-backend", LOOPBACK_BACKEND, "--rdzv-endpoint", f"127.0.0.1:{cfg.master_port or 0}",
                 "--rdzv-id", f"ddpkit-{os.getpid()}"]
    elif cfg.loopback_nodes:  # torch's static rendezvous, its store bound to the loopback address (rank: its conf)
        argv += ["--nnodes", str(cfg.max_nodes), "--rdzv-backend", LOOPBACK_STATIC_BACKEND,
                 "--rdzv-endpoint", f"{_host(cfg.master_addr)}:{cfg.node0_port}",
                 "--rdzv-conf", f"rank={cfg.node_rank}", "--rdzv-id", cfg.rdzv_id]
    else:
        argv += ["--nnodes", str(cfg.max_nodes), "--node-rank", str(cfg.node_rank),
                 "--master-addr", cfg.master_addr or "127.0.0.1", "--master-port", str(cfg.node0_port)]
    if cfg.module:
        argv += ["--module"]
    return argv + [cfg.script, *cfg.script_args]


def _host(addr: str | None) -> str:
    return f"[{addr}]" if addr and ":" in addr else addr or "127.0.0.1"  # an IPv6 address in HOST:PORT


def _loopback_ifname() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in ("lo", "lo0") if name in names), None)


LOOPBACK_IFNAME = _loopback_ifname()


def hash_seed(rdzv_id: str) -> str:
    """The ``PYTHONHASHSEED`` every worker of a run gets when none is set: one value from the run's id, so that
    every node's launcher gives the same.

    >>> hash_seed("ddpkit") == hash_seed("ddpkit") != hash_seed("other")
    True
    """
    return str(zlib.crc32(rdzv_id.encode()) % 4294967295 + 1)


def worker_env(cfg: LaunchConfig, environ: Mapping[str, str], cores: int) -> tuple[dict[str, str], list[str]]:
    """Variables to add for the workers, and a note for each one the user did not set.

    OMP_NUM_THREADS: cores shared among the local processes, so N processes do not oversubscribe the CPU.
    DDPKIT_MODE: tells ``ddpkit.init()`` in the script which mode the launch asked for (``single`` for
    ``--mode dp`` with fewer than 2 GPUs: the launcher says so once, up front).
    DDPKIT_DEVICE (``--device``): ``cpu`` keeps the workers on the CPU whatever GPUs exist.
    DDPKIT_LAUNCHER_PID: a worker whose parent is no longer this process exits (orphan guard).
    TORCH_CPP_LOG_LEVEL=ERROR (unless ``--verbose``): torch's C++ warnings stay off the console.
    DDPKIT_RESUME=1 (``--resume``): ``ddpkit.Checkpointer`` restores the newest valid checkpoint.
    DDPKIT_PHASE_WINDOW (``--phase-window N``): steps per window of the per-rank phase report; 0 turns it off.
    PYTHONUNBUFFERED=1 (DDP, when unset): worker output goes through log files and must not sit in buffers.
    PYTHONHASHSEED (DDP, when unset): one value on every worker of every node, derived from ``--rdzv-id``: each
    process would draw its own, and a set of strings iterated to number classes or tags (a sequence-labelling
    tutorial's tag map) would then differ between ranks.
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=lo (single node, a loopback --master-addr or --rdzv-endpoint, when
    unset): the workers' own listening sockets bind loopback too, whatever the host name resolves to.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (multi-node restarts, not on loopback): with the agent's store shared,
    restarted groups failed to form in 5 of 11 tries here (gloo "Connection refused", pytorch#135712); unshared, 9
    of 9 succeeded. (Loopback needs no such switch: its rendezvous makes a new store each round.)
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
    if multi and contract.HASH_SEED.name not in environ:  # (every node derives the same from the run's id)
        env[contract.HASH_SEED.name] = hash_seed(cfg.rdzv_id)
    if cfg.resume:
        env[contract.RESUME.name] = "1"
    if cfg.phase_window is not None:
        env[contract.PHASE_WINDOW.name] = str(cfg.phase_window)
    if (cfg.loopback or cfg.loopback_nodes or cfg.loopback_elastic) and multi and LOOPBACK_IFNAME:
        for name in (contract.GLOO_IFNAME.name, contract.NCCL_IFNAME.name):
            if name not in environ:
                env[name] = LOOPBACK_IFNAME
    # (a loopback rendezvous makes a new store each round itself, and its workers must use it: unshared, rank 0's
    # worker would serve one on every interface)
    if (cfg.max_nodes > 1 or cfg.elastic) and cfg.max_restarts > 0 and not cfg.loopback_elastic:
        env.setdefault(contract.UNSHARED_STORE.name, environ.get(contract.UNSHARED_STORE.name, "1"))
    notes = []
    if contract.OMP_THREADS.name not in environ:
        env[contract.OMP_THREADS.name] = str(max(1, cores // local))
        notes.append(f"OMP_NUM_THREADS={env[contract.OMP_THREADS.name]} ({cores} cores / {local} local processes; "
                     "set it to override)")
    return env, notes
