"""``ddpkit bench script.py [args]``: your training step at 1..N processes, measured.

Reports throughput (samples/s) and scaling efficiency at each process count, the share of the step that
communication takes (the same run with gradient communication skipped), the communication settings tried at
the largest count, and a recommendation that is only ever a setting that measured faster than the default in
this same run. Runs are interleaved (every configuration once per repetition) and each figure is the median
over steps and repetitions of the slowest rank's step.

What the script needs: ``ddpkit.data_loader`` for the training data (the bench times the batches it hands
out) and ``ddpkit.prepare_model`` (to apply the settings). It talks to the runs through documented variables:
``DDPKIT_MAX_STEPS`` (stop after K batches), ``DDPKIT_BENCH_OUT`` (each rank writes its batch times there),
``DDPKIT_COMM`` (JSON of :class:`ddpkit.CommConfig` fields) and ``DDPKIT_BENCH_NO_COMM`` (skip communication).

Example::

    ddpkit bench --nproc 1,2 --steps 30 examples/digits.py --epochs 100
    ddpkit bench --json examples/digits.py          # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from ddpkit import contract
from ddpkit.cli import SCRIPT_FAILED, USAGE_ERROR, OneLineParser, UsageError, run_logged, usage_error

PROG = "ddpkit bench"
MIN_GAIN = 1.05  # a setting must be faster than the default by this much, with evidence, to be recommended
ALPHA = 0.05  # chance of recommending a setting that is not MIN_GAIN faster, over all the settings tried
SETTINGS = {"gradient_as_bucket_view": {"gradient_as_bucket_view": True}, "bucket_5mb": {"bucket_mb": 5},
            "bucket_100mb": {"bucket_mb": 100}}
LOSSY = {"bf16": {"compression": "bf16"}}  # tried on GPUs only: on CPU the casts cost more than they save


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Throughput, scaling and communication share of a training script.")
    p.add_argument("--nproc", default=None,
                   help="process counts to run, comma-separated (default 1,2, capped at the usable GPU count)")
    p.add_argument("--device", default=None, help="auto (default), cpu or cuda: where the runs train")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of each run (default 5)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions (default 2)")
    p.add_argument("--plot", default=os.path.join("runs", "bench", "bench.png"), help="PNG path ('' for none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def step_ms(rank_files: Sequence[str], warmup: int) -> tuple[float, int]:
    """Median over steps of the slowest rank's step (ms), and the global batch, from the ranks' records."""
    records = []
    for path in rank_files:
        with open(path) as f:
            records.append(json.load(f))
    steps = [[b - a for a, b in zip(r["times"], r["times"][1:])][warmup:] for r in records]
    slowest = [max(per_rank) for per_rank in zip(*steps)]
    if not slowest:
        raise RuntimeError(f"only {min(len(r['times']) for r in records)} batches were timed; the training loop "
                           f"must take more than --warmup + 1 batches from ddpkit.data_loader")
    return statistics.median(slowest) * 1e3, records[0]["global_batch"]


def run_once(script: str, args: Sequence[str], nproc: int, steps: int, warmup: int, env: dict) -> tuple[float, int]:
    """One launch of the script; returns (step ms, global batch)."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as out:
        cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", str(nproc),
               "--log-dir", os.path.join(out, "logs"), script, *args]
        log = os.path.join(out, "launch.log")
        run_logged(cmd, {contract.MAX_STEPS.name: str(warmup + steps + 1), contract.BENCH_OUT.name: out, **env}, log)
        files = sorted(glob.glob(os.path.join(out, "rank*.json")))
        if len(files) != nproc:
            with open(log) as f:
                tail = f.read()[-1500:]
            raise RuntimeError(f"`{' '.join(cmd)}` left {len(files)} of {nproc} step records (the training loader "
                               f"must come from ddpkit.data_loader); output ends with:\n{tail}")
        return step_ms(files, warmup)


def plan(counts: Sequence[int], gpus: int) -> dict[str, tuple[int, dict]]:
    """name -> (processes, extra environment) of every configuration to run."""
    jobs: dict[str, tuple[int, dict]] = {f"n{n}": (n, {}) for n in counts}
    top = max(counts)
    if top > 1:
        jobs["no_comm"] = (top, {contract.BENCH_NO_COMM.name: "1"})
        for name, fields in {**SETTINGS, **(LOSSY if gpus else {})}.items():
            jobs[name] = (top, {contract.COMM.name: json.dumps(fields)})
    return jobs


