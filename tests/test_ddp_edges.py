"""DDP's edges on real gloo processes: static_graph with a parameter unused by design, and check_sync_every
counting training steps only (evaluation forwards and ddpkit.join's uneven steps add no collective)."""
import json

from conftest import WORKERS, launch, ok


def test_static_graph_unused_parameter_and_sync_checks_on_training_steps_only(tmp_path):
    ok(launch(WORKERS / "ddp_edges.py", tmp_path, timeout=150))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["static_graph_steps"] for r in ranks] == [3, 3]  # 10 samples, global batch 4, padded
    assert [r["eval_batches"] for r in ranks] == [3, 2] == [r["no_grad_batches"] for r in ranks]
    assert [r["join_steps"] for r in ranks] == [3, 2] == [r["torch_join_steps"] for r in ranks]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    for r in ranks:  # the check still runs on training steps: rank 1's changed weight is named on both ranks
        assert r["desync"] and r["desync"].startswith("replicas out of sync at step ")
        assert "rank 1 differs from rank 0" in r["desync"] and "in '0.weight'" in r["desync"], r["desync"]
