"""Mode hsdp (FSDP2 on a 2-D mesh, gloo, real processes): two launchers as two loopback nodes of 2 processes
train as one process does; each rank holds half a replica; its checkpoint restores in every mode and shape; the
checkpoints of hsdp, fsdp, ddp and one process export to safetensors that a plain model loads strictly."""
import subprocess
import sys

import pytest
import torch

from conftest import SCRATCH, WORKERS, launch, ok, run_cmd
from ddpkit import strategy
from ddpkit.strategies.hsdp import mesh_shape

ATOL = 1e-6
WORKER = WORKERS / "hsdp.py"


def test_hsdp_is_an_entry_of_the_table_that_shards():
    mode = strategy.get("hsdp")
    assert mode.multi_process and mode.shards and mode.collective_forward
    assert mode.options({"shard_size": 2, "find_unused": 1}).shard_size == 2
    assert "shard_size" not in strategy.get("fsdp").options({"shard_size": 2}).fsdp_kwargs  # never fully_shard's


@pytest.mark.parametrize("world, local, given, shape", [(4, 2, None, (2, 2)), (4, 4, None, (1, 4)), (4, 4, 1, (4, 1)),
                                                        (6, 3, 2, (3, 2)), (1, 1, None, (1, 1))])
def test_the_mesh_replicates_across_nodes_and_shards_within_one(world, local, given, shape):
    assert mesh_shape(world, local, given) == shape


@pytest.mark.parametrize("world, local, given, said", [
    (6, 4, None, "one node's 4 processes (the default) does not divide the world size 6; pass one of 1, 2, 3, 6"),
    (4, 2, 3, "shard_size=3 does not divide the world size 4; pass one of 1, 2, 4"),
    (4, 2, 0, "shard_size=0 is not a whole number >= 1"), (4, 2, "2", "shard_size='2' is not a whole number"),
    (4, 2, True, "shard_size=True is not a whole number")])
def test_a_shape_that_does_not_fit_the_world_is_one_line(world, local, given, said):
    with pytest.raises(ValueError, match="^hsdp: ") as info:
        mesh_shape(world, local, given)
    assert said in str(info.value) and "\n" not in str(info.value) and "prepare_model(model, shard_size=" in str(
        info.value)


def two_nodes(out, *args, nproc=2):
    """Two launchers on loopback as 2 nodes x ``nproc`` processes, mode hsdp."""
    from test_multinode import free_port, wait_all

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "--mode", "hsdp", "--log-dir", str(out / f"logs{r}"), str(WORKER),
                               str(out), *map(str, args)],
                              cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
             for r in (0, 1)]
    return wait_all(procs, timeout=240)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hsdp")
    ok(run_cmd([sys.executable, str(WORKER), str(out), "train"]))
    nodes = two_nodes(out, "train")
    for node in nodes:
        ok(node)
        # the loader's pass left open (5 of 5 batches taken, no StopIteration yet) closes quietly at exit
        assert "Exception ignored" not in node.stdout + node.stderr, node.stderr[-2000:]
    assert "ddpkit: hsdp mesh 2 x 2: each copy of the model sharded over 2 process(es), 2 copies" in nodes[0].stderr
    ckpt = next((out / "ckpt-hsdp-4").glob("ckpt-*"))
    restores = {"single": run_cmd([sys.executable, str(WORKER), str(out), "restore", str(ckpt), "single"]),
                "fsdp3": launch(WORKER, out, "restore", ckpt, "fsdp3", 3, nproc=3, launcher_args=("--mode", "fsdp")),
                "hsdp2x1": launch(WORKER, out, "restore", ckpt, "hsdp2x1", 1, launcher_args=("--mode", "hsdp")),
                "ddp2": launch(WORKER, out, "restore", ckpt, "ddp2", launcher_args=("--mode", "ddp"))}
    for result in restores.values():
        ok(result)
    return {"one": torch.load(out / "train-single-1.pt"), "hsdp": torch.load(out / "train-hsdp-4.pt"),
            **{tag: torch.load(out / f"restore-{tag}.pt") for tag in restores}, "dir": out}


