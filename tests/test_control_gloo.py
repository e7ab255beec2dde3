"""Cross-rank control flow on 2 real gloo processes, and the same script as one plain process (identity)."""
import json
import sys
import time

import pytest

from conftest import WORKERS, launch, ok, run_cmd

CONTROL = WORKERS / "control.py"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("control")
    ok(launch(CONTROL, "values", out, timeout=120))
    return [json.loads((out / f"values{r}.json").read_text()) for r in (0, 1)]


def test_broadcast_and_gather_round_trip_json_and_tensors(two):
    for record in two:
        assert record["config"] == {"lr": 0.1, "tags": ["a", None, True], "n": 3}
        assert record["from_last"] == "rank 1" and record["tensor"] == [[0, 1, 2], [3, 4, 5]]
        assert record["gathered"] == [{"rank": 0, "loss": 0.0}, {"rank": 1, "loss": 0.5}]
        assert record["after"] == "still in step"


def test_a_value_that_is_not_json_is_refused_on_every_rank(two):
    for record in two:
        assert "broadcast from rank 0: value is a __main__.Point, not JSON" in record["refused_broadcast"]
        assert "gather_object on rank 1: value is a __main__.Point, not JSON" in record["refused_gather"]


def test_collectives_edges_a_scalar_gather_a_flag_and_tensors_that_differ_across_ranks(two):
    for record in two:
        assert record["gather_0d"] == [0.0, 0.5]  # one row per rank
        assert record["flag_max"] is True and record["flag_min"] is True and record["flag_sum"] == 2
        assert "ddpkit.reduce: the ranks passed different tensors (rank 0: float32 [3], rank 1: int64 [3]); " \
            "pass the same dtype and shape on every rank" in record["reduce_dtypes"]
        assert "ddpkit.gather: the ranks passed different tensors (rank 0: float32 [2, 3], rank 1: float32 [2, 4])" \
            in record["gather_shapes"]
        assert record["gather_rows"] == [[0, 0], [1, 1], [1, 1]]
        assert "ddpkit.gather: the ranks passed different tensors (rank 0: float32 [2, 1, 1, 1, 1, 1, 1, 1, 2], " \
            "rank 1: float32 [2, 1, 1, 1, 1, 1, 1, 1, 3])" in record["gather_9d"]
        assert "ddpkit.reduce: the ranks passed different tensors" in record["reduce_9d"]
        assert record["gather_9d_same"] == [3, 1, 1, 1, 1, 1, 1, 1, 2]
        assert record["after"] == "still in step"


def test_early_stop_decided_by_one_rank_ends_every_rank_at_the_same_step(two):
    assert [r["stopped_at"] for r in two] == [3, 3] and all(r["all"] for r in two)


def test_one_process_runs_the_same_script(tmp_path):
    ok(run_cmd([sys.executable, str(CONTROL), "values", str(tmp_path)], timeout=60))
    record = json.loads((tmp_path / "values0.json").read_text())
    assert record["gathered"] == [{"rank": 0, "loss": 0.0}] and record["stopped_at"] == 3
    assert "not JSON" in record["refused_broadcast"] and record["tensor"] == [[0, 1, 2], [3, 4, 5]]
    assert record["gather_0d"] == [0.0] and record["flag_max"] is True and record["flag_sum"] == 1


def test_main_process_first_runs_rank0_first(tmp_path):
    ok(launch(CONTROL, "first", tmp_path, timeout=120))
    assert [json.loads((tmp_path / f"first{r}.json").read_text())["seen"] for r in (0, 1)] == [True, True]


def test_rank0_raising_inside_main_process_first_hangs_nobody(tmp_path):
    start = time.monotonic()
    r = launch(CONTROL, "first_raises", tmp_path, timeout=120)
    assert r.returncode == 1 and time.monotonic() - start < 60
    assert "rank 0 on" in r.stderr and "ValueError: download failed on rank 0" in r.stderr, r.stderr[-2000:]
    assert "RELEASED" not in r.stdout
