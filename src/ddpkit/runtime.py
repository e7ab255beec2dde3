"""The process group: pick a mode, a device and a backend, start torch.distributed, and stop it cleanly.

One process and N processes run the same code: with one process no group is created and every
collective ddpkit offers is the identity, so a script has no ``if distributed:`` branches.

Example::

    import ddpkit
    state = ddpkit.init()          # reads how the script was launched
    print(state.rank, state.world_size, state.device, state.mode)
    ...
    ddpkit.shutdown()              # optional: registered with atexit by init()
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import random
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit import faults
from ddpkit.environment import LaunchEnvError, ProcessEnv, detect

MODES = ("auto", "ddp", "dp", "single")
# Collectives that wait longer than this fail (and `ddpkit launch` prints a hang report). torch's defaults
# are 30 min for gloo and 10 min for NCCL: long enough to lose an evening on a job that hangs at start-up.
DEFAULT_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class State:
    """What this process is: its place in the job (torch's names), its device, and the parallel mode.

    ``mode`` is ``ddp`` (one process per device, gradients all-reduced), ``dp`` (this one process drives
    every visible GPU through ``torch.nn.DataParallel``) or ``single``.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str | None
    mode: str
    reason: str

    @property
    def is_main(self) -> bool:
        """True on the one process (global rank 0) that should print, log and write files."""
        return self.rank == 0


def choose_mode(requested: str, env: ProcessEnv, cuda_count: int) -> tuple[str, str]:
    """Resolve ``auto`` and check an explicit mode against the launch. Returns (mode, why).

    >>> choose_mode("auto", ProcessEnv(), cuda_count=0)
    ('single', 'one process and no GPU: single-device training')
    """
    if requested not in MODES:
        raise ValueError(f"mode {requested!r} is not one of {', '.join(MODES)}; pass mode='auto' or omit it")
    procs = f"{env.world_size} processes started by {env.source}"
    if env.distributed:
        if requested in ("dp", "single"):
            raise LaunchEnvError(
                f"mode {requested!r} runs one process, but {procs}; "
                f"use mode 'ddp' or start the script once (ddpkit launch --mode dp / plain python)")
        return "ddp", f"{procs}: DistributedDataParallel"
    if requested == "ddp":
        return "single", ("mode 'ddp' asked for, but only one process runs: single-device training "
                          "(start N processes with `ddpkit launch --nproc-per-node N script.py`)")
    if requested in ("auto", "dp") and cuda_count >= 2:
        return "dp", (f"one process and {cuda_count} GPUs visible: DataParallel over all of them "
                      "(DDP is faster: `ddpkit launch --nproc-per-node gpu script.py`)")
    if requested == "dp":
        return "single", f"mode 'dp' asked for, but {cuda_count} GPU(s) visible (DataParallel needs >= 2): single device"
    return "single", f"one process and {'one GPU' if cuda_count == 1 else 'no GPU'}: single-device training"


def choose_device(mode: str, env: ProcessEnv, cuda_count: int, cpu: bool) -> torch.device:
    """``cuda:<local_rank>`` for DDP on GPUs (never another rank's GPU), ``cuda:0`` for dp/single, else cpu."""
    if cpu or cuda_count == 0:
        return torch.device("cpu")
    if mode == "ddp":
        if env.local_rank >= cuda_count:
            raise LaunchEnvError(
                f"local rank {env.local_rank} has no GPU of its own: {cuda_count} visible; start at most "
                f"{cuda_count} processes per node (--nproc-per-node {cuda_count}) or pass cpu=True")
        return torch.device("cuda", env.local_rank)
    return torch.device("cuda", 0)


_state: State | None = None
_lock = threading.Lock()


def init(mode: str | None = None, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         cpu: bool = False, seed: int | None = None) -> State:
    """Start (once) the process group this launch calls for and return the :class:`State`.

    ``mode`` defaults to the ``DDPKIT_MODE`` variable (``ddpkit launch --mode`` sets it) or ``auto``.
    ``backend`` defaults to NCCL when the process drives a CUDA device, else gloo. ``timeout_s`` bounds
    every collective (default 15 min); under ``ddpkit launch`` a rank that makes no progress for half of
    it has its stack recorded for the hang report. ``cpu=True`` keeps the work on the CPU even when GPUs
    exist. ``seed`` seeds python, numpy and torch with ``seed + rank``: reproducible streams that differ
    per rank (rank 0's equals a one-process run's). Calling it again returns the same state.
    """
    global _state
    with _lock:
        if _state is not None:
            return _state
        env = detect(os.environ, sys.argv)
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        chosen, reason = choose_mode(mode or os.environ.get("DDPKIT_MODE") or "auto", env, cuda_count)
        device = choose_device(chosen, env, cuda_count, cpu)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if env.source == "torchrun":
            faults.die_with_parent()  # a worker must not outlive its node's agent (a killed launcher)
        if os.environ.get("DDPKIT_REPORT_DIR"):  # set by `ddpkit launch`: root cause and hang reports
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            faults.install(env.rank, env.local_rank,
                           os.path.join(os.environ["DDPKIT_REPORT_DIR"], f"attempt{attempt}"), timeout_s)
        if chosen == "ddp":
            backend = backend or ("nccl" if device.type == "cuda" else "gloo")
            _start_group(env, backend, device, timeout_s)
        _state = State(env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank,
                       device, backend if chosen == "ddp" else None, chosen, reason)
        atexit.register(shutdown)
    if seed is not None:
        seed_everything(seed + _state.rank)
    if _state.is_main:
        print(f"ddpkit: {reason} on {device} (rank 0 of {env.world_size})", file=sys.stderr, flush=True)
    return _state


def _start_group(env: ProcessEnv, backend: str, device: torch.device, timeout_s: float) -> None:
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad GPU fails here, not at the first all-reduce
    if env.source in ("torchrun", "legacy-launch"):
        # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT; env:// joins it.
        dist.init_process_group(backend, init_method="env://", **kwargs)
        return
    if env.master_addr is None or env.master_port is None:
        raise LaunchEnvError(
            f"{env.source} started {env.world_size} processes but MASTER_ADDR/MASTER_PORT are not set; "
            "export both to the first node's address and a free port")
    dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, **kwargs)


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy (when installed) and torch (CPU and CUDA) with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:  # seed numpy only if the script uses it; importing it costs start-up time
        sys.modules["numpy"].random.seed(seed % 2**32)


