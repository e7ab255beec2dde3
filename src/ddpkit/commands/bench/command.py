"""``ddpkit bench script.py [args]``: your training step at 1..N processes, measured.

Reports throughput (samples/s) and scaling efficiency at each process count, the share of the step that
communication takes (the same run with gradient communication skipped; and, from the phase report that
``ddpkit launch`` writes for each default run, the slowest rank's wait in communication after its last
gradient: :func:`phase_comm`), the communication settings tried at
the largest count, and a recommendation only where a setting measured faster than the default in this same
run by more than chance allows (:mod:`ddpkit.commands.bench.stats`: the decision rule and its error rate). Runs are
interleaved (every configuration once per repetition); each figure is the median over steps of the slowest
rank's step, then over repetitions, with a distribution-free interval. After ``--reps`` repetitions, the
default and the settings still undecided run again until each is decided or ``--budget-s`` is spent.
Settings that cannot change this model's step (a bucket size above its gradient bytes, compression where
communication is too small a share) are skipped, and the output says why.

What the script needs: ``ddpkit.data_loader`` for the training data (the bench times the batches it hands
out) and ``ddpkit.prepare_model`` (to apply the settings). It talks to the runs through documented variables:
``DDPKIT_MAX_STEPS`` (stop after K batches), ``DDPKIT_BENCH_OUT`` (each rank writes its batch times there),
``DDPKIT_COMM`` (JSON of :class:`ddpkit.CommConfig` fields) and ``DDPKIT_BENCH_NO_COMM`` (skip communication).

Example::

    ddpkit bench --nproc 1,2 --steps 30 examples/digits.py --epochs 100
    ddpkit bench --json examples/digits.py          # one JSON object on stdout
    ddpkit bench --aa --nproc 2 examples/digits.py  # the default against itself: should recommend nothing
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.commands import itself
from ddpkit.commands.bench import stats
from ddpkit.commands.bench.phases import phase_comm, phase_figures, phase_line
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.commands.logtail import log_tail, run_logged
from ddpkit.core import contract
from ddpkit.core.environment import visible_gpus
from ddpkit.core.errors import SCRIPT_FAILED, USAGE_ERROR, UsageError
from ddpkit.runtime import phases

PROG = "ddpkit bench"
MIN_GAIN = stats.MIN_GAIN
LAST_LOOK = 20  # repetitions at most: the sequential test's boundary is computed for looks up to here
Fields = dict[str, dict[str, Any]]  # setting name -> CommConfig fields
SETTINGS: Fields = {"gradient_as_bucket_view": {"gradient_as_bucket_view": True}, "bucket_5mb": {"bucket_mb": 5},
                    "bucket_100mb": {"bucket_mb": 100}}
LOSSY: Fields = {"bf16": {"compression": "bf16"}}  # tried on GPUs only: on CPU the casts cost more than they save
AA: Fields = {"default_again": {}}  # --aa: the default measured as if it were a setting (an A/A test of the rule)
FIELDS = {**SETTINGS, **LOSSY, **AA}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Throughput, scaling and communication share of a training script.")
    p.add_argument("--nproc", default=None,
                   help="process counts to run, comma-separated (default 1,2, capped at the usable GPU count)")
    p.add_argument("--device", default=None, help="auto (default), cpu or cuda: where the runs train")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of each run (default 5)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of everything (default 2)")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="then repeat the undecided settings until this many seconds are spent (default 120; 0: no)")
    p.add_argument("--aa", action="store_true", help="also measure the default as if it were a setting (A/A)")
    p.add_argument("--plot", default=os.path.join("runs", "bench", "bench.png"), help="PNG path ('' for none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def read_records(rank_files: Sequence[str], warmup: int) -> dict[str, Any]:
    """From the ranks' records: the median over steps of the slowest rank's step (ms), the global batch, and
    the largest DDP-wrapped model's gradient bytes and bucket cap (absent without DDP)."""
    records = []
    for path in rank_files:
        with open(path) as f:
            records.append(json.load(f))
    steps = [[b - a for a, b in zip(r["times"], r["times"][1:])][warmup:] for r in records]
    slowest = [max(per_rank) for per_rank in zip(*steps)]
    if not slowest:
        raise RuntimeError(f"only {min(len(r['times']) for r in records)} batches were timed; the training loop "
                           f"must take more than --warmup + 1 batches from ddpkit.data_loader")
    out = {"ms": statistics.median(slowest) * 1e3, "global_batch": records[0]["global_batch"]}
    wrapped = records[0].get("ddp") or []
    if wrapped:
        out.update(max(wrapped, key=lambda w: w["grad_bytes"]))
    return out


