"""Two real processes (gloo, CPU) through `ddpkit launch`: init, sharding, gradients, rank-0 output, teardown."""
import time

import pytest
import torch

from conftest import WORKERS, launch, ok


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("skeleton")
    start = time.monotonic()
    result = ok(launch(WORKERS / "skeleton.py", out, launcher_args=["--log-dir", out / "logs"]))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return {"result": result, "ranks": ranks, "out": out, "seconds": time.monotonic() - start}


def test_init_reports_each_rank(run):
    states = [r["state"] for r in run["ranks"]]
    assert [s["rank"] for s in states] == [0, 1] and [s["local_rank"] for s in states] == [0, 1]
    assert {(s["world_size"], s["node_rank"], s["mode"], s["device"], s["backend"]) for s in states} == \
        {(2, 0, "ddp", "cpu", "gloo")}
    assert [s["is_main"] for s in states] == [True, False]


def test_ranks_cover_each_epoch_exactly_once(run):
    for epoch in range(3):
        seen = run["ranks"][0]["epochs"][epoch] + run["ranks"][1]["epochs"][epoch]
        assert sorted(seen) == list(range(40))


def test_order_changes_across_epochs(run):
    rank0 = run["ranks"][0]["epochs"]
    assert rank0[0] != rank0[1] and rank0[1] != rank0[2]


def test_order_is_identical_across_runs_with_the_same_seed_and_differs_with_another(run, tmp_path):
    again = tmp_path / "again"
    again.mkdir()
    ok(launch(WORKERS / "skeleton.py", again, 0))
    assert torch.load(again / "rank1.pt")["epochs"] == run["ranks"][1]["epochs"]
    other = tmp_path / "other"
    other.mkdir()
    ok(launch(WORKERS / "skeleton.py", other, 7))
    assert torch.load(other / "rank1.pt")["epochs"] != run["ranks"][1]["epochs"]


def test_gradients_equal_on_all_ranks_after_a_ddp_step(run):
    g0, g1 = run["ranks"][0]["grads"], run["ranks"][1]["grads"]
    assert g0.keys() == g1.keys() and len(g0) == 6
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
        assert g0[name].abs().sum() > 0, name


def test_state_dict_has_no_module_prefix_and_batchnorm_is_synced(run):
    assert all(not k.startswith("module.") for k in run["ranks"][0]["weights"])
    assert run["ranks"][0]["bn_type"] == "SyncBatchNorm1d"  # synchronised, and still a BatchNorm1d to isinstance


def test_output_appears_once(run):
    stdout, stderr = run["result"].stdout, run["result"].stderr
    assert stdout.count("MARKER-print") == 1
    assert stdout.count("MARKER-log") == 1
    assert stdout.count("MARKER-every-rank") == 1 and "[rank 1] MARKER-every-rank" not in stdout  # console: rank 0
    assert stdout.count("MARKER-same-on-every-rank") == 1
    # shown once; marked [x2 ranks] only when rank 1's copy came within the hold, which a loaded CI machine does
    # not promise (rank 1 off the cores for longer): the marking is tested on crafted files in test_console.py
    assert stderr.count("MARKER-bar") >= 1 and stderr.count("global batch 8 = 4 per process x 2") == 1
    event_files = list((run["out"] / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1


def test_every_rank_has_its_own_log_files(run):
    rank1 = list((run["out"] / "logs").glob("*/*/attempt_0/1/stdout.log"))
    assert len(rank1) == 1 and "[rank 1] MARKER-every-rank" in rank1[0].read_text()
    assert len(list((run["out"] / "logs").glob("*/*/attempt_0/*/stderr.log"))) == 2


def test_console_ranks_all_shows_every_rank(tmp_path):
    r = ok(launch(WORKERS / "skeleton.py", tmp_path, launcher_args=["--console-ranks", "all", "--log-dir",
                                                                     tmp_path / "logs"]))
    assert "[rank 0] MARKER-every-rank" in r.stdout and "[rank 1] MARKER-every-rank" in r.stdout
    assert r.stdout.count("MARKER-print") == 1


def test_launch_and_teardown_finish_promptly(run):
    assert run["seconds"] < 60
