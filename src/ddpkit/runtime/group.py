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
import datetime
import functools
import gc
import io
import json
import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.core import contract, process
from ddpkit.core.environment import LaunchEnvError, ProcessEnv, detect, visible_gpus
from ddpkit.core.errors import SCRIPT_FAILED, USAGE_ERROR, ShutdownError, first_line
from ddpkit.core.options import Device, check
from ddpkit.core.process import State
from ddpkit.runtime import desync, faults, forksafe, instrument, leaving, phases
from ddpkit.strategies import replica_exit, replicas
from ddpkit.strategies import table as strategy

# Collectives that wait longer than this fail (and `ddpkit launch` prints a hang report). torch's defaults
# are 30 min for gloo and 10 min for NCCL: long enough to lose an evening on a job that hangs at start-up.
DEFAULT_TIMEOUT_S = 900.0
JOIN_S = 2.0  # how long shutdown waits for its watching threads to end (each wakes within a poll: ~0.02-1 s)


def choose_mode(requested: str, env: ProcessEnv, cuda_count: int, launcher: str | None = None) -> tuple[str, str]:
    """Resolve ``auto`` and check an explicit mode (an entry of :mod:`ddpkit.strategies.table`) against the launch.
    Returns (mode, why); ``launcher`` names who started the processes when it is not what the environment
    says (``ddpkit launch`` and ``spawn`` run torchrun's agent, so the environment reads "torchrun").

    ``auto``: several processes -> ddp; one process and >= 2 GPUs -> dp; else single. A multi-process mode
    in a one-process launch, or a mode short of the GPUs it needs, falls back to single and says so; a
    one-process mode in a multi-process launch is an error (every process would train its own copy).

    >>> choose_mode("auto", ProcessEnv(), cuda_count=0)
    ('single', 'one process and no GPU: single-device training')
    """
    if requested == "auto":
        requested = "ddp" if env.distributed else "dp" if cuda_count >= 2 else "single"
    chosen = strategy.get(requested)
    procs = f"{env.world_size} processes started by {launcher or env.source}"
    if env.distributed:
        if not chosen.multi_process:
            raise LaunchEnvError(
                f"mode {requested!r} runs one process, but {procs}; "
                f"use mode 'ddp' or start the script once (ddpkit launch --mode dp / plain python)")
        return requested, f"{procs}: {chosen.title}"
    if chosen.multi_process and env.source != "single":  # e.g. an elastic job that shrank to one node
        return "single", f"{env.source} started one process (world size 1): single-device training"
    if chosen.multi_process:
        return "single", (f"mode {requested!r} asked for, but only one process runs: single-device training "
                          "(start N processes with `ddpkit launch --nproc-per-node N script.py`)")
    if cuda_count < chosen.min_gpus:
        return "single", (f"mode {requested!r} asked for, but {cuda_count} GPU(s) visible (it needs >= "
                          f"{chosen.min_gpus}): single device")
    if requested == "dp":
        return "dp", (f"one process and {cuda_count} GPUs visible: DataParallel over all of them "
                      "(DDP is faster: `ddpkit launch --nproc-per-node gpu script.py`)")
    if requested == "single":
        return "single", f"one process and {'one GPU' if cuda_count == 1 else 'no GPU'}: single-device training"
    return requested, f"one process: mode {requested!r}"


def usable_gpus(preference: str, cuda_count: int) -> int:
    """GPUs this process may use: none when the CPU is asked for (``--device cpu``, ``cpu=True``).

    >>> usable_gpus("auto", 4), usable_gpus("cpu", 4)
    (4, 0)
    """
    check("device", preference, Device)
    if preference == "cuda" and cuda_count == 0:
        raise LaunchEnvError("device 'cuda' asked for (--device cuda / DDPKIT_DEVICE=cuda), but torch sees no "
                             "CUDA GPU; check nvidia-smi and that torch is a CUDA build, or pass --device cpu")
    return 0 if preference == "cpu" else cuda_count


