"""`ddpkit bench`: the figures from the ranks' records (pure), and a real run on the digits example."""
import json
import math
import random
import statistics
import sys

import pytest

from conftest import ROOT, ok, run_cmd
from ddpkit.commands.bench import stats
from ddpkit.commands.bench.command import bench, figures, read_records, report, skipped
from ddpkit.commands.bench.phases import phase_comm
from ddpkit.core import straggler

DIGITS = ROOT / "examples" / "digits.py"


def test_step_time_is_the_median_of_the_slowest_ranks_steps_after_warm_up(tmp_path):
    for rank, times in enumerate([[0, 1, 2, 3, 4.0], [0, 1, 2.5, 3, 5.0]]):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"times": times, "global_batch": 8}))
    record = read_records(sorted(map(str, tmp_path.glob("rank*.json"))), warmup=1)
    # intervals after the first: rank 0 [1, 1, 1], rank 1 [1.5, 0.5, 2] -> slowest [1.5, 1, 2] -> median 1.5 s
    assert record == {"ms": 1500.0, "global_batch": 8}


def samples(**settings):
    return {"n1": [10.0, 10.0], "n2": [12.0, 12.4], "no_comm": [9.0, 9.0], **settings}


def test_a_setting_is_recommended_only_with_evidence_beyond_chance():
    """Issue 18: paired signed-rank test at 5 % / settings tried. Two repetitions never recommend (a coin
    flipped twice); six out of six do, with two settings and one look; one lucky repetition does not."""
    batches = {"n1": 32, "n2": 64}
    two = figures(samples(bucket_5mb=[10.0, 11.5], gradient_as_bucket_view=[10.0, 12.5]), batches, [1, 2])
    assert two["recommendation"]["setting"] == "default"  # 1.2x and 1.08x: faster twice, but twice is chance
    assert "needs >= 6 repetitions" in two["recommendation"]["reason"]
    assert two["speedups_ci95"]["bucket_5mb"] == [pytest.approx(12.4 / 11.5), pytest.approx(12 / 10)]
    assert two["rows"][1]["efficiency"] == pytest.approx(statistics.median([(64 / 12) / (2 * 32 / 10),
                                                                             (64 / 12.4) / (2 * 32 / 10)]))
    assert two["comm_share"] == pytest.approx(statistics.median([(12 - 9) / 12, (12.4 - 9) / 12.4]))
    assert two["comm_share_ci95"] == [pytest.approx(3 / 12), pytest.approx(3.4 / 12.4)]
    six = {"n1": [10.0] * 6, "n2": [12.0, 12.4, 12.1, 12.3, 12.2, 12.0], "no_comm": [9.0] * 6}
    result = figures({**six, "bucket_5mb": [10.5, 11.0, 10.8, 11.2, 10.9, 10.6],
                      "gradient_as_bucket_view": [12.0, 11.0, 12.5, 12.1, 12.6, 11.9]}, batches, [1, 2])
    assert result["recommendation"]["setting"] == "bucket_5mb" and result["recommendation"]["fields"] == {
        "bucket_mb": 5}
    assert "interval" in result["recommendation"]["reason"]
    lucky = figures({**six, "bucket_5mb": [9.0, 12.4, 12.1, 12.3, 12.2, 12.0]}, batches, [1, 2])  # 1.33x once
    assert lucky["recommendation"]["setting"] == "default"


def simulated(speedups, noise, rng, grad_bytes=10**9):
    """A runner for bench(): step times with +-noise, a setting's true speed-up from ``speedups``."""
    def run(script, args, nproc, steps, warmup, env):
        fields = json.loads(env.get("DDPKIT_COMM", "{}"))
        name = next((k for k, v in speedups.items() if v[0] == fields), None) if fields else None
        ms = 10.0 / (speedups[name][1] if name else 1.0) * rng.uniform(1 - noise, 1 + noise)
        return {"ms": ms, "global_batch": 64, "grad_bytes": grad_bytes, "bucket_bytes": 25 * 2**20}
    return run


