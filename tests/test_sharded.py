"""Mode fsdp (FSDP2 on gloo, real processes): meta-device init, block policy, early optimizer, state dicts."""
import re
import sys

import pytest
import torch
from torch import nn

from conftest import ROOT, WORKERS, launch, ok, run_cmd
from ddpkit import strategy
from ddpkit.strategies import fsdp_wrapper


def test_block_policy_by_size_and_by_class():
    net = nn.Sequential(nn.Linear(100, 100), nn.Sequential(nn.Linear(100, 50), nn.Linear(2, 2)), nn.Linear(3, 3))
    assert fsdp_wrapper.blocks(net, 5051) == [net[0], net[1]]  # net[1] holds 5,056 parameters, none of its children do
    assert fsdp_wrapper.blocks(net, 5000) == [net[0], net[1][0]]  # net[1][0] (5,050) reaches it alone; 6 stay in net[1]
    assert fsdp_wrapper.blocks(net, [nn.Linear]) == [net[2], net[1][1], net[1][0], net[0]]  # children before parents
    assert fsdp_wrapper.blocks(net) == []  # below the 1M default: the root is the only group
    with pytest.raises(ValueError, match=r"matches no submodule.*Linear"):
        fsdp_wrapper.blocks(net, [nn.Conv2d])
    with pytest.raises(TypeError, match="shard= takes"):
        fsdp_wrapper.blocks(net, ["Linear"])


def test_fsdp_is_a_multi_process_entry_of_the_strategy_table():
    mode = strategy.get("fsdp")
    assert mode.multi_process and mode.shards and mode.collective_forward
    with pytest.raises(ValueError, match="cannot run in fsdp mode"):
        mode.join(nn.Linear(1, 1))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    ok(run_cmd([sys.executable, str(WORKERS / "sharded.py"), str(out)]))
    for world in (2, 3):
        ok(launch(WORKERS / "sharded.py", out, nproc=world, launcher_args=("--mode", "fsdp")))
    return {w: torch.load(out / f"sharded{w}.pt") for w in (1, 2, 3)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_init_empty_gives_the_weights_of_a_normally_built_model(results, world):
    for case, (normal, empty) in results[world]["empty"].items():
        assert normal.keys() == empty.keys(), case
        assert all(torch.equal(normal[k], empty[k]) for k in normal), case  # bitwise, shard by shard


@pytest.mark.parametrize("world", [1, 2])
def test_a_tensor_nothing_initialises_is_named(results, world):
    assert "no initialisation for ['scale']" in results[world]["no_init"] and "init_fn" in results[world]["no_init"]
    # also in a module that has reset_parameters, which does not write that buffer (was: all False, no error)
    assert "no initialisation for ['mask']" in (results[world]["reset_misses"] or ""), results[world]["reset_misses"]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_behaviour(results, world):
    got = results[world]
    assert got["early_optimizer"].startswith("SGD was built before prepare_model")
    assert got["round_trip"] == {"changed": True, "restored": True, "plain_keys": True}
    assert got["unwrap_is_sharded"] == "DTensor"  # unwrap gives the sharded module, state_dict() the full one
    assert "cannot run in fsdp mode" in got["join"]


def test_one_process_keeps_working_without_sharding(results):
    assert results[1]["early_optimizer"] is None and results[1]["join"] is None


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_big_example_trains_under_its_budget_in_fsdp_and_is_refused_in_ddp(mode):
    """examples/big.py at a small size: 16.8M parameters with Adam need 320 MB per process in ddp; fsdp at 2
    processes holds about 140 MB and its RSS rises ~230 MB."""
    r = launch(ROOT / "examples" / "big.py", "--budget-mb", 280, "--width", 1024, "--depth", 16, "--steps", 3,
               launcher_args=("--mode", mode))
    if mode == "fsdp":
        ok(r)
        assert re.search(r"peak RSS rose \d+ MB per process \(budget 280 MB\) in mode fsdp", r.stdout)
    else:
        assert r.returncode == 1
        assert "does not fit: 320 MB needed per process (ddp, 2 process(es)), budget 280 MB; use --mode fsdp" \
            in r.stdout
        assert "step 0" not in r.stdout  # refused before anything was allocated or trained


def test_budget_estimate_per_mode():
    ddp, fsdp = strategy.get("ddp"), strategy.get("fsdp")
    assert ddp.state_bytes(1000, 100, 2, 2) == 5000  # params, grads, buckets, two Adam slots
    assert fsdp.state_bytes(1000, 100, 2, 2) == 500 * 4 + 200  # a shard of each, plus one block gathered whole
    assert fsdp.state_bytes(1000, 100, 3, 1) == 334 * 3 + 200