def sign_test(wins: int, reps: int) -> float:
    """One-sided sign test: the chance of ``wins`` or more of ``reps`` paired repetitions beating the threshold
    when the setting's true median speed-up is at or below it (each repetition a coin flip at worst).

    >>> sign_test(2, 2), round(sign_test(6, 6), 4), round(sign_test(8, 9), 4)
    (0.25, 0.0156, 0.0195)
    """
    return sum(math.comb(reps, k) for k in range(wins, reps + 1)) / 2 ** reps


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free interval for the median (order statistics) with coverage >= ``level`` where the
    repetitions allow it, else the widest one, [min, max]; returns (low, high, its coverage).

    >>> median_interval([1.0, 1.1, 0.9])[2], median_interval([float(v) for v in range(10)])[:2]
    (0.75, (1.0, 8.0))
    """
    ordered, n = sorted(values), len(values)
    best = (ordered[0], ordered[-1], 1 - 2 * 0.5 ** n)
    for j in range(1, n // 2 + 1):  # [x_j, x_(n-j+1)] (1-based) covers the median with 1 - 2 P(Bin(n, .5) < j)
        coverage = 1 - 2 * sum(math.comb(n, k) for k in range(j)) / 2 ** n
        if coverage < level:
            break
        best = (ordered[j - 1], ordered[n - j], coverage)
    return best


def figures(samples: dict[str, list[float]], batches: dict[str, int], counts: Sequence[int]) -> dict:
    """Throughput, efficiency, communication share and the recommendation from the step times of each rep.

    The decision rule, with its error rate: each repetition pairs a setting with the same repetition's default
    run; a setting is recommended only when the repetitions it beat the default in by ``MIN_GAIN`` are too many
    to be chance (one-sided sign test at ``ALPHA`` divided by the number of settings tried: Bonferroni), so at
    most a 5 % chance of any false recommendation. Two repetitions can never pass it; with three settings it
    takes six out of six, or eight of nine.
    """
    times = {name: statistics.median(values) for name, values in samples.items()}
    top, one = max(counts), min(counts)
    rows = [{"nproc": n, "step_ms": times[f"n{n}"], "samples_per_s": batches[f"n{n}"] / times[f"n{n}"] * 1e3}
            for n in sorted(counts)]
    base = rows[0]["samples_per_s"] / one
    for row in rows:
        row["efficiency"] = row["samples_per_s"] / (row["nproc"] * base)
    result: dict[str, Any] = {"rows": rows}
    if top > 1:
        default = samples[f"n{top}"]
        result["comm_share"] = max(0.0, (times[f"n{top}"] - times["no_comm"]) / times[f"n{top}"])
        tried = [k for k in samples if k in {**SETTINGS, **LOSSY}]
        result["settings_ms"] = {"default": times[f"n{top}"], **{k: times[k] for k in tried}}
        gains = {k: [d / t for d, t in zip(default, samples[k])] for k in tried}
        result["speedups"] = {k: statistics.median(g) for k, g in gains.items()}
        intervals = {k: median_interval(g) for k, g in gains.items()}
        result["speedups_ci"] = {k: [low, high] for k, (low, high, _) in intervals.items()}
        result["speedups_ci_level"] = {k: level for k, (_, _, level) in intervals.items()}
        limit = ALPHA / max(1, len(tried))
        pvalues = {k: sign_test(sum(x >= MIN_GAIN for x in g), len(g)) for k, g in gains.items()}
        winners = [k for k in tried if pvalues[k] <= limit]
        result["recommendation"] = _recommend(winners, result["speedups"], intervals, times, top, len(default), limit)
    return result


def _recommend(winners: list[str], speedups: dict[str, float], intervals: dict[str, tuple[float, float, float]],
               times: dict[str, float], top: int, reps: int, limit: float) -> dict[str, Any]:
    if winners:
        best = max(winners, key=lambda k: speedups[k])
        low, high, level = intervals[best]
        lossy = " (lossy: check your loss curve)" if best in LOSSY else ""
        return {"setting": best, "fields": {**SETTINGS, **LOSSY}[best], "speedup": speedups[best],
                "reason": f"{best}: {times[best]:.1f} ms/step vs {times[f'n{top}']:.1f} ms with the defaults at {top} "
                          f"processes, speed-up {speedups[best]:.2f} ({low:.2f}-{high:.2f}, {level:.0%} interval), "
                          f">= {MIN_GAIN:.2f}x in too many of {reps} repetitions to be chance{lossy}"}
    needed = next(n for n in range(1, 64) if sign_test(n, n) <= limit)
    spread = ", ".join(f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi, _) in intervals.items())
    return {"setting": "default", "fields": {}, "speedup": 1.0,
            "reason": f"keep the defaults: no measurable difference at {top} processes (speed-ups {spread}); "
                      f"a recommendation needs >= {needed} repetitions all {MIN_GAIN:.2f}x faster "
                      f"(--reps {max(needed, reps + 1)})" if reps < needed else
                      f"keep the defaults: no setting was {MIN_GAIN:.2f}x faster often enough to rule out chance "
                      f"at {top} processes (speed-ups {spread})"}


def bench(script: str, args: Sequence[str], counts: Sequence[int], steps: int, warmup: int, reps: int,
          gpus: int, base_env: dict[str, str] | None = None) -> dict:
    jobs = plan(counts, gpus)
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    batches: dict[str, int] = {}
    for _ in range(reps):  # interleaved: every configuration once per repetition, so drift hits all alike
        for name, (nproc, env) in jobs.items():
            ms, batches[name] = run_once(script, args, nproc, steps, warmup, {**(base_env or {}), **env})
            samples[name].append(ms)
    result = figures(samples, batches, counts)
    result["mode_note"] = ("DDP: DataParallel is for 2+ CUDA GPUs in one process, and DDP is faster there too"
                           if gpus < 2 else "DDP (one process per GPU) is what ddpkit runs by default")
    return {"script": script, "steps": steps, "warmup": warmup, "reps": reps, **result}


def plot(result: dict, path: str) -> str | None:
    """Throughput against processes (with the ideal line) and the settings' step times; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2 if "settings_ms" in result else 1, figsize=(10, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["nproc"] for r in rows], [r["samples_per_s"] for r in rows], "o-", label="measured")
    ax.plot([r["nproc"] for r in rows], [rows[0]["samples_per_s"] / rows[0]["nproc"] * r["nproc"] for r in rows],
            "--", label="ideal")
    ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=[r["nproc"] for r in rows])
    ax.legend()
    if "settings_ms" in result:
        names = list(result["settings_ms"])
        axes[0][1].bar(names, [result["settings_ms"][n] for n in names])
        axes[0][1].set(ylabel="ms per step (lower is better)", title=f"settings at {rows[-1]['nproc']} processes")
        axes[0][1].tick_params(axis="x", rotation=20)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(result: dict) -> str:
    lines = [f"{PROG}: {result['script']}, {result['steps']} steps after {result['warmup']} warm-up, "
             f"{result['reps']} interleaved repetitions, median of the slowest rank",
             "processes  step ms  samples/s  efficiency"]
    lines += [f"{r['nproc']:>9}  {r['step_ms']:7.1f}  {r['samples_per_s']:9.0f}  {r['efficiency']:10.2f}"
              for r in result["rows"]]
    if "comm_share" in result:
        top = result['rows'][-1]['nproc']
        lines.append(f"communication: {result['comm_share']:.0%} of the step at {top} processes "
                     "(the same run with gradient communication skipped)")
        lines.append("settings: " + ", ".join(f"{k} {v:.1f} ms" for k, v in result["settings_ms"].items()))
        lines.append(f"recommendation: {result['recommendation']['reason']}")
    lines.append(f"mode: {result['mode_note']}")
    return "\n".join(lines)