def test_the_adaptive_bench_recommends_a_setting_that_cannot_matter_at_most_5_percent_of_the_time():
    """Issue 18's A/A check of the whole adaptive procedure: three settings and --aa's copy all equal to the
    default, +-30 % noise per run (a shared 2-core box), every look up to the 20th repetition (no time budget
    binds: the worst case for looking often), 300 simulated benches."""
    rng, false, reps = random.Random(0), 0, []
    equal = {"bucket_5mb": ({"bucket_mb": 5}, 1.0), "bucket_100mb": ({"bucket_mb": 100}, 1.0),
             "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, 1.0), "default_again": ({}, 1.0)}
    for _ in range(300):
        result = bench("s.py", [], [2], 5, 1, 2, 0, budget_s=1e9, aa=True, runner=simulated(equal, 0.3, rng))
        false += result["recommendation"]["setting"] != "default"
        reps.append(result["reps"])
    assert false / 300 <= 0.05, false
    assert 2 < statistics.median(reps) < 20, reps  # it looked on, and stopped once every setting was decided


def test_the_adaptive_bench_finds_a_real_1_2x_setting_and_skips_what_cannot_matter():
    rng, found = random.Random(1), 0
    real = {"bucket_5mb": ({"bucket_mb": 5}, 1.0), "bucket_100mb": ({"bucket_mb": 100}, 0.9),
            "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, 1.2)}
    for _ in range(50):
        result = bench("s.py", [], [1, 2], 5, 1, 2, 0, budget_s=1e9, runner=simulated(real, 0.05, rng))
        found += result["recommendation"]["setting"] == "gradient_as_bucket_view"
    assert found >= 48, found
    assert result["reps"] < 20 and result["stopped"] == "every setting decided"
    tiny = bench("s.py", [], [2], 5, 1, 2, 0, budget_s=1e9, runner=simulated(real, 0.05, rng, grad_bytes=160_000))
    assert set(tiny["skipped"]) == {"bucket_5mb", "bucket_100mb"} and "one bucket" in tiny["skipped"]["bucket_5mb"]
    assert list(tiny["speedups"]) == ["gradient_as_bucket_view"]
    fixed = bench("s.py", [], [2], 5, 1, 2, 0, budget_s=0, runner=simulated(real, 0.05, rng))
    assert fixed["reps"] == 2 and "needs >= 6 repetitions" in fixed["recommendation"]["reason"]


def test_compression_is_skipped_where_communication_is_too_small_a_share():
    bf16 = {"bf16": {"compression": "bf16"}}
    assert "4% of the step" in skipped(bf16, {}, 0.04)["bf16"]
    assert skipped(bf16, {}, 0.2) == {}  # halving 20 % of the step can make it 1.11x faster: tried
    assert skipped({"bucket_5mb": {"bucket_mb": 5}}, {"grad_bytes": 33 * 2**20, "bucket_bytes": 25 * 2**20}, 0) == {}


def test_the_sequential_boundary_holds_its_error_rate_on_fresh_null_sequences():
    """The boundary comes from seeded simulated sequences; on 20,000 others (another seed, a heavy-tailed
    symmetric noise: the rank statistics do not care), a setting at the threshold crosses at any of the
    looks 2..20 at most ALPHA / settings of the time (+ the check's own simulation error)."""
    rng = random.Random(7)
    for settings in (1, 3):
        needed, crossings = stats.boundary(settings, 2, 20), 0
        for _ in range(20_000):
            gains = [1.05 * math.exp(rng.gauss(0, 0.05) * rng.choice([0.5, 1, 3])) for _ in range(20)]
            crossings += stats.crossed(gains, needed) is not None
        assert crossings / 20_000 <= 0.05 / settings + 3 * math.sqrt(0.05 / settings / 20_000), (settings, crossings)


def test_bench_on_digits_reports_scaling_comm_share_and_a_plot(tmp_path):
    png = tmp_path / "bench.png"
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "bench", "--nproc", "1,2", "--steps", "6", "--warmup", "2",
                    "--reps", "1", "--budget-s", "0", "--aa", "--json", "--plot", str(png), str(DIGITS),
                    "--logdir", str(tmp_path / "tb")],
                   timeout=300))
    result = json.loads(r.stdout)
    assert [row["nproc"] for row in result["rows"]] == [1, 2]
    assert all(row["samples_per_s"] > 0 for row in result["rows"]) and result["rows"][0]["efficiency"] == 1.0
    assert 0.0 <= result["comm_share"] < 1.0
    assert set(result["settings_ms"]) == {"default", "gradient_as_bucket_view", "default_again"}  # --aa: A/A
    # the ranks recorded digits' gradient bytes (~0.2 MB): no bucket size can change its one bucket
    assert set(result["skipped"]) == {"bucket_5mb", "bucket_100mb"}, result["skipped"]
    assert result["recommendation"]["setting"] == "default"  # one repetition never recommends
    assert result["reps_ms"]["n2"] and len(result["rows"][1]["efficiency_ci95"]) == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # issue 29: the same default run's phase report (phases.json of its launch) gives the exposed comm share
    assert 0.0 < result["phase_comm_share"] < 1.0 and len(result["phase_comm_share_ci95"]) == 2
    assert len(result["phase_comm_ranks"]) == 1 and result["phase_comm_ranks"][0] in (0, 1)