def run_once(script: str, args: Sequence[str], nproc: int, steps: int, warmup: int, env: dict) -> dict[str, Any]:
    """One launch of the script; returns :func:`read_records` of its ranks, with ``phases``: :func:`phase_comm`
    of its phase report (which ``ddpkit launch`` runs by default)."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as out:
        cmd = itself.command("launch", "--nproc-per-node", str(nproc),
                             "--log-dir", os.path.join(out, "logs"), script, *args)
        log = os.path.join(out, "launch.log")
        # the workers load bench's hooks by module (a checkout on PYTHONPATH works): step cap, hand-out times,
        # the DDP sizes
        # the phase report on (off by default): the communication share comes from it
        window = os.environ.get(contract.PHASE_WINDOW.name) or str(phases.DEFAULT_WINDOW)
        run_logged(cmd, {contract.TOOL.name: "ddpkit.commands.bench.hooks:from_env", contract.PHASE_WINDOW.name: window,
                         contract.MAX_STEPS.name: str(warmup + steps + 1), contract.BENCH_OUT.name: out, **env}, log)
        files = sorted(glob.glob(os.path.join(out, "rank*.json")))
        if len(files) != nproc:
            tail = log_tail(log, 1500)  # whole lines, bytes that are not UTF-8 replaced
            raise RuntimeError(f"`{' '.join(cmd)}` left {len(files)} of {nproc} step records (the training loader "
                               f"must come from ddpkit.data_loader); output ends with:\n{tail}")
        # the launcher keeps rank 0's report in the run's folder under --log-dir (a fresh one: one run in it)
        kept = sorted(glob.glob(os.path.join(out, "logs", "*", "phases.json")))
        return {**read_records(files, warmup), "phases": phase_comm(os.path.dirname(kept[-1])) if kept else None}


def plan(counts: Sequence[int], gpus: int, aa: bool = False) -> tuple[dict[str, tuple[int, dict]], dict[str, dict]]:
    """The base configurations (name -> (processes, extra environment)) and the candidate settings (name ->
    CommConfig fields) to try at the largest count."""
    jobs: dict[str, tuple[int, dict]] = {f"n{n}": (n, {}) for n in counts}
    if max(counts) == 1:
        return jobs, {}
    jobs["no_comm"] = (max(counts), {contract.BENCH_NO_COMM.name: "1"})
    return jobs, {**SETTINGS, **(LOSSY if gpus else {}), **(AA if aa else {})}


def skipped(candidates: dict[str, dict], first: dict[str, Any], comm_share: float) -> dict[str, str]:
    """The candidate settings that cannot change the step, with the reason, from the first default run.

    Two bucket caps give the same buckets when the gradients fit under both. Compression at best halves the
    communicated bytes, so below a communication share s it cannot beat 1 / (1 - s / 2) < MIN_GAIN.

    >>> skipped({"bucket_5mb": {"bucket_mb": 5}, "bf16": {"compression": "bf16"}},
    ...         {"grad_bytes": 160_000, "bucket_bytes": 25 * 2**20}, 0.04)["bucket_5mb"]
    'the gradients (0.15 MB) fit in one bucket at 5 MB and at the default 25 MB: the same run as the default'
    """
    out = {}
    grads, cap = first.get("grad_bytes"), first.get("bucket_bytes")
    for name, fields in candidates.items():
        mb = fields.get("bucket_mb")
        if mb is not None and grads is not None and cap and grads <= min(mb * 2**20, cap):
            out[name] = (f"the gradients ({grads / 2**20:.2f} MB) fit in one bucket at {mb:g} MB and at the default "
                         f"{cap / 2**20:g} MB: the same run as the default")
        if "compression" in fields and 1 / (1 - comm_share / 2) < MIN_GAIN:
            out[name] = (f"communication is {comm_share:.0%} of the step: halving its bytes cannot make the step "
                         f"{MIN_GAIN:.2f}x faster")
    return out


def figures(samples: dict[str, list[float]], batches: dict[str, int], counts: Sequence[int],
            needed: dict[int, float] | None = None) -> dict:
    """Throughput, efficiency, communication share and the recommendation from the step times of each rep.

    ``needed``: the sequential boundary the repetitions were run under (:func:`stats.boundary`); by
    default one look after all repetitions. A setting is recommended when its paired speed-ups crossed it.
    """
    times = {name: statistics.median(values) for name, values in samples.items()}
    top, one = max(counts), min(counts)
    rows = []
    for n in sorted(counts):
        eff = [(batches[f"n{n}"] / t) / (n * batches[f"n{one}"] / t1 / one)
               for t, t1 in zip(samples[f"n{n}"], samples[f"n{one}"])]
        rows.append({"nproc": n, "step_ms": times[f"n{n}"], "samples_per_s": batches[f"n{n}"] / times[f"n{n}"] * 1e3,
                     "efficiency": statistics.median(eff), "efficiency_ci95": list(stats.median_interval(eff)[:2])})
    result: dict[str, Any] = {"rows": rows, "reps_ms": samples}
    if top == 1:
        return result
    default = samples[f"n{top}"]
    shares = [max(0.0, (d - c) / d) for d, c in zip(default, samples["no_comm"])]
    result.update(comm_share=statistics.median(shares), comm_share_ci95=list(stats.median_interval(shares)[:2]))
    tried = [k for k in samples if k in FIELDS]
    result["settings_ms"] = {"default": times[f"n{top}"], **{k: times[k] for k in tried}}
    gains = {k: [d / t for d, t in zip(default, samples[k])] for k in tried}
    needed = needed or stats.boundary(len(tried), len(default), len(default))
    result["speedups"] = {k: statistics.median(g) for k, g in gains.items()}
    intervals = {k: stats.median_interval(g) for k, g in gains.items()}
    result["speedups_ci95"] = {k: [low, high] for k, (low, high, _) in intervals.items()}
    result["speedups_ci_level"] = {k: level for k, (_, _, level) in intervals.items()}
    winners = [k for k in tried if stats.crossed(gains[k], needed)]
    result["recommendation"] = _recommend(winners, result["speedups"], intervals, times, top, gains, needed)
    return result


def _recommend(winners: list[str], speedups: dict[str, float], intervals: dict[str, tuple[float, float, float]],
               times: dict[str, float], top: int, gains: dict[str, list[float]],
               needed: dict[int, float]) -> dict[str, Any]:
    if winners:
        best = max(winners, key=lambda k: speedups[k])
        low, high, level = intervals[best]
        lossy = " (lossy: check your loss curve)" if best in LOSSY else ""
        return {"setting": best, "fields": FIELDS[best], "speedup": speedups[best],
                "reason": f"{best}: {times[best]:.1f} ms/step vs {times[f'n{top}']:.1f} ms with the defaults at {top} "
                          f"processes, speed-up {speedups[best]:.2f} ({low:.2f}-{high:.2f}, {level:.0%} interval); "
                          f">= {MIN_GAIN:.2f}x beyond chance after {len(gains[best])} repetitions (signed-rank test, "
                          f"5 % over {len(gains)} setting(s) and every look){lossy}"}
    spread = ", ".join(f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi, _) in intervals.items())
    reps = min((len(g) for g in gains.values()), default=0)
    undecided = [k for k, g in gains.items() if stats.settled(g, needed) is None]
    # the fewest repetitions that could ever recommend: under this boundary, else with one look at the end
    first = stats.fewest(needed) or next(n for n in range(1, 64) if stats.fewest(stats.boundary(len(gains), n, n)))
    hint = "" if not undecided else (
        f"; a recommendation needs >= {first} repetitions all {MIN_GAIN:.2f}x faster (more --budget-s or --reps)"
        if reps < first else f"; undecided after {reps} repetitions: {', '.join(undecided)} (more --budget-s)")
    return {"setting": "default", "fields": {}, "speedup": 1.0,
            "reason": f"keep the defaults: no measurable difference at {top} processes "
                      f"(speed-ups {spread or 'none tried'}){hint}"}


def bench(script: str, args: Sequence[str], counts: Sequence[int], steps: int, warmup: int, reps: int,
          gpus: int, base_env: dict[str, str] | None = None, budget_s: float = 0.0, aa: bool = False,
          runner: Callable[..., dict[str, Any]] = run_once) -> dict:
    """Run the plan: ``reps`` repetitions of everything, then the adaptive ones within ``budget_s``.
    ``runner`` is :func:`run_once` (tests/test_bench.py simulates noisy runs with it to check the rule)."""
    jobs, candidates = plan(counts, gpus, aa)
    top, started = max(counts), time.monotonic()
    first_default: dict[str, Any] = {}
    skip: dict[str, str] = {}
    samples: dict[str, list[float]] = {name: [] for name in jobs}
    batches: dict[str, int] = {}
    last_ms: dict[str, float] = {}
    phase_runs: list[dict[str, Any]] = []  # the default runs' phase reports, at the top count

    def run(name: str, nproc: int, env: dict) -> dict[str, Any]:
        begun = time.monotonic()
        record = runner(script, args, nproc, steps, warmup, {**(base_env or {}), **env})
        samples.setdefault(name, []).append(record["ms"])
        if name == f"n{top}" and record.get("phases"):
            phase_runs.append(record["phases"])
        batches[name], last_ms[name] = record["global_batch"], time.monotonic() - begun
        return record

    def paired(names: list[str], rep: int) -> None:
        """The default at the top count and these settings, in an order that rotates with the repetition, so no
        configuration always runs first or after the same neighbour (warm caches, drift of the machine)."""
        group = [f"n{top}", *names]
        for name in group[rep % len(group):] + group[:rep % len(group)]:
            run(name, top, {contract.COMM.name: json.dumps(candidates[name])} if name in candidates else {})

    for rep in range(reps):  # interleaved: every configuration once per repetition, so drift hits all alike
        for name, (nproc, env) in jobs.items():
            if rep == 0 or name != f"n{top}" or not candidates:
                record = run(name, nproc, env)
                first_default = record if rep == 0 and name == f"n{top}" else first_default
        if candidates and rep == 0:  # after the first default and no-communication runs: drop what can't matter
            skip = skipped(candidates, first_default, max(0.0, 1 - samples["no_comm"][0] / samples[f"n{top}"][0]))
            candidates = {k: v for k, v in candidates.items() if k not in skip}
            for name, fields in candidates.items():
                run(name, top, {contract.COMM.name: json.dumps(fields)})
        elif candidates:
            paired(list(candidates), rep)
    last = max(reps, LAST_LOOK) if budget_s > 0 else reps
    needed = stats.boundary(len(candidates), reps, last)
    stopped = "--reps done, no budget for more" if budget_s <= 0 else None
    while candidates and stopped is None:  # the adaptive part: only the default and the undecided settings
        default = samples[f"n{top}"]
        open_ = [k for k in candidates if not stats.settled([d / t for d, t in zip(default, samples[k])], needed)]
        if not open_:
            stopped = "every setting decided"
        elif len(default) >= last:
            stopped = f"{last} repetitions (the last look)"
        elif time.monotonic() - started + sum(last_ms[k] for k in [f"n{top}", *open_]) > budget_s:
            stopped = f"--budget-s {budget_s:g} spent"
        else:
            paired(open_, len(default))
    result = figures(samples, batches, counts, needed if candidates else None)
    if stopped and stopped.startswith("--budget-s") and result["recommendation"]["setting"] == "default":
        per_rep = sum(last_ms[k] for k in [f"n{top}", *candidates])  # a rough price of one more repetition
        result["recommendation"]["reason"] += f"; one more repetition takes ~{per_rep:.0f} s"
    result["skipped"] = skip
    if top > 1:
        result.update(phase_figures(phase_runs))
    result["mode_note"] = ("DDP: DataParallel is for 2+ CUDA GPUs in one process, and DDP is faster there too"
                           if gpus < 2 else "DDP (one process per GPU) is what ddpkit runs by default")
    return {"script": script, "steps": steps, "warmup": warmup, "reps": len(samples[f"n{top}"]), "min_reps": reps,
            "budget_s": budget_s, "seconds": time.monotonic() - started, "stopped": stopped, **result}


def plot(result: dict, path: str) -> str | None:
    """Throughput against processes (with the ideal line) and the settings' step times; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows, reps = result["rows"], result["reps_ms"]
    fig, axes = plt.subplots(1, 2 if "settings_ms" in result else 1, figsize=(10, 4), squeeze=False)
    ax = axes[0][0]
    counts = [r["nproc"] for r in rows]
    ax.plot(counts, [r["samples_per_s"] for r in rows], "o-", label="median")
    for r in rows:  # every repetition as a dot: the spread, not only the median
        ax.plot([r["nproc"]] * len(reps[f"n{r['nproc']}"]),
                [r["samples_per_s"] * r["step_ms"] / ms for ms in reps[f"n{r['nproc']}"]], ".", color="gray")
    ax.plot(counts, [rows[0]["samples_per_s"] / rows[0]["nproc"] * n for n in counts], "--", label="ideal")
    ax.set(xlabel="processes", ylabel="samples/s", title="throughput", xticks=counts)
    ax.legend()
    if "settings_ms" in result:
        names = list(result["settings_ms"])
        key = {"default": f"n{rows[-1]['nproc']}"}
        axes[0][1].bar(names, [result["settings_ms"][n] for n in names], color="lightsteelblue", label="median")
        for i, name in enumerate(names):
            values = reps[key.get(name, name)]
            axes[0][1].plot([i] * len(values), values, ".", color="black")
        axes[0][1].set(ylabel="ms per step (lower is better)",
                       title=f"settings at {rows[-1]['nproc']} processes, dots: repetitions")
        axes[0][1].tick_params(axis="x", rotation=20)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(result: dict) -> str:
    lines = [f"{PROG}: {result['script']}, {result['steps']} steps after {result['warmup']} warm-up, "
             f"{result['min_reps']}+ interleaved repetitions, median of the slowest rank",
             "processes  step ms  samples/s  efficiency (interval)"]
    lines += [f"{r['nproc']:>9}  {r['step_ms']:7.1f}  {r['samples_per_s']:9.0f}  {r['efficiency']:10.2f} "
              f"({r['efficiency_ci95'][0]:.2f}-{r['efficiency_ci95'][1]:.2f})" for r in result["rows"]]
    if "comm_share" in result:
        top, (low, high) = result["rows"][-1]["nproc"], result["comm_share_ci95"]
        lines.append(f"communication: {result['comm_share']:.0%} of the step at {top} processes ({low:.0%}-{high:.0%}; "
                     "the same run with gradient communication skipped)")
        lines.append(phase_line(result))
        ci = result["speedups_ci95"]
        lines.append("settings: " + ", ".join(
            f"{k} {v:.1f} ms" + (f" ({result['speedups'][k]:.2f}x, {ci[k][0]:.2f}-{ci[k][1]:.2f})" if k in ci else "")
            for k, v in result["settings_ms"].items()))
        lines += [f"skipped {k}: {why}" for k, why in result["skipped"].items()]
        lines.append(f"recommendation: {result['recommendation']['reason']}")
        lines.append(f"stopped after {result['reps']} repetitions, {result['seconds']:.0f} s: {result['stopped']}")
    lines.append(f"mode: {result['mode_note']}")
    lines.append("intervals: of the median over repetitions (order statistics): 95 % from 6 repetitions on, "
                 "min-max with fewer")
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
        if (not counts or counts[0] < 1 or ns.steps < 2 or ns.warmup < 0 or ns.reps < 1 or ns.budget_s < 0
                or not os.path.isfile(ns.script)):
            raise ValueError
    except (UsageError, ValueError):
        print(f"{PROG}: error: need --nproc like 1,2 (counts >= 1), --steps >= 2, --warmup >= 0, --reps >= 1, "
              f"--budget-s >= 0 and an existing script; got {sys.argv[1:] if argv is None else list(argv)}",
              file=sys.stderr)
        return USAGE_ERROR
    gpus = 0 if ns.device == "cpu" else visible_gpus()
    try:
        counts, note = cap_counts(counts, ns.nproc is not None, ns.device, gpus)
    except UsageError as exc:
        return usage_error(PROG, exc)
    if note:
        print(f"{PROG}: {note}", file=sys.stderr, flush=True)
    try:
        result = bench(ns.script, ns.script_args, counts, ns.steps, ns.warmup, ns.reps, gpus,
                       {contract.DEVICE.name: ns.device} if ns.device else {}, ns.budget_s, ns.aa)
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