_shutdown_hooks: list[Callable[[], None]] = []
_release_hooks: list[Callable[[], None]] = []


def on_shutdown(hook: Callable[[], None], *, always: bool = False) -> None:
    """Run ``hook()`` at :func:`shutdown`, while the process group still works (e.g. a final save).

    ``always=True``: run it after an uncaught exception too (for local clean-up that needs no peer).
    """
    (_release_hooks if always else _shutdown_hooks).append(hook)


def current() -> State:
    """The state of this process, calling :func:`init` with its defaults the first time."""
    return _state if _state is not None else init()


def shutdown() -> None:
    """Stop the process group so the interpreter exits promptly.

    Why the barrier: gloo's process-group destructor joins its worker threads while holding the GIL;
    when it runs at interpreter exit with work still in flight it can deadlock (pytorch#56297). Letting
    every rank finish outstanding work first, then destroying the group while Python is fully alive,
    makes exit reliable. After an uncaught exception we skip the barrier: the peers may never arrive.
    """
    global _state
    with _lock:
        if _state is None:
            return
        failed = getattr(sys, "last_value", None) is not None
        while _shutdown_hooks and not failed:
            _shutdown_hooks.pop(0)()
        while _release_hooks:
            _release_hooks.pop(0)()
        _state = None
        if dist.is_available() and dist.is_initialized():
            if not failed:
                dist.barrier()
            dist.destroy_process_group()