def test_the_phase_reports_comm_share_is_the_slowest_ranks_comm_over_its_step(tmp_path):
    """The slowest rank (most time of its own) waits least: its comm is the communication nothing hid, what
    skipping the communication would save; a faster rank's comm also holds its wait for the slowest."""
    fast = {"data": 1.0, "compute": 5.0, "comm": 4.0, "optimizer": 0.0, "other": 0.0}  # waits 3 ms for rank 1
    slow = {"data": 1.0, "compute": 8.0, "comm": 1.0, "optimizer": 0.0, "other": 0.0}
    (tmp_path / "phases.json").write_text(straggler.dumps(straggler.report(
        [straggler.window(0, fast, 9), straggler.window(1, slow, 9), straggler.window(2, fast, 9)], [])))
    assert phase_comm(str(tmp_path)) == {"share": pytest.approx(0.1), "rank": 1, "steps": 9}
    assert phase_comm(str(tmp_path / "absent")) is None  # the report was off, or rank 0 never shut down
    (tmp_path / "phases.json").write_text('{"v": 1, "ranks": "not ranks"}')
    assert phase_comm(str(tmp_path)) is None  # a file that is no report is no figure
    runs = iter([{"share": 0.1, "rank": 1, "steps": 9}, None, {"share": 0.3, "rank": 0, "steps": 9}])

    def runner(script, args, nproc, steps, warmup, env):
        return {"ms": 10.0, "global_batch": 64, **({"phases": next(runs)} if nproc == 2 and not env else {})}

    result = bench("s.py", [], [1, 2], 5, 1, 3, 0, runner=runner)
    assert result["phase_comm_share"] == pytest.approx(0.2) and result["phase_comm_ranks"] == [1, 0]  # one had none
    assert result["phase_comm_share_ci95"] == [0.1, 0.3]
    assert "communication wait: 20% of the step at 2 processes on the slowest rank (10%-30%" in report(result)


def test_a_script_without_ddpkit_data_loader_is_a_clear_error(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import ddpkit\nddpkit.init()\nprint('no loader')\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "bench", "--nproc", "1", "--reps", "1", str(script)], timeout=120)
    assert r.returncode == 1 and "0 of 1 step records" in r.stderr and "ddpkit.data_loader" in r.stderr


def test_make_bench_calls_a_target_met_only_when_the_whole_interval_is_on_its_side():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench as make_bench
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    a, b = [{"median_ms": v} for v in (10.0, 11, 10.5, 10.2, 10.8, 10.1)], [{"median_ms": 10.0}] * 6
    figure = make_bench.paired("step_ratio_vs_raw_ddp", a, b)
    assert figure["step_ratio_vs_raw_ddp_ci95"] == [1.0, 1.1] and "step_ratio_vs_raw_ddp_ci_level" not in figure
    assert make_bench.paired("x", a[:3], b[:3])["x_ci_level"] == 0.75  # [min, max] of 3 covers 75 %
    table = make_bench.table({**figure, "rss_ratio_vs_raw_ddp": 1.0, "rss_ratio_vs_raw_ddp_ci95": [0.99, 1.01]})
    assert "| step_ratio_vs_raw_ddp | 1.035 (1-1.1) | <= 1.01 | within noise |" in table
    assert "| rss_ratio_vs_raw_ddp | 1 (0.99-1.01) | <= 1.05 | met |" in table and "_ci95" not in table
    # issue 29: the phase report on against off is a figure with a target of its own
    on = make_bench.paired("phase_report_step_ratio", [{"median_ms": 10.2}] * 6, [{"median_ms": 10.0}] * 6)
    assert "| phase_report_step_ratio | 1.02 (1.02-1.02) | <= 1.005 | **not met** |" in make_bench.table(on)
