"""``ddpkit plan``: will this script fit? Per-rank peak memory of each mode at each process count, before launch.

One planning run (one process) takes the script up to the end of its first optimizer step with fake tensors
in place of the model's (no memory allocated for it; see :mod:`ddpkit.commands.plan.hooks`); each mode's
estimate follows (:mod:`ddpkit.commands.plan.memory`). ``--measure`` also runs each configuration for real for
a few steps and prints what torch's tensor accounting saw, beside the estimate.

Example::

    ddpkit plan --nproc-per-node 2,4,8 --budget-gb 80 train.py --lr 3e-4
    # fsdp at 8 processes: 11.2 GB per rank, fits 80 GB
    # ddp at 8 processes: 61.0 GB per rank, fits 80 GB
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import sys
import tempfile
import threading
import types
from collections.abc import Sequence
from typing import Any

from ddpkit.commands import itself
from ddpkit.commands.cli import OK, OneLineParser, usage_error
from ddpkit.commands.logtail import ScriptFailed, log_tail, run_logged
from ddpkit.commands.plan import memory
from ddpkit.core import contract
from ddpkit.core.errors import UsageError, first_line

MODES = ("ddp", "fsdp", "hsdp")
COMM = {"single": "buckets", "ddp": "buckets", "fsdp": "gathered blocks", "hsdp": "gathered blocks"}
MB = 2**20


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="ddpkit plan", description=__doc__.split("\n")[0])
    p.add_argument("--nproc-per-node", default="1,2,4,8", help="process counts to plan for (default 1,2,4,8)")
    p.add_argument("--modes", default=",".join(MODES), help="modes to plan for (default ddp,fsdp,hsdp)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-mb", type=float, default=None, help="memory per rank (default: the script's "
                        "init_empty(budget_mb=), else none)")
    budget.add_argument("--budget-gb", type=float, default=None, help="memory per rank, in GB")
    p.add_argument("--shard-size", type=int, default=None, help="hsdp's shard group (default: the processes)")
    p.add_argument("--measure", action="store_true", help="also run each configuration for real and compare")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps of each measured run (default 3)")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="cpu or cuda: where the runs train (default: auto)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line, checked: a bad count, mode or script is one line (a usage error)."""
    ns = build_parser().parse_args(argv)
    ns.counts = _counts(ns.nproc_per_node)
    ns.modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    for mode in ns.modes:
        if mode not in MODES:
            raise UsageError(f"--modes: {mode!r} is not planned; pass some of {', '.join(MODES)} (single is always "
                             "shown; dp drives every GPU from one process)")
    if ns.steps < 1 or (ns.shard_size is not None and ns.shard_size < 1):
        raise UsageError("--steps and --shard-size take a positive integer")
    if ns.measure and ns.shard_size is not None:
        raise UsageError("--shard-size with --measure: the measured runs shard as the script does "
                         "(prepare_model(shard_size=)); drop one of them")
    for name, value in (("--budget-mb", ns.budget_mb), ("--budget-gb", ns.budget_gb)):
        if value is not None and not (0 < value < float("inf")):
            raise UsageError(f"{name} {value}: expected a positive number of bytes per rank, e.g. {name} 80")
    if ns.json and (os.path.isdir(ns.json) or not os.access(os.path.dirname(os.path.abspath(ns.json)), os.W_OK)):
        raise UsageError(f"--json {ns.json}: not a file this user can write (a directory, or in a missing or "
                         "read-only one); pass e.g. --json plan.json")
    if not os.path.isfile(ns.script):
        raise UsageError(f"script {ns.script!r} not found; pass the path of a training script")
    return ns


def _counts(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything else is a usage error.

    >>> _counts("3,1,2,2")
    [1, 2, 3]
    """
    try:
        counts = sorted({int(c) for c in text.split(",")})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise UsageError(f"--nproc-per-node {text!r}: expected positive process counts, e.g. 1,2,4")
    return counts


def run_once(script: str, args: Sequence[str], nproc: int, mode: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """One launch with plan's hooks; each rank's record."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-plan-") as out:
        cmd = itself.command("launch", "--nproc-per-node", str(nproc), "--mode", mode,
                             "--log-dir", os.path.join(out, "logs"), script, *args)
        log = os.path.join(out, "launch.log")
        try:
            run_logged(cmd, {contract.TOOL.name: "ddpkit.commands.plan.hooks:from_env", contract.PLAN_OUT.name: out,
                             contract.PHASE_WINDOW.name: "0", **env}, log)
        except ScriptFailed as exc:  # the ranks' own logs go with the temporary directory: read them now
            ranks = sorted(glob.glob(os.path.join(out, "logs", "**", "*.log"), recursive=True))
            output = "\n".join([*(log_tail(path, 4000) for path in ranks), log_tail(log, 8000)])
            raise ScriptFailed(why_failed(script, output, first_line(exc, 10**6), _progress(out))) from None
        records = []
        for path in sorted(glob.glob(os.path.join(out, "rank*.json"))):
            with open(path) as f:
                records.append(json.load(f))
        if len(records) != nproc:
            raise ScriptFailed(f"{mode} at {_procs(nproc)}: the script ended before its first optimizer step on "
                               f"{nproc - len(records)} rank(s); plan needs a model from ddpkit.prepare_model and a "
                               "torch.optim optimizer that steps")
        return records