def test_two_nodes_of_two_shard_inside_a_node_and_replicate_across(runs):
    assert runs["hsdp"]["mesh"] == [2, 2]
    assert runs["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"


def test_hsdp_at_two_nodes_of_two_equals_one_process(runs):
    one, hsdp = runs["one"], runs["hsdp"]
    for part in ("weights", "optimizer"):
        assert one[part].keys() == hsdp[part].keys()
        for name in one[part]:
            assert torch.allclose(one[part][name].double(), hsdp[part][name].double(), rtol=0, atol=ATOL), name


def test_a_meta_built_model_takes_the_weights_one_process_draws(runs):
    one, hsdp = runs["one"]["empty"], runs["hsdp"]["empty"]
    assert one.keys() == hsdp.keys() and all(torch.equal(one[k], hsdp[k]) for k in one)  # bitwise


def test_each_rank_holds_half_a_replica(runs):
    replica, = runs["one"]["bytes"]  # what every ddp rank holds: parameters, gradients, momentum
    held = runs["hsdp"]["bytes"]
    assert held[0] + held[1] == held[2] + held[3] == replica  # a node's two shards make one replica, no more
    assert max(held) <= 0.55 * replica  # 1/2 of it, up to a row of an uneven split (3 output rows over 2)


@pytest.mark.parametrize("tag", ["single", "fsdp3", "hsdp2x1", "ddp2"])
def test_the_hsdp_checkpoint_restores_bitwise_in_every_mode_and_shape(runs, tag):
    saved, got = runs["hsdp"], runs[tag]
    assert got["step"] == 5
    for part in ("weights", "optimizer"):
        assert saved[part].keys() == got[part].keys()
        assert all(torch.equal(saved[part][k], got[part][k]) for k in saved[part]), (tag, part)


def plain_net():
    from torch import nn

    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.parametrize("saved", ["ckpt-hsdp-4", "ckpt-restored-fsdp3", "ckpt-restored-ddp2", "ckpt-single-1"])
def test_consolidate_writes_safetensors_a_plain_model_loads_strictly(runs, saved, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(runs["dir"] / saved), str(out)]))
    assert "->" in r.stderr
    assert out.read_bytes()[8:9] == b"{"  # a JSON header after its 8-byte length: no pickle anywhere
    model = plain_net()
    model.load_state_dict(load_file(out), strict=True)
    expected = runs["one"] if saved == "ckpt-single-1" else runs["hsdp"]  # the others hold the hsdp run's weights
    got = model.state_dict()
    assert all(torch.equal(got[k], expected["weights"][k]) for k in expected["weights"]), saved


def test_a_split_export_has_parts_and_an_index_that_name_every_tensor(runs, tmp_path):
    import json

    from safetensors.torch import load_file

    out = tmp_path / "export"
    ok(run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(runs["dir"] / "ckpt-hsdp-4"), str(out),
                "--max-shard-mb", "0.0004"]))  # 420 bytes a part: the 384-byte weight alone, the small ones together
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    merged = {k: v for f in files for k, v in load_file(out / f).items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    model = plain_net()
    model.load_state_dict(merged, strict=True)
    assert set(index["weight_map"]) == set(model.state_dict())


def test_tied_weights_export_once_per_name(tmp_path):
    """safetensors refuses two names over one storage; the export gives each its own copy."""
    from safetensors.torch import load_file
    from torch import nn

    from ddpkit.checkpoint.export import to_safetensors

    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    net[1].weight = net[0].weight
    ckpt = tmp_path / "ckpt-0000000001"
    ckpt.mkdir()
    torch.save({"step": 1, "world_size": 1, "rng": {}, "objects": {"model": net.state_dict()}}, ckpt / "state.pt")
    path, = to_safetensors(str(ckpt), str(tmp_path / "tied.safetensors"))
    again = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    again.load_state_dict(load_file(path), strict=True)
    assert torch.equal(again[1].weight, net[0].weight)


@pytest.mark.parametrize("saved, out, argv, said", [
    ("ckpt-hsdp-4", "out", ["--format", "pt", "--max-shard-mb", "5"], "--max-shard-mb splits safetensors files only"),
    ("ckpt-hsdp-4", "out", ["--max-shard-mb", "0"], "--max-shard-mb 0.0 is not a size"),
    # before: a 40-byte file of no tensors, exit 0 (sharded); AttributeError tracebacks (unsharded)
    ("ckpt-hsdp-4", "o.safetensors", ["--name", "optimizer"], "'optimizer' in "),
    ("ckpt-restored-ddp2", "o.safetensors", ["--name", "optimizer"], "is not a model's state dict"),
    ("ckpt-restored-ddp2", "o.pt", ["--name", "optimizer"], "pass --name of a model: model"),
    ("ckpt-hsdp-4", "missing/m.safetensors", [], "does not exist; create it"),  # before: FileNotFoundError traceback
    ("ckpt-hsdp-4", "missing/m.pt", [], "does not exist; create it"),
    ("ckpt-hsdp-4", "afile", ["--max-shard-mb", "1"], "is a file, and --max-shard-mb writes a directory")])
def test_a_bad_export_request_is_one_line_and_writes_nothing(runs, tmp_path, saved, out, argv, said):
    (tmp_path / "afile").write_text("mine")
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(runs["dir"] / saved), str(tmp_path / out), *argv])
    assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "mine"


