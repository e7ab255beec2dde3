"""`ddpkit bench`: the figures from the ranks' records (pure), and a real run on the digits example."""
import json
import sys

import pytest

from conftest import ROOT, ok, run_cmd
from ddpkit.bench import figures, step_ms

DIGITS = ROOT / "examples" / "digits.py"


def test_step_time_is_the_median_of_the_slowest_ranks_steps_after_warm_up(tmp_path):
    for rank, times in enumerate([[0, 1, 2, 3, 4.0], [0, 1, 2.5, 3, 5.0]]):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"times": times, "global_batch": 8}))
    ms, batch = step_ms(sorted(map(str, tmp_path.glob("rank*.json"))), warmup=1)
    # intervals after the first: rank 0 [1, 1, 1], rank 1 [1.5, 0.5, 2] -> slowest [1.5, 1, 2] -> median 1.5 s
    assert (ms, batch) == (1500.0, 8)


def samples(**settings):
    return {"n1": [10.0, 10.0], "n2": [12.0, 12.4], "no_comm": [9.0, 9.0], **settings}


def test_a_setting_is_recommended_only_with_evidence_beyond_chance():
    """Issue 18: paired sign test at 5 % / settings tried. Two repetitions never recommend (a coin flipped
    twice); six out of six do, with two settings."""
    batches = {"n1": 32, "n2": 64}
    two = figures(samples(bucket_5mb=[10.0, 11.5], gradient_as_bucket_view=[10.0, 12.5]), batches, [1, 2])
    assert two["recommendation"]["setting"] == "default"  # 1.2x and 1.08x: faster twice, but twice is chance
    assert "needs >= 6 repetitions" in two["recommendation"]["reason"]
    assert two["speedups_ci"]["bucket_5mb"] == [pytest.approx(12.4 / 11.5), pytest.approx(12 / 10)]
    assert two["rows"][1]["efficiency"] == pytest.approx((64 / 12.2) / (2 * 32 / 10))
    assert two["comm_share"] == pytest.approx((12.2 - 9) / 12.2)
    six = {"n1": [10.0] * 6, "n2": [12.0, 12.4, 12.1, 12.3, 12.2, 12.0], "no_comm": [9.0] * 6}
    result = figures({**six, "bucket_5mb": [10.5, 11.0, 10.8, 11.2, 10.9, 10.6],
                      "gradient_as_bucket_view": [12.0, 11.0, 12.5, 12.1, 12.6, 11.9]}, batches, [1, 2])
    assert result["recommendation"]["setting"] == "bucket_5mb" and result["recommendation"]["fields"] == {
        "bucket_mb": 5}
    assert "interval" in result["recommendation"]["reason"]
    lucky = figures({**six, "bucket_5mb": [9.0, 12.4, 12.1, 12.3, 12.2, 12.0]}, batches, [1, 2])  # 1.33x once
    assert lucky["recommendation"]["setting"] == "default"


def test_settings_that_cannot_matter_are_recommended_at_most_5_percent_of_the_time():
    """The A/A check of the rule itself: three settings equal to the default, +-30 % noise per run (what a
    shared 2-core box shows), 6 paired repetitions, 400 simulated benches."""
    import random

    rng, false = random.Random(0), 0
    for _ in range(400):
        runs = {name: [10.0 * rng.uniform(0.7, 1.3) for _ in range(6)]
                for name in ("n1", "n2", "no_comm", "bucket_5mb", "bucket_100mb", "gradient_as_bucket_view")}
        false += figures(runs, {"n1": 32, "n2": 64}, [1, 2])["recommendation"]["setting"] != "default"
    assert false / 400 <= 0.05, false


def test_bench_on_digits_reports_scaling_comm_share_and_a_plot(tmp_path):
    png = tmp_path / "bench.png"
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "bench", "--nproc", "1,2", "--steps", "6", "--warmup", "2",
                    "--reps", "1", "--json", "--plot", str(png), str(DIGITS), "--logdir", str(tmp_path / "tb")],
                   timeout=300))
    result = json.loads(r.stdout)
    assert [row["nproc"] for row in result["rows"]] == [1, 2]
    assert all(row["samples_per_s"] > 0 for row in result["rows"]) and result["rows"][0]["efficiency"] == 1.0
    assert 0.0 <= result["comm_share"] < 1.0
    assert set(result["settings_ms"]) == {"default", "gradient_as_bucket_view", "bucket_5mb", "bucket_100mb"}
    assert result["recommendation"]["setting"] == "default"  # one repetition never recommends
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_script_without_ddpkit_data_loader_is_a_clear_error(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import ddpkit\nddpkit.init()\nprint('no loader')\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "bench", "--nproc", "1", "--reps", "1", str(script)], timeout=120)
    assert r.returncode == 1 and "0 of 1 step records" in r.stderr and "ddpkit.data_loader" in r.stderr