def _progress(out: str) -> tuple[int, int] | None:
    """(models stepped, models trained) when the planning run had stepped some optimizer before it failed."""
    try:
        with open(os.path.join(out, "progress.json")) as f:
            got = json.load(f)
        return int(got["stepped"]), int(got["models"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def why_failed(script: str, output: str, first: str, progress: tuple[int, int] | None = None) -> str:
    """One line for a run that exited non-zero: a fake tensor's value read before the first step (the script's
    line named), else the output's last line.

    >>> why_failed("t.py", 'File "t.py", line 8, in <module>\\nDataDependentOutputException: aten', "x")[:40]
    "t.py:8 reads a tensor's value (loss.item"
    """
    if "DataDependentOutputException" in output or "_local_scalar_dense" in output:
        lines = re.findall(rf'File "[^"]*{re.escape(os.path.basename(script))}", line (\d+)', output)
        where = f"{script}:{lines[-1]}" if lines else script
        if progress and progress[0]:  # some model stepped: the run goes on until each trained model's did
            return (f"{where} reads a tensor's value (loss.item(), print(tensor)) after {progress[0]} of the "
                    f"{progress[1]} trained models' optimizers stepped, where the planning run's tensors are still "
                    "fake (shapes, no values): it runs until every prepared model's optimizer stepped once; move "
                    "the read after the last model's optimizer.step()")
        return (f"{where} reads a tensor's value (loss.item(), print(tensor), if loss > x) before the first "
                "optimizer.step(), where the planning run's tensors are fake (shapes, no values): move the read "
                "after optimizer.step()")
    code = re.search(r"exited (-?\d+)", first)
    said = _raised(output).removeprefix("ddpkit plan: ")
    return f"the script exited {code.group(1) if code else 'non-zero'}: {said}"


def _raised(output: str) -> str:
    """The exception line of the output's last traceback (the first unindented line after it), else its last
    line.

    >>> _raised("Traceback (most recent call last):\\n  File x\\n    raise E\\nmod.E: bad\\nValueError: a log\\n")
    'mod.E: bad'
    """
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        after = [line for line in lines[starts[-1] + 1:] if not line.startswith((" ", "\t"))]
        if after:
            return after[0].strip()
    return lines[-1].strip() if lines else "no output"


def estimates(capture: memory.Capture, modes: Sequence[str], counts: Sequence[int],
              shard_size: int | None) -> list[tuple[str, int, memory.Estimate | str]]:
    """(mode, processes, estimate or why not) for single at 1 and each mode at each count."""
    from ddpkit.strategies.hsdp import mesh_shape

    rows: list[tuple[str, int, memory.Estimate | str]] = [("single", 1, memory.single(capture))]
    for mode in modes:
        for n in (c for c in counts if c > 1):  # one process trains as single in every mode
            if mode == "ddp":
                rows.append((mode, n, memory.ddp(capture, n)))
            elif mode == "fsdp":
                rows.append((mode, n, memory.sharded(capture, n)))
            else:
                try:
                    shard = mesh_shape(n, n, shard_size)[1]
                except ValueError as exc:
                    rows.append((mode, n, str(exc).split(";")[0]))
                    continue
                rows.append((mode, n, memory.sharded(capture, shard, n)))
    return rows


def state_count_mb(capture: memory.Capture, mode: str, n: int, shard_size: int | None) -> float:
    """What ``init_empty(budget_mb=)`` counts for this mode at N (the same function), in MB."""
    from ddpkit.strategies import table

    strategy = table.get(mode)
    group = strategy.shard_group_size(types.SimpleNamespace(world_size=n, local_world_size=n), shard_size)
    size = capture.element_size()
    return strategy.state_bytes(capture.elements, capture.largest_module, group, capture.slots()) * size / MB


def verdict(total: int, budget_mb: float | None) -> str:
    if budget_mb is None:
        return ""
    return f", fits {_size(budget_mb * MB)}" if total <= budget_mb * MB else f", does not fit {_size(budget_mb * MB)}"


def advice(rows: list[tuple[str, int, Any]], budget_mb: float | None) -> str | None:
    """The first mode (single, ddp, fsdp, hsdp) and the fewest processes that fit, when the budget is given."""
    if budget_mb is None:
        return None
    order = ("single", *MODES)
    fits = sorted(((mode, n) for mode, n, e in rows if not isinstance(e, str) and e.total <= budget_mb * MB),
                  key=lambda row: (order.index(row[0]), row[1]))  # the simplest mode first, then fewest processes
    if not fits:
        return f"nothing planned fits {_size(budget_mb * MB)} per rank: more processes, or a smaller batch / model"
    mode, n = fits[0]
    missed = [m for m in order[:order.index(mode)] if any(r[0] == m for r in rows)]
    if not missed:
        return f"{mode} at {_procs(n)} fits {_size(budget_mb * MB)} per rank"
    return (f"at {_size(budget_mb * MB)} per rank {' and '.join(missed)} {'do' if len(missed) > 1 else 'does'} "
            f"not fit: use {mode} at {_procs(n)}")


def _procs(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _size(n: float) -> str:
    """Bytes as people say them.

    >>> _size(11.2 * 2**30), _size(600 * 2**20), _size(64 * 2**20), _size(3.14159 * 2**20), _size(40), _size(0)
    ('11.2 GB', '600 MB', '64.0 MB', '3.14 MB', '0.0 kB', '0 MB')
    """
    if n >= 2**30:
        return f"{n / 2**30:.1f} GB"
    mb = n / MB
    if mb < 0.1:
        return f"{n / 1024:.1f} kB" if n else "0 MB"
    return f"{mb:.0f} MB" if mb >= 100 else f"{mb:.1f} MB" if mb >= 10 else f"{mb:.2f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = parse(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        return usage_error("ddpkit plan", exc)
    # SIGTERM (a job's time limit) as an exception: the running launch is stopped and the temporary folder goes
    # (only the main thread may set a handler: called from another, main() goes without)
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM)) if main_thread else None
    try:
        return _plan(ns)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)