def test_the_budget_counts_the_shard_size_prepare_model_will_get():
    """init_empty(budget_mb=) counted one node's processes whatever shard_size prepare_model got."""
    from types import SimpleNamespace

    mode, one_node_of_2 = strategy.get("hsdp"), SimpleNamespace(world_size=2, local_world_size=2)
    assert mode.shard_group_size(one_node_of_2) == 2 and mode.shard_group_size(one_node_of_2, 1) == 1
    assert mode.state_bytes(1000, 10, mode.shard_group_size(one_node_of_2, 1), 2) == \
        strategy.get("fsdp").state_bytes(1000, 10, 1, 2)  # shard_size=1: a whole replica per rank


def test_a_model_with_extra_state_exports_its_tensors(tmp_path):
    """A module's get_extra_state() made consolidate refuse the model ("no tensors by name")."""
    from safetensors.torch import load_file

    from ddpkit.checkpoint.dcp import full_model_state
    from ddpkit.checkpoint.export import to_safetensors

    ckpt = tmp_path / "ckpt-0000000001"
    ckpt.mkdir()
    saved = {"lin.weight": torch.ones(2, 2), "lin._extra_state": {"version": 3}}
    torch.save({"step": 1, "world_size": 1, "rng": {}, "objects": {"model": saved}}, ckpt / "state.pt")
    assert full_model_state(str(ckpt))["lin._extra_state"] == {"version": 3}  # the .pt export keeps it
    path, = to_safetensors(str(ckpt), str(tmp_path / "m.safetensors"))
    assert list(load_file(path)) == ["lin.weight"]


def test_nodes_of_different_sizes_are_one_line_on_every_rank_not_a_hang(tmp_path):
    """Slurm may give nodes different task counts (``srun -n3`` on two nodes: 2 + 1): each rank's default shard
    size was its own node's, so one rank raised while the others waited in the mesh's first collective."""
    from test_multinode import free_port

    port, script = free_port(), tmp_path / "uneven.py"
    script.write_text("import torch, ddpkit\nddpkit.init(mode='hsdp', timeout_s=60)\n"
                      "ddpkit.prepare_model(torch.nn.Linear(4, 4))\n")
    layout = [(0, 0, 2), (1, 1, 2), (2, 0, 1)]  # (rank, local rank, local world size): 2 + 1 processes
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=SCRATCH, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "RANK": str(rank),
                                   "LOCAL_RANK": str(local), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": str(size),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank, local, size in layout]
    from test_multinode import wait_all

    for result in wait_all(procs, timeout=120):
        assert result.returncode != 0
        assert "hsdp: the nodes run different numbers of processes (1 to 2)" in result.stderr, result.stderr[-2000:]
