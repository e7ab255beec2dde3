"""The launch contract: every environment variable ddpkit sets or reads, named once, with typed readers.

The launchers' own variables (torchrun's RANK / WORLD_SIZE / MASTER_ADDR, Slurm's, MPI's) are read by the
detectors of :mod:`ddpkit.core.environment` and listed in docs/guide.md. A ddpkit command (``launch``, ``verify``,
``bench``) writes a variable for the processes it starts; library
code reads it through :meth:`Var.text`, :meth:`Var.number` or :meth:`Var.choice` from *this* table, so a
name is never spelled twice and a bad value is one line naming the variable. docs/environment.md is
checked against :data:`VARIABLES` by the test suite.

Example::

    >>> DEVICE.choice({"DDPKIT_DEVICE": "cpu"})
    'cpu'
    >>> MAX_STEPS.number({}) is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ddpkit.core.options import Device, choices


class ContractError(ValueError):
    """A variable of the launch contract holds a value ddpkit cannot use."""


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable: its name, who sets it, who reads it, what it means."""

    name: str
    set_by: str
    read_by: str
    meaning: str
    choices: tuple[str, ...] = ()

    def text(self, environ: Mapping[str, str]) -> str | None:
        """The value, or None when unset or empty."""
        return environ.get(self.name) or None

    def number(self, environ: Mapping[str, str]) -> int | None:
        raw = self.text(environ)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ContractError(f"{self.name}={raw!r} is not an integer; unset it or give a number") from None

    def choice(self, environ: Mapping[str, str]) -> str | None:
        raw = self.text(environ)
        if raw is not None and raw not in self.choices:
            raise ContractError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}; unset it or pick one")
        return raw

    def flag(self, environ: Mapping[str, str]) -> bool:
        return self.text(environ) == "1"


LAUNCH, VERIFY, BENCH, PLAN = "ddpkit launch", "ddpkit verify", "ddpkit bench", "ddpkit plan"

# -- ddpkit's own ---------------------------------------------------------------------------------------
MODE = Var("DDPKIT_MODE", f"{LAUNCH} --mode, or you", "init()",
           "parallel mode when init() gets none: auto, or an entry of ddpkit.strategy "
           "(single, dp, ddp, fsdp, hsdp, ...)")
DEVICE = Var("DDPKIT_DEVICE", f"{LAUNCH}/verify/bench --device, or you", "init()",
             "cpu keeps every process on the CPU (gloo) whatever GPUs exist; cuda requires one",
             choices(Device))
RESUME = Var("DDPKIT_RESUME", f"{LAUNCH} --resume", "Checkpointer", "1: restore the newest valid checkpoint")
REPORT_DIR = Var("DDPKIT_REPORT_DIR", LAUNCH, "init()", "where workers write error and stack reports")
PHASE_DIR = Var("DDPKIT_PHASE_DIR", LAUNCH, "init()",
                "where the one process of --mode dp / single writes its phase report (it has no REPORT_DIR)")
LAUNCHER_PID = Var("DDPKIT_LAUNCHER_PID", LAUNCH, "init()",
                   "the launcher's PID: a worker whose parent is no longer it exits (orphan guard)")
PHASE_WINDOW = Var("DDPKIT_PHASE_WINDOW", f"{LAUNCH} --phase-window", "init()",
                   "steps per window of the per-rank phase report (e.g. 200); unset or 0: no report (the default)")
DESYNC_AFTER = Var("DDPKIT_DESYNC_AFTER", "you", "init()",
                   "seconds (at least; 20 steps when longer) a rank waits in one collective before the ranks compare "
                   "where they wait, through the store (default 3); 0: no desync watch")
TOOL = Var("DDPKIT_TOOL", f"{VERIFY}, {BENCH}", "init()",
           "the tool whose hooks the workers load: module:factory, or an entry point of the ddpkit.tools group")
MAX_STEPS = Var("DDPKIT_MAX_STEPS", f"{VERIFY}, {BENCH}, {PLAN}", "the tool's hooks",
                "verify, plan: each run exits after K optimizer steps; bench: training loaders stop after K batches")
BATCH_SCALE = Var("DDPKIT_BATCH_SCALE", VERIFY, "verify's hooks",
                  "the one-process run multiplies the training batch by N")
VERIFY_OUT = Var("DDPKIT_VERIFY_OUT", VERIFY, "verify's hooks",
                 "rank 0 saves the prepared model's weights there at exit")
VERIFY_INIT = Var("DDPKIT_VERIFY_INIT", VERIFY, "verify's hooks",
                  "initial weights: written by the one-process run, loaded by the N-process run")
VERIFY_DROP = Var("DDPKIT_VERIFY_DROP", VERIFY, "verify's hooks",
                  "N: training loaders drop the last len % N samples in both runs (no padded repeats)")
VERIFY_F64 = Var("DDPKIT_VERIFY_F64", VERIFY, "verify's hooks",
                 "1: the prepared model in float64 (its float inputs cast up, its outputs back): the re-run that "
                 "tells float rounding from a defect")