def _plan(ns: argparse.Namespace) -> int:
    env = {contract.DEVICE.name: ns.device} if ns.device else {}
    try:
        first = run_once(ns.script, ns.args, 1, "single", {**env, contract.PLAN_FAKE.name: "1"})[0]
        capture = memory.Capture.from_json(first)
    except (ScriptFailed, ValueError) as exc:
        print(f"ddpkit plan: the planning run failed: {exc}", file=sys.stderr)
        return 1
    budget = ns.budget_mb if ns.budget_gb is None else ns.budget_gb * 1024
    budget = capture.script_budget_mb if budget is None else budget
    ns.shard_size = ns.shard_size or capture.shard_size  # the script's own, unless asked about another
    rows = estimates(capture, ns.modes, ns.counts, ns.shard_size)
    report = []
    for mode, n, est in rows:
        if isinstance(est, str):
            print(f"{mode} at {_procs(n)}: not planned ({est})")
            continue
        counted = state_count_mb(capture, mode, n, ns.shard_size)
        resident = f"other tensors {_size(est.resident)}, " if est.resident else ""
        line = (f"{mode} at {_procs(n)}: {_size(est.total)} per rank{verdict(est.total, budget)} (state "
                f"{_size(est.state)}, {resident}activations {_size(est.activations)}, {COMM[mode]} {_size(est.comm)}, "
                f"optimizer step temporaries {_size(est.temporaries)}; init_empty counts {_size(counted * MB)})")
        entry = {"mode": mode, "nproc": n, "bytes": est.total, "init_empty_mb": counted, **dataclass_dict(est)}
        if ns.measure:
            entry["measured"] = measure(ns, mode, n, env)
            if isinstance(entry["measured"], int) and entry["measured"] > 0:
                line += f"; measured {_size(entry['measured'])} ({est.total / entry['measured'] - 1:+.1%})"
            else:
                line += f"; measured: {entry['measured']}"
        print(line)
        report.append(entry)
    if (text := advice(rows, budget)) is not None:
        print(text)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"budget_mb": budget, "rows": report, "capture": first}, f, indent=1)
    return OK


def measure(ns: argparse.Namespace, mode: str, n: int, env: dict[str, str]) -> int | str:
    """The largest rank's peak over ``--steps`` real steps, or the line saying why the run gave none."""
    try:
        records = run_once(ns.script, ns.args, n, mode, {**env, contract.MAX_STEPS.name: str(ns.steps)})
    except ScriptFailed as exc:
        return str(exc).splitlines()[-1]
    peaks = [r.get("peak") for r in records]
    return max(p for p in peaks if type(p) is int) if any(type(p) is int for p in peaks) else "no peak recorded"


def dataclass_dict(est: memory.Estimate) -> dict[str, int]:
    return {"state": est.state, "resident": est.resident, "activations": est.activations, "comm": est.comm,
            "temporaries": est.temporaries}
