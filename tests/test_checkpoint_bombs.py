"""Resource bombs in a checkpoint: a few kB that describe gigabytes. A ``state.pt`` (and a sharded checkpoint's
bytes entry) whose list sits where a tensor belongs, made of shared references (``x = [x, x]`` 30 times: 3 kB on
disk, 2**30 values to a tree walk), nested past any state dict, deflated from hundreds of MB, or a ``.metadata``
whose planner data hold a list index of 10**10: restore and ``ddpkit consolidate`` refuse each with one line,
within 2 s and 200 MB. Each read runs in tests/workers/bounded.py under a 20 s clock and a 1 GiB cap on its address
space: before the fix restore ran for ever (2.7 GB after 40 s) and consolidate grew until the OOM killer."""
import hashlib
import io
import json
import pickle
import sys
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from conftest import WORKERS, run_cmd
from ddpkit.checkpoint import safeload


def _laughs(levels=30):
    """2**levels values to a tree walk, ~50 bytes a level pickled."""
    x = [0.0]
    for _ in range(levels):
        x = [x, x]
    return x


def _nested(levels=200):
    x: list = []
    for _ in range(levels):
        x = [x]
    return x


def _parts():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def _commit(ckpt):
    files = {str(p.relative_to(ckpt)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                        "bytes": p.stat().st_size}
             for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "step": 1, "commit": 1, "world_size": 1,
                                                    "extra": {}, "files": files}))
    return ckpt


def _ddp(tmp_path, edit=None, raw=None):
    """A ddp checkpoint of Linear(3, 2) + Adam; ``edit(payload)`` changes it before torch.save, ``raw``: the bytes
    of state.pt instead."""
    model, optimizer = _parts()
    # world_size 2: a restore at another world size leaves the RNG states, which these payloads do not hold
    payload = {"step": 1, "world_size": 2, "rng": {}, "objects": {"model": model, "optimizer": optimizer}}
    if edit:
        edit(payload)
    ckpt = tmp_path / "run" / "ckpt-0000000001"
    ckpt.mkdir(parents=True)
    if raw is None:
        torch.save(payload, ckpt / "state.pt")
    else:
        (ckpt / "state.pt").write_bytes(raw)
    return _commit(ckpt)


def _set(path, value):
    def edit(payload):
        *keys, last = path
        inner = payload
        for key in keys:
            inner = inner[key]
        inner[last] = value
    return edit


