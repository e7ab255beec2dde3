"""Communication options on gloo, 2 real processes: exact settings change nothing, compression stays in sync
and close, PowerSGD is refused before training; bad configs are one-line errors."""
import pytest
import torch

import ddpkit
from conftest import WORKERS, launch, ok


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm") / "comm.pt"
    ok(launch(WORKERS / "comm.py", out))
    return torch.load(out, weights_only=True)


def test_bucket_size_bucket_view_and_static_graph_give_the_same_weights_bitwise(results):
    assert results["tuned"]["in_sync"] and torch.equal(results["tuned"]["weights"], results["default"]["weights"])


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compression_keeps_ranks_in_sync_and_stays_close(results, name):
    got, ref = results[name], results["default"]
    assert got["in_sync"]  # every rank applies the same averaged gradient
    assert not torch.equal(got["weights"], ref["weights"])  # lossy: it did round
    assert torch.allclose(got["weights"], ref["weights"], atol=1e-2)
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] < 0.01


def test_powersgd_is_refused_on_gloo_before_any_step(results):
    assert "needs NCCL" in results["powersgd"] and "use 'fp16' or 'bf16' on CPU" in results["powersgd"]


@pytest.mark.parametrize("kwargs, message", [({"compression": "int8"},
                                             r"is not one of None \(no compression\), fp16, bf16, powersgd"),
                                             ({"bucket_mb": 0}, "bucket_mb must be > 0, got 0"),
                                             ({"powersgd_rank": 0}, "powersgd_rank must be >= 1")])
def test_bad_comm_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ddpkit.CommConfig(**kwargs)
