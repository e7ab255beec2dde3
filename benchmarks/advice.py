"""`make bench` parts "aa" and "advice": does `ddpkit bench`'s advice hold up when run many times?

- aa: `ddpkit bench --nproc 2 --aa` at its defaults on examples/digits.py (~0.15 MB of gradients: no
  communication setting can change its step; --aa adds the default itself as a fourth candidate), 20 times.
  Counts the runs that recommended anything, with an exact 95 % interval of that rate (target <= 5 %).
- advice: `ddpkit bench --nproc 2 --budget-s 300` on benchmarks/comm_bound.py (~33 MB of gradients, where
  gradient_as_bucket_view measures ~1.1-1.2x faster), 5 times: in how many is that setting found.

Each run's JSON goes to benchmarks/results/advice_runs.json; the A/A figure to docs/img/bench-aa.png.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ddpkit.commands.bench.stats import proportion_interval

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / "results" / "advice_runs.json"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def ddpkit_bench(*args):
    r = subprocess.run([sys.executable, "-m", "ddpkit", "bench", "--json", "--plot", "", *args], cwd=ROOT,
                       env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"ddpkit bench {' '.join(args)} failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout)


def _save(key, runs):
    saved = json.loads(RUNS.read_text()) if RUNS.exists() else {}
    saved[key] = runs
    RUNS.write_text(json.dumps(saved, indent=1) + "\n")


def aa(n):
    with tempfile.TemporaryDirectory() as tmp:  # digits' TensorBoard logs
        runs = [ddpkit_bench("--nproc", "2", "--aa", "examples/digits.py", "--epochs", "100", "--logdir", tmp)
                for _ in range(n)]
    _save("aa", runs)
    false = sum(r["recommendation"]["setting"] != "default" for r in runs)
    low, high = proportion_interval(false, n)
    plot_aa(runs)
    return {"aa_runs": n, "aa_false_recommendations": false, "aa_false_rate": false / n,
            "aa_false_rate_ci95": [low, high], "aa_settings_tried": sorted({k for r in runs for k in r["speedups"]}),
            "aa_reps_median": statistics.median(r["reps"] for r in runs),
            "aa_seconds_median": statistics.median(r["seconds"] for r in runs)}


def comm_bound(n):
    runs = [ddpkit_bench("--nproc", "2", "--budget-s", "300", "benchmarks/comm_bound.py") for _ in range(n)]
    _save("comm_bound", runs)
    found = sum(r["recommendation"]["setting"] == "gradient_as_bucket_view" for r in runs)
    return {"advice_runs": n, "advice_found_grad_view": found, "advice_found_rate": found / n,
            "advice_found_rate_ci95": list(proportion_interval(found, n)),
            "advice_grad_view_speedup": statistics.median(r["speedups"]["gradient_as_bucket_view"] for r in runs),
            "advice_reps_median": statistics.median(r["reps"] for r in runs),
            "advice_seconds_median": statistics.median(r["seconds"] for r in runs),
            "advice_recommended": [r["recommendation"]["setting"] for r in runs]}


def plot_aa(runs):
    sys.path.append(str(HERE / ".peers"))  # matplotlib lives there
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for offset, (name, color) in enumerate([("default_again", "tab:blue"), ("gradient_as_bucket_view", "tab:orange")]):
        xs = [i + 0.15 * offset for i, r in enumerate(runs) if name in r["speedups"]]
        mids = [r["speedups"][name] for r in runs if name in r["speedups"]]
        los = [m - r["speedups_ci95"][name][0] for m, r in zip(mids, runs)]
        his = [r["speedups_ci95"][name][1] - m for m, r in zip(mids, runs)]
        ax.errorbar(xs, mids, yerr=[los, his], fmt="o", color=color, label=name, capsize=2)
    ax.axhline(1.0, color="gray", lw=1)
    ax.axhline(1.05, color="red", lw=1, ls="--", label="recommend only above 1.05x, with evidence")
    false = sum(r["recommendation"]["setting"] != "default" for r in runs)
    ax.set(xlabel="run", ylabel="speed-up vs default (median, interval)", xticks=range(0, len(runs), 2),
           title=f"A/A: ddpkit bench --nproc 2 --aa on digits: {false} of {len(runs)} runs recommended anything")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "img" / "bench-aa.png", dpi=100)
