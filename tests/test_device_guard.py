"""Every tensor ddpkit hands to a collective is on ``state.device`` (NCCL rejects CPU tensors), checked on CPU.

How (tests/workers/device_guard.py): a ``TorchFunctionMode`` tags each tensor with where a GPU run would hold
it (made without ``device=`` or moved with ``.cpu()``: the CPU; made with ``device=state.device`` or moved
there: the group's device), and the worker wraps torch.distributed's collective entry points so a ddpkit call
that hands one a CPU-tagged tensor is recorded. Streams, control, collectives and the Checkpointer's save and
restore run under it at 2 processes (gloo), in ddp and in fsdp mode.
"""
import json
import sys

import pytest
import torch

from conftest import WORKERS, launch, ok

sys.path.insert(0, str(WORKERS))
from device_guard import GROUP, Guard, Placement  # noqa: E402

AREAS = ("ddpkit.data.streams.StreamLoader._agreed", "ddpkit.data.streams.StreamLoader.state_dict",
         "ddpkit.runtime.control.", "ddpkit.data.steps.Step._counted",
         "ddpkit.runtime.collectives.", "ddpkit.checkpoint.checkpointer.", "ddpkit.checkpoint.rng.")

REPLICAS = ("ddpkit.strategies.replicas.Replicas.check", "ddpkit.strategies.replica_repair.compare",
            "ddpkit.strategies.replica_repair.heal", "ddpkit.strategies.replica_repair._copy_from")


def test_the_placement_tags_what_a_gpu_run_would_put_on_the_cpu():
    device = torch.device("cpu")  # what the library holds as state.device
    with Placement() as p:
        made = {"no device": torch.tensor([1]), "frombuffer": torch.frombuffer(bytearray(b"ab"), dtype=torch.uint8),
                "device=": torch.zeros(2, device=device), "empty_like(on device)": None, "cpu()": None}
        made["empty_like(on device)"] = torch.empty_like(made["device="])
        made["cpu()"] = made["device="].cpu()
        made["to(device)"] = torch.tensor([2]).to(device)
        made["cat(on device, ...)"] = torch.cat([made["device="], made["device="].new_zeros(3)])
    assert {k: p.where(t) for k, t in made.items()} == {
        "no device": "cpu", "frombuffer": "cpu", "device=": GROUP, "empty_like(on device)": GROUP,
        "cpu()": "cpu", "to(device)": GROUP, "cat(on device, ...)": GROUP}
    assert p.where(made["device="]) == GROUP  # .cpu() made a new tensor; the original keeps its place


def test_the_guard_records_a_cpu_tensor_handed_to_a_collective_by_ddpkit():
    """The guard itself, without a process group: a collective stand-in that records and returns."""
    import torch.distributed as dist

    saved = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        with Placement() as p:
            guard = Guard(p)
            flag, good = torch.tensor([1]), torch.zeros(1, device=torch.device("cpu"))
            exec("dist.all_reduce(flag); dist.all_reduce(good)",  # noqa: S102 - a caller in the ddpkit package
                 {"__name__": "ddpkit.fake", "dist": dist, "flag": flag, "good": good})
            dist.all_reduce(flag)  # the test's own call: not the library's
            guard.remove()
    finally:
        dist.all_reduce = saved
    assert guard.callers == {"ddpkit.fake.<module>"} and len(guard.violations) == 1
    assert "handed dist.all_reduce a tensor made on the CPU (shape [1], torch.int64)" in guard.violations[0]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_streams_control_collectives_and_checkpoints_hand_collectives_tensors_on_the_group_device(tmp_path, mode):
    ok(launch(WORKERS / "device_guard.py", tmp_path, launcher_args=["--mode", mode]))
    result = json.loads((tmp_path / f"guard-{mode}.json").read_text())
    assert result["restored"] == 2
    for rank, seen in enumerate(result["ranks"]):
        assert seen["violations"] == [], (rank, seen["violations"])
        for area in AREAS + (REPLICAS if mode == "ddp" else ()):  # each area made guarded calls: not vacuous
            assert any(c.startswith(area) for c in seen["callers"]), (rank, area, seen["callers"])