def cap_counts(counts: Sequence[int], explicit: bool, device: str | None, gpus: int) -> tuple[list[int], str | None]:
    """The process counts to run on ``gpus`` usable GPUs, and a note when the default was capped.

    One process per GPU: the default 1,2 becomes 1 on a one-GPU host; counts asked for explicitly above the
    GPU count are an error naming ``--device cpu``.

    >>> cap_counts([1, 2], False, None, 1), cap_counts([1, 2], False, None, 0), cap_counts([1, 2], True, "cpu", 0)
    (([1], 'processes capped at the 1 usable GPU(s): 1 (--device cpu for more)'), ([1, 2], None), ([1, 2], None))
    """
    if device == "cpu" or gpus == 0 or max(counts) <= gpus:
        return list(counts), None
    if explicit:
        raise UsageError(f"--nproc {','.join(map(str, counts))} needs {max(counts)} GPUs, {gpus} usable; "
                          f"pass counts up to {gpus} or --device cpu")
    kept = [n for n in counts if n <= gpus]
    return kept, f"processes capped at the {gpus} usable GPU(s): {','.join(map(str, kept))} (--device cpu for more)"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        counts = sorted({int(part) for part in (ns.nproc or "1,2").split(",") if part.strip()})
        if not counts or counts[0] < 1 or ns.steps < 2 or ns.warmup < 0 or ns.reps < 1 or not os.path.isfile(ns.script):
            raise ValueError
    except (UsageError, ValueError):
        print(f"{PROG}: error: need --nproc like 1,2 (counts >= 1), --steps >= 2, --warmup >= 0, --reps >= 1 and "
              f"an existing script; got {sys.argv[1:] if argv is None else list(argv)}", file=sys.stderr)
        return USAGE_ERROR
    import torch

    gpus = 0 if ns.device == "cpu" else torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        counts, note = cap_counts(counts, ns.nproc is not None, ns.device, gpus)
    except UsageError as exc:
        return usage_error(PROG, exc)
    if note:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    try:
        result = bench(ns.script, ns.script_args, counts, ns.steps, ns.warmup, ns.reps, gpus,
                       {contract.DEVICE.name: ns.device} if ns.device else {})
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return SCRIPT_FAILED
    result["plot"] = plot(result, ns.plot) if ns.plot else None
    if ns.json:
        print(json.dumps(result))
    else:
        print(report(result))
        print(f"plot: {result['plot']}" if result["plot"] else "plot: none (pip install matplotlib for the PNG)")
    return 0
