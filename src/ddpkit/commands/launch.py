"""``ddpkit launch``: a thin front end over torch's elastic launcher (``torch.distributed.run``): the argv is
parsed into a :class:`~ddpkit.launcher.config.LaunchConfig` here, and :func:`ddpkit.launcher.supervise.run`
runs it.

Example::

    ddpkit launch --nproc-per-node 2 examples/digits.py --epochs 3
    ddpkit launch --mode dp train.py            # one process, DataParallel over every GPU
    ddpkit launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29400 train.py

Flags are spelled as torchrun spells them. Bad arguments exit with code 2 and one line, before anything
is spawned.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Mapping, Sequence

from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.core import contract
from ddpkit.core.environment import usable_cores, visible_gpus
from ddpkit.core.errors import UsageError
from ddpkit.launcher.config import (
    DEFAULT_KEEP_LOGS,
    PROG,
    LaunchConfig,
    LaunchError,
    parse_count,
    parse_seconds,
    resolve_nproc,
)
from ddpkit.strategy import STRATEGIES


def _mode_help() -> str:
    """The ``--mode`` help, from the mode table, so a mode added there is listed here too.

    >>> _mode_help().split(", dp")[0]
    'single (single device, one process)'
    """
    modes = ", ".join(f"{name} ({s.title}, {'one process per device' if s.multi_process else 'one process'})"
                      for name, s in STRATEGIES.items())
    return f"{modes}; default: DDPKIT_MODE when set, else ddp"


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
    p.add_argument("--mode", default=None, help=_mode_help())
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
    p.add_argument("--phase-window", default=None,
                   help="turn on the per-rank phase report and straggler check, N steps a window (e.g. 200; "
                        "default off: ~0.1 ms a step)")
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
    port = None if ns.master_port is None else parse_count(ns.master_port, "--master-port", 1)
    low, _, high = ns.nnodes.partition(":")
    return LaunchConfig(
        script=ns.script, script_args=tuple(ns.script_args), nproc_per_node=nproc,
        max_nodes=parse_count(high or low, "--nnodes", 1), min_nodes=parse_count(low, "--nnodes", 1) if high else None,
        node_rank=parse_count(ns.node_rank, "--node-rank", 0), rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id,
        rdzv_conf=ns.rdzv_conf, master_addr=ns.master_addr, master_port=port, mode=mode, device=device, gpus=gpus,
        verbose=ns.verbose, max_restarts=parse_count(ns.max_restarts, "--max-restarts", 0), module=ns.module,
        resume=ns.resume, log_dir=ns.log_dir, console_ranks=ns.console_ranks,
        keep_logs=parse_count(ns.keep_logs, "--keep-logs", 0, "pass 0 to keep every log folder"),
        join_timeout_s=parse_seconds(ns.join_timeout, "--join-timeout"),
        phase_window=None if ns.phase_window is None else parse_count(ns.phase_window, "--phase-window", 0,
                                                                       "pass 0 to turn the phase report off"))


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ddpkit launch``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not build_parser().parse_args(argv).verbose:
            # read once when torch loads (parse_args may load it): quiet from the first line on
            os.environ.setdefault(contract.CPP_LOG_LEVEL.name, "ERROR")
        cfg = parse_args(argv)
        # imported here, inside the try: a Ctrl-C while the launcher's modules load is one line and exit 130
        from ddpkit.launcher import supervise

        code = supervise.run(cfg)
        # the launch is over and said: the exit's garbage collections over torch's objects took 0.3-0.9 s of the
        # time from a rank's failure to the launcher's exit here (0.2-0.3 s frozen); the process frees it all anyway
        gc.freeze()
        return code
    except UsageError as exc:  # LaunchError, and argparse's own complaints
        return usage_error(PROG, exc)
    except KeyboardInterrupt:  # Ctrl-C while torch loads: once workers run, torch's agent turns it into a stop
        print(f"{PROG}: stopped by signal SIGINT before any worker started", file=sys.stderr, flush=True)
        return 128 + 2