def choose_device(mode: str, env: ProcessEnv, cuda_count: int) -> torch.device:
    """The device of this process, given the GPUs it may use (see :func:`usable_gpus`); the mode decides.

    DDP: ``cuda:<local_rank>``, never another rank's GPU; a process that sees exactly one GPU (Slurm
    ``--gpus-per-task=1``, ``--gpu-bind``, MPI wrappers that set CUDA_VISIBLE_DEVICES per rank) uses it,
    ``cuda:0``. dp / single: ``cuda:0``. No GPU: the CPU.

    >>> two = ProcessEnv("torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)
    >>> choose_device("ddp", two, 2), choose_device("ddp", two, 1), choose_device("ddp", two, 0)
    (device(type='cuda', index=1), device(type='cuda', index=0), device(type='cpu'))
    """
    return strategy.get(mode).device(env, cuda_count)


def gpu_fallback_warning(cuda_build: str | None, cuda_available: bool, nvidia_device: bool) -> str | None:
    """One warning when this host has NVIDIA GPUs that torch cannot use, instead of a silent CPU run.

    >>> gpu_fallback_warning(None, False, True)[:42]
    'ddpkit: warning: this host has NVIDIA GPUs'
    >>> gpu_fallback_warning("12.8", True, True) is None, gpu_fallback_warning(None, False, False) is None
    (True, True)
    """
    if cuda_available or not nvidia_device:
        return None
    why = ("this torch is a CPU-only build (install a CUDA build of torch)" if cuda_build is None else
           f"torch (CUDA {cuda_build}) cannot use them: check the driver with nvidia-smi")
    return f"ddpkit: warning: this host has NVIDIA GPUs but {why}; training runs on the CPU"