def _deflated(count=200_000_000):
    """A state.pt whose pickle is ``count`` bytes (a list of that many None in an object's state), deflated to a
    few hundred kB: torch.load inflates what a zip member holds."""
    honest = io.BytesIO()
    torch.save({}, honest)
    members = zipfile.ZipFile(io.BytesIO(honest.getvalue()))
    out = io.BytesIO()

    def text(s):
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info in members.infolist():
            if not info.filename.endswith("data.pkl"):
                z.writestr(info.filename, members.read(info.filename))
                continue
            with z.open(info.filename, "w", force_zip64=True) as f:
                f.write(b"\x80\x02}" + text("step") + b"K\x01s" + text("world_size") + b"K\x01s" + text("rng")
                        + b"}s" + text("objects") + b"}" + text("notes") + b"]")
                batch = b"(" + b"N" * 1000 + b"e"
                for _ in range(count // 1000):
                    f.write(batch)
                f.write(b"ss.")
    return out.getvalue()


def _rng_rows_of_one(ranks=400_000):
    """RNG states of 400,000 ranks in the bytes of one row (a stride-0 view: torch.save keeps the one row): 15 s and
    724 MB to check each row, in a 20 kB file (a review)."""
    def edit(payload):
        payload["world_size"] = ranks
        payload["rng"] = {"torch": torch.get_rng_state().long().unsqueeze(0).expand(ranks, -1)}
    return edit


STATE_BOMBS = {
    "RNG rows sharing one row's bytes": _rng_rows_of_one(),
    "world_size of 10**12": _set(("world_size",), 10**12),
    "optimizer state a shared list": _set(("objects", "optimizer", "state", 0, "exp_avg"), _laughs()),
    "model weight a shared list": _set(("objects", "model", "weight"), _laughs()),
    "optimizer state a list": _set(("objects", "optimizer", "state", 0, "exp_avg"), [1.0, 2.0]),
    "optimizer state of another shape": _set(("objects", "optimizer", "state", 0, "exp_avg"), torch.zeros(7)),
    "nested 200 deep": _set(("objects", "notes"), _nested()),
    "RNG state a list": _set(("rng", "torch"), [[0], [0]]),
    "step past 10 digits": _set(("step",), 10**12),
}


def _bounded(*args):
    r = run_cmd([sys.executable, WORKERS / "bounded.py", *map(str, args)], timeout=90)
    assert r.stdout.strip(), r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return result, result["stderr"]


def _refused_in_bounds(result):
    assert result["seconds"] < 2 and result["peak_mb"] < 200, result
    error = result["error"] or ""
    assert error.startswith("UnsafeCheckpoint: ") and "refused" in error and "\n" not in error, result


@pytest.mark.parametrize("bomb", [*STATE_BOMBS, "deflated pickle"])
def test_restore_of_a_ddp_bomb_is_one_line_in_bounds(tmp_path, bomb):
    ckpt = _ddp(tmp_path, raw=_deflated()) if bomb == "deflated pickle" else _ddp(tmp_path, STATE_BOMBS[bomb])
    result, _ = _bounded("restore", ckpt.parent)
    _refused_in_bounds(result)


@pytest.mark.parametrize("bomb", ["model weight a shared list", "nested 200 deep", "deflated pickle"])
def test_consolidate_of_a_ddp_bomb_is_one_line_in_bounds(tmp_path, bomb):
    ckpt = _ddp(tmp_path, raw=_deflated()) if bomb == "deflated pickle" else _ddp(tmp_path, STATE_BOMBS[bomb])
    result, stderr = _bounded("consolidate", ckpt, tmp_path / "out.pt")
    assert result["code"] == 2 and result["seconds"] < 2 and result["peak_mb"] < 200, (result, stderr)
    assert stderr.count("\n") == 1 and "refused" in stderr, stderr


def test_consolidate_of_a_pickled_global_is_one_line(tmp_path):
    """torch's weights_only refusal is a paragraph: consolidate printed it as a traceback."""
    ckpt = _ddp(tmp_path, _set(("objects", "notes"), print))
    result, stderr = _bounded("consolidate", ckpt, tmp_path / "out.pt")
    assert result["code"] == 2 and stderr.count("\n") == 1 and "GLOBAL print" in stderr, (result, stderr)


def _sharded(tmp_path, bomb):
    """A sharded checkpoint of Linear(3, 2) + Adam whose optimizer state 'weight.exp_avg' is a bytes entry holding
    ``bomb``. DCP's save would walk a shared list as a tree itself, so the entry is saved as a string and its bytes
    then replaced at the end of the shard file (the metadata pointing there)."""
    model, optimizer = _parts()
    state = {k: dict(v) for k, v in zip(("weight", "bias"), optimizer["state"].values())}
    state["weight"]["exp_avg"] = "placeholder"
    ckpt = tmp_path / "run" / "ckpt-0000000001"
    shards = ckpt / "shards"
    dcp.save({"model": model, "optimizer": state}, storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    metadata = safeload.read_metadata(str(shards))
    entry = io.BytesIO()
    torch.save(bomb, entry)
    for index, info in metadata.storage_data.items():
        if index.fqn == "optimizer.weight.exp_avg":
            shard = shards / info.relative_path
            info.offset, info.length = shard.stat().st_size, len(entry.getvalue())
            with open(shard, "ab") as f:
                f.write(entry.getvalue())
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    groups = [{**g, "params": ["weight", "bias"]} for g in optimizer["param_groups"]]
    torch.save({"step": 1, "world_size": 2, "rng": {}, "objects": {"optimizer": {"param_groups": groups}},
                "sharded": ["model", "optimizer"]}, ckpt / "state.pt")
    return _commit(ckpt)


@pytest.mark.parametrize("bomb", ["shared list", "list"])
def test_a_sharded_bytes_entry_where_a_tensor_belongs_is_one_line_in_bounds(tmp_path, bomb):
    ckpt = _sharded(tmp_path, _laughs() if bomb == "shared list" else [1.0] * 6)
    result, _ = _bounded("restore", ckpt.parent)
    _refused_in_bounds(result)
    if bomb == "shared list":
        result, stderr = _bounded("consolidate", ckpt, tmp_path / "out.pt")
        assert result["code"] == 2 and result["seconds"] < 2 and result["peak_mb"] < 200, (result, stderr)
        assert stderr.count("\n") == 1 and "refused" in stderr, stderr


def test_a_huge_list_index_in_planner_data_is_one_line_in_bounds(tmp_path):
    """torch's loader fills a list with None up to each index of the planner data: 10**10 grew ~60 MB/s."""
    ckpt = _sharded(tmp_path, torch.zeros(2, 3))
    metadata = safeload.read_metadata(str(ckpt / "shards"))
    metadata.planner_data = {fqn: ("model", 10**10 if fqn.endswith("weight") else 0)
                             for fqn in metadata.state_dict_metadata if fqn.startswith("model.")} | {
        fqn: path for fqn, path in metadata.planner_data.items() if not fqn.startswith("model.")}
    (ckpt / "shards" / ".metadata").write_bytes(pickle.dumps(metadata))
    _commit(ckpt)
    result, stderr = _bounded("consolidate", ckpt, tmp_path / "out.pt")
    assert result["code"] == 2 and result["seconds"] < 2 and result["peak_mb"] < 200, (result, stderr)
    assert stderr.count("\n") == 1 and "list index" in stderr, stderr


def test_honest_checkpoints_still_restore_in_bounds(tmp_path):
    result, stderr = _bounded("restore", _ddp(tmp_path / "ddp").parent)
    assert result["error"] is None and result["seconds"] < 2, (result, stderr)
    result, stderr = _bounded("restore", _sharded(tmp_path / "sharded", torch.zeros(2, 3)).parent)
    assert result["error"] is None and result["seconds"] < 2, (result, stderr)