VERIFY_DRAWS = Var("DDPKIT_VERIFY_DRAWS", VERIFY, "verify's hooks",
                   "K: torch's generator reseeded (seed + K x 7919) at the first training batch: the one-process "
                   "re-runs with other random draws in their steps, whose distance from the first is the draws' own")
VERIFY_PERTURB = Var("DDPKIT_VERIFY_PERTURB", VERIFY, "verify's hooks",
                     "K: each initial weight multiplied by 1 + eps x a draw of seed K (eps: its dtype's): the "
                     "one-process re-runs that measure how far rounding alone moves this training")
VERIFY_MATCHED = Var("DDPKIT_VERIFY_MATCHED", VERIFY, "verify's hooks",
                     "1: the steps' torch draws matched between 1 process and N (the re-run of a script that draws "
                     "noise in its steps: ddpkit.commands.verify.matched)")
KEEP_DROPOUT = Var("DDPKIT_KEEP_DROPOUT", f"{VERIFY} --keep-dropout", "verify's hooks",
                   "1: verify leaves dropout on (by default it sets p=0 in both runs)")
BENCH_OUT = Var("DDPKIT_BENCH_OUT", BENCH, "bench's hooks", "each rank writes its batch hand-out times there")
BENCH_NO_COMM = Var("DDPKIT_BENCH_NO_COMM", BENCH, "bench's hooks",
                    "1: DDP skips gradient communication (timing only)")
COMM = Var("DDPKIT_COMM", BENCH, "bench's hooks", "JSON of CommConfig fields that override the script's")
PLAN_OUT = Var("DDPKIT_PLAN_OUT", PLAN, "plan's hooks", "each rank writes its memory record there (rank<r>.json)")
PLAN_FAKE = Var("DDPKIT_PLAN_FAKE", PLAN, "plan's hooks",
                "1: the planning run (fake tensors, one optimizer step); unset: a measured run")
# what only a tool's hooks read: set without DDPKIT_TOOL they do nothing, and init() says so
TOOL_VARIABLES = (MAX_STEPS, BATCH_SCALE, VERIFY_OUT, VERIFY_INIT, VERIFY_DROP, VERIFY_DRAWS, VERIFY_MATCHED,
                  VERIFY_PERTURB, KEEP_DROPOUT, BENCH_OUT, BENCH_NO_COMM, COMM, PLAN_OUT, PLAN_FAKE)

# -- torch's agent's, read (the launchers' rank variables belong to ddpkit.core.environment's detectors) ----
RESTART_COUNT = Var("TORCHELASTIC_RESTART_COUNT", "torchrun", "init(), Checkpointer",
                    "restarts so far: > 0 resumes from the newest checkpoint")
RUN_ID = Var("TORCHELASTIC_RUN_ID", "torchrun", "init()", "present: torch's agent is this process's parent")

# -- set by ddpkit launch for torch, gloo, NCCL and OpenMP (a value you set is kept) ------------------
OMP_THREADS = Var("OMP_NUM_THREADS", LAUNCH, "torch",
                  "usable cores (the affinity mask) / local processes, so N processes do not oversubscribe")
UNBUFFERED = Var("PYTHONUNBUFFERED", LAUNCH, "python", "1: worker output reaches the log files as it is printed")
HASH_SEED = Var("PYTHONHASHSEED", LAUNCH, "python", "one value for every worker (from --rdzv-id): a set's order over "
                "strings is then the same on every rank, as in one process (a tag map numbered from a set)")
GLOO_IFNAME = Var("GLOO_SOCKET_IFNAME", LAUNCH, "gloo", "lo on one node: worker sockets bind loopback only")
NCCL_IFNAME = Var("NCCL_SOCKET_IFNAME", LAUNCH, "NCCL", "lo on one node: worker sockets bind loopback only")
UNSHARED_STORE = Var("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", LAUNCH, "torch",
                     "1 for multi-node restarts: a restarted group gets a store of its own")
CPP_LOG_LEVEL = Var("TORCH_CPP_LOG_LEVEL", LAUNCH, "torch",
                    "ERROR unless --verbose: no C++ store warnings while nodes are still joining")
TF32_OVERRIDE = Var("NVIDIA_TF32_OVERRIDE", VERIFY, "cuBLAS, cuDNN", "0: no TF32 in verify's runs (exact fp32)")

VARIABLES = tuple(v for v in globals().values() if isinstance(v, Var))


def markdown_table() -> str:
    """The table of docs/environment.md."""
    rows = ["| variable | set by | read by | meaning |", "|---|---|---|---|"]
    for var in VARIABLES:
        choices = f" ({'/'.join(var.choices)})" if var.choices else ""
        rows.append(f"| `{var.name}`{choices} | {var.set_by} | {var.read_by} | {var.meaning} |")
    return "\n".join(rows)