def init(mode: str | None = None, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         cpu: bool = False, seed: int | None = None) -> State:
    """Start (once) the process group this launch calls for and return the :class:`State`.

    ``mode`` defaults to the ``DDPKIT_MODE`` variable (``ddpkit launch --mode`` sets it) or ``auto``.
    ``backend`` defaults to NCCL when the process drives a CUDA device, else gloo. ``timeout_s`` bounds
    every collective (default 15 min); under ``ddpkit launch`` a rank that makes no progress for half of
    it has its stack recorded for the hang report. ``cpu=True`` (or ``DDPKIT_DEVICE=cpu``, which
    ``ddpkit launch --device cpu`` sets) keeps the work on the CPU even when GPUs exist. ``seed`` seeds
    python, numpy and torch with ``seed + rank``: reproducible streams that differ per rank (rank 0's equals
    a one-process run's). Calling it again returns the same state.
    """
    proc = process.current()
    with proc.lock:
        if proc.state is not None:
            return proc.state
        try:
            env = detect(os.environ, sys.argv)
            preference = "cpu" if cpu else contract.DEVICE.choice(os.environ) or "auto"
            # the CPU asked for: CUDA stays untouched (a notebook kernel that inits on the CPU can still fork)
            cuda_count = 0 if preference == "cpu" else visible_gpus(initialise=True)
            gpus = usable_gpus(preference, cuda_count)
            launcher = "ddpkit" if contract.LAUNCHER_PID.name in os.environ else None  # launch and spawn set it
            chosen, reason = choose_mode(mode or contract.MODE.text(os.environ) or "auto", env, gpus, launcher)
            entry = strategy.get(chosen)  # the one place a mode name becomes the mode: State carries it
            device = entry.device(env, gpus)
            hooks = instrument.from_env(os.environ)
            window = phases.window_from(os.environ)
            desync_after = desync.floor_from(os.environ)
        except (LaunchEnvError, ValueError) as exc:  # ContractError and an unknown mode are ValueErrors
            # the launch itself is wrong (a variable, a count): one line naming it, no traceback into ddpkit
            print(f"ddpkit: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(USAGE_ERROR) from None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _guard_worker(env, timeout_s)
        proc.tools = hooks
        backend = (backend or entry.backend(device)) if entry.multi_process else None
        if backend is not None:
            _start_group(env, backend, device, timeout_s)
            proc.groups += 1
            proc.store = dist.distributed_c10d._get_default_store()  # held: the script may destroy the group
        proc.state = state = State(env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank,
                                   device, backend, chosen, reason, entry)
        if backend is not None:  # ranks waiting in different collectives: said in seconds, not at the timeout
            proc.desync = desync.start(state, desync_after, functools.partial(_desynced, state.local_rank))
            proc.listener = leaving.listen(state.world_size)  # a peer at exit while this rank waits for it
        report = contract.REPORT_DIR.text(os.environ) or contract.PHASE_DIR.text(os.environ)
        proc.phases = phases.start(state, report, window)
        atexit.register(_shutdown_at_exit)
    if seed is not None:
        seed_everything(seed + state.rank)
    if state.is_main:
        warning = gpu_fallback_warning(torch.version.cuda, cuda_count > 0, os.path.exists("/dev/nvidia0"))
        if warning and preference != "cpu":
            print(warning, file=sys.stderr, flush=True)
        print(f"ddpkit: {reason} on {device} (rank 0 of {env.world_size})", file=sys.stderr, flush=True)
    return state


def _desynced(local_rank: int, rank: int, line: str) -> None:
    faults.fail_now(rank, local_rank, "CollectiveDesync", line)


def _guard_worker(env: ProcessEnv, timeout_s: float) -> None:
    """Under torch's agent (ddpkit launch, torchrun): die with it, and write reports for ddpkit launch."""
    if env.source == "torchrun" and contract.RUN_ID.text(os.environ):
        # only then is the parent a launcher: a shell or init as parent (a container's PID 1) is not one
        faults.die_with_parent(contract.LAUNCHER_PID.number(os.environ))
    report_dir = contract.REPORT_DIR.text(os.environ)
    if report_dir:  # set by `ddpkit launch`: root cause and hang reports
        attempt = contract.RESTART_COUNT.number(os.environ) or 0
        faults.install(env.rank, env.local_rank, os.path.join(report_dir, f"attempt{attempt}"), timeout_s)


def tools() -> instrument.Hooks:
    """The hooks of the command that started this run (``ddpkit verify`` / ``bench``); no-ops otherwise."""
    return process.current().tools or instrument.NONE


def _start_group(env: ProcessEnv, backend: str, device: torch.device, timeout_s: float) -> None:
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad GPU fails here, not at the first all-reduce
    forksafe.install()  # from here on torch.distributed's threads may hold a lock that a fork would copy
    if env.agent_store:
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


def ensure_init() -> State:
    """The state of this process; the first call starts it with :func:`init`'s defaults (and so may
    start the process group)."""
    state = process.current().state
    return state if state is not None else init()


def shutdown() -> None:
    """Stop the process group so the interpreter exits promptly.

    Why the barrier: gloo's process-group destructor joins its worker threads while holding the GIL;
    when it runs at interpreter exit with work still in flight it can deadlock (pytorch#56297). Letting
    every rank finish outstanding work first, then destroying the group while Python is fully alive,
    makes exit reliable. After an uncaught exception we skip the barrier: the peers may never arrive.

    Raises :class:`ShutdownError` once the group is down when a shutdown hook failed (the last background
    checkpoint write: it was not saved).
    """
    _stop()


def _stop() -> bool:
    """:func:`shutdown`; True when this rank leaves failing: an uncaught exception, or a peer waits for it in a
    collective (the job is stopped once this process is gone)."""
    proc = process.current()
    with proc.lock:
        if proc.state is None:
            return False
        failed = getattr(sys, "last_value", None) is not None
        watchers = [thread for thread in (proc.desync, proc.listener) if thread is not None]
        for thread in watchers:  # the group goes down from here: nothing left to watch
            thread.stopped.set()
        proc.desync = proc.listener = None
        while proc.shutdown_hooks and not failed:
            proc.shutdown_hooks.pop(0)()
        while proc.release_hooks:
            proc.release_hooks.pop(0)()
        state, proc.state, store, proc.store = proc.state, None, proc.store, None
        if dist.is_available() and dist.is_initialized():
            orderly = not failed and _final_barrier(state)
            if orderly:
                # this rank's script ended and its hooks ran: what kills it from now on comes after its work.
                # The launcher forgives a teardown abort only when every rank it lists as failed is marked so
                faults.mark_finished(dist.get_rank())
            failed = not orderly
            dist.destroy_process_group()
        elif store is not None and not failed:  # the script destroyed the group: the replicas checked all the same
            _check_without_group(store, state)
        if store is not None:  # a listener still waiting for a first count (this rank failed, or its group is gone)
            leaving.release(store)
        for thread in watchers:  # ended, and their store connection and group references dropped, before the
            thread.join(JOIN_S)  # interpreter finalizes: a C++ destructor running on a thread then aborted it
            # (SIGABRT, "terminate called without an active exception": 4 exits in 10 after the script's own
            # destroy_process_group())
        failure, proc.exit_failure = proc.exit_failure, None
    if failure:  # said already, by the hook; raised once the group is down (a later init() starts clean)
        raise ShutdownError(failure)
    return failed


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at interpreter exit. A hook that failed the process there (the last checkpoint's
    background write) makes it exit 1: nothing at atexit can change the exit code but ``os._exit``, so logging
    and the standard streams are flushed first (atexit handlers registered before ``ddpkit.init()`` do not run)."""
    try:
        failing = _stop()
    except ShutdownError:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(SCRIPT_FAILED)
    if failing:
        _spare_teardown()


_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.FileIO)


def _spare_teardown() -> None:
    """A failing rank's objects are left to the process's end: torch's agent stops the job once this process is
    gone, and the interpreter's teardown (its garbage collections over torch's objects) was most of that time
    (1.0 s of a DDP worker's exit here; 0.37 s so). The garbage there is now is collected as the teardown would,
    and every open file is flushed (one that only the teardown would free, held in a reference cycle, would lose
    what it buffered); a ``__del__`` of an object in such a cycle is what does not run."""
    gc.collect()
    for obj in gc.get_objects():
        if type(obj) in _FILES and not obj.closed:
            try:
                obj.flush()
            except (OSError, ValueError):  # a read-only or broken file: nothing buffered to lose
                pass
    gc.freeze()


def _final_barrier(state: State) -> bool:
    """Meet every rank at exit (:mod:`ddpkit.runtime.leaving` says when the ranks at exit leave without the
    barrier); True when this rank's exit is orderly: all arrived and passed the barrier, or a peer was still at
    work after the exit wait. False when a peer is inside a collective no rank at exit joins, or a peer (or the
    store's host) was found gone.

    A peer that already died is said in one line, not a C++ wall of text (the launcher's summary names the rank
    that failed first)."""
    rank, world = state.rank, state.world_size
    try:
        store = dist.distributed_c10d._get_default_store()
        # what arrives is the models this rank still holds: the last replica check covers those every rank holds
        # (a model dropped by the script may be collected on one rank and not yet on another)
        count = leaving.collectives(dist.distributed_c10d._get_default_group())
        decision = leaving.arrive(store, rank, world, json.dumps(replicas.live()), count,
                                  functools.partial(replica_exit.post, rank))
        if decision == "late":  # a peer still at work, or gone: the last to post compares the posts
            _compare_posts(state, leaving.prints_of(store, world), replica_exit.APART)
        if decision != "barrier":
            return decision == "late"
        held = [replicas.parse_live(raw) for raw in leaving.posted(store, world)]
        # every rank is here: the last steps' weights
        _replicas_differ(state, replicas.check_at_exit(set.intersection(*held)))
        dist.barrier()
        return True
    except RuntimeError as exc:  # DistBackendError / DistNetworkError: a peer (or the store's host) is gone
        first = first_line(exc, 10**6)
        print(f"ddpkit: rank {rank} finished, but a peer had exited: "
              f"{first.split('. ')[0].split('] ')[-1][:160]}", file=sys.stderr, flush=True)
        return False


def _check_without_group(store: Any, state: State) -> None:
    """The replicas' last check when the script destroyed its group itself (``dist.destroy_process_group()`` at
    its end): the ranks meet in the store, which outlives the group, and compare their posted fingerprints."""
    try:
        decision = leaving.arrive(store, state.rank, state.world_size, "[]", None,
                                  functools.partial(replica_exit.post, state.rank), post=True)
        if decision != "ahead":
            _compare_posts(state, leaving.prints_of(store, state.world_size), replica_exit.DESTROYED)
    except RuntimeError:  # the store's host is gone (the job is ending): nothing left to compare with
        pass


def _compare_posts(state: State, posts: list[bytes | None], apart: str) -> None:
    """The replicas' last check from the ranks' posts: a post that no rank of this job wrote is one line."""
    try:
        _replicas_differ(state, replica_exit.compare(posts, apart))
    except ValueError as exc:
        print(f"ddpkit: note: the replicas' last check did not run: {exc}", file=sys.stderr, flush=True)


def _replicas_differ(state: State, problem: str | None) -> None:
    """Said by this rank (the launcher's report, or its stderr), and this process exits 1."""
    if problem:
        if not faults.record(state.rank, state.local_rank, "ReplicaError", problem):
            print(f"ddpkit: error: {problem}", file=sys.stderr, flush=True)
        process.current().exit_failure = problem
