"""Checkpoints someone else wrote: a crafted ``shards/.metadata`` and a crafted bytes entry run no code, through
``Checkpointer.restore`` (in this process, as a script would call it) and ``ddpkit consolidate``; each is refused
with one line. The directories are made by hand, as an attacker would: with a manifest that matches."""
import hashlib
import json
import os
import pickle
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ddpkit
from conftest import run_cmd
from ddpkit.checkpoint import safeload


class _Payload:
    """Pickles as ``os.system(command)``: unpickling it runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _stack_global(module, name, arg):
    """Protocol-4 pickle of ``module.name(arg)`` (STACK_GLOBAL resolves dotted names by getattr)."""
    def text(s):
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


def _craft(tmp_path, *, weight=None, metadata=None, mutate=None):
    """A run directory with one sharded checkpoint of a Linear(3, 2), its manifest matching every file.
    ``metadata``: the bytes of .metadata; ``mutate(md)``: edits the real metadata object before it is pickled."""
    ckpt = tmp_path / "run" / "ckpt-0000000001"
    shards = ckpt / "shards"
    state = {"model": {"weight": torch.zeros(2, 3) if weight is None else weight, "bias": torch.zeros(2)}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    if mutate is not None:
        md = safeload.read_metadata(str(shards))
        mutate(md)
        metadata = pickle.dumps(md)
    if metadata is not None:
        (shards / ".metadata").write_bytes(metadata)
    torch.save({"step": 1, "world_size": 2, "rng": {}, "objects": {}, "sharded": ["model"]}, ckpt / "state.pt")
    files = {}
    for path in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        data = path.read_bytes()
        files[str(path.relative_to(ckpt))] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = {"format": 1, "step": 1, "world_size": 2, "extra": {}, "files": files}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


def _attacks(tmp_path):
    marker = tmp_path / "pwned"
    command = f"touch {marker}"
    return marker, {
        "dotted name in .metadata": dict(metadata=_stack_global("torch.distributed.checkpoint.metadata",
                                                                "os.system", command)),
        "bytes entry": dict(weight=_Payload(command)),
        # files that name only allowed classes but would crash DCP, allocate terabytes or read garbage
        "unknown layout": dict(metadata=_stack_global("torch.serialization", "_get_layout", "nope")),
        "WindowsPath on posix": dict(metadata=_stack_global("pathlib", "WindowsPath", "x")),
        "file name with a newline": dict(mutate=lambda md: _each_info(md, "relative_path", "__0_0.distcp\n")),
        "storage index not a dict": dict(mutate=lambda md: setattr(md, "storage_data", list(md.storage_data))),
        "terabyte tensor": dict(mutate=lambda md: _resize(md, "model.weight", 10**6)),
        "tensor with no chunks": dict(mutate=lambda md: setattr(md.state_dict_metadata["model.weight"], "chunks", [])),
    }


def _each_info(md, field, value):
    for info in md.storage_data.values():
        setattr(info, field, value)


def _resize(md, name, n):
    entry = md.state_dict_metadata[name]
    entry.size = torch.Size([n, n])
    entry.chunks[0].sizes = torch.Size([n, n])


ATTACKS = ["dotted name in .metadata", "bytes entry", "unknown layout", "WindowsPath on posix",
           "file name with a newline", "storage index not a dict", "terabyte tensor", "tensor with no chunks"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_restore_of_a_crafted_checkpoint_runs_nothing(tmp_path, attack):
    marker, attacks = _attacks(tmp_path)
    _craft(tmp_path, **attacks[attack])
    ddpkit.init()
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    with pytest.raises(ValueError) as info:
        ddpkit.Checkpointer(str(tmp_path / "run"), resume=True).restore(model=model)
    assert not marker.exists(), f"{attack}: the checkpoint ran a command"
    message = str(info.value)
    assert "refused" in message and "\n" not in message, message


@pytest.mark.parametrize("attack", ATTACKS)
def test_consolidate_of_a_crafted_checkpoint_runs_nothing(tmp_path, attack):
    marker, attacks = _attacks(tmp_path)
    _craft(tmp_path, **attacks[attack])
    out = tmp_path / "model.pt"
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(tmp_path / "run"), str(out)])
    assert not marker.exists(), f"{attack}: consolidate ran a command"
    assert r.returncode == 2 and "refused" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_safetensors_export_of_a_crafted_checkpoint_runs_nothing(tmp_path, attack):
    from ddpkit.checkpoint.export import to_safetensors

    marker, attacks = _attacks(tmp_path)
    ckpt = _craft(tmp_path, **attacks[attack])
    out = tmp_path / "model.safetensors"
    with pytest.raises(safeload.UnsafeCheckpoint) as info:
        to_safetensors(str(ckpt), str(out))
    assert not marker.exists(), f"{attack}: the export ran a command"
    assert "refused" in str(info.value) and "\n" not in str(info.value)
    assert not out.exists() and not list(tmp_path.glob("model.safetensors*"))


@pytest.mark.parametrize("saved, said", [({"epoch": 0, "position": -3}, "position=-3"),
                                         ({"epoch": "1", "position": 0}, "epoch='1'"),
                                         ({"epoch": 0.5, "position": True}, "epoch=0.5, position=True"),
                                         ({"position": 4}, "epoch=None")])
def test_a_crafted_loader_state_is_one_line(tmp_path, saved, said):
    """Before: a negative position surfaced mid-epoch as "generator raised StopIteration"."""
    ckpt = tmp_path / "run" / "ckpt-0000000001"
    ckpt.mkdir(parents=True)
    torch.save({"step": 1, "world_size": 1, "rng": {}, "objects": {"loader": saved}}, ckpt / "state.pt")
    data = (ckpt / "state.pt").read_bytes()
    files = {"state.pt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "step": 1, "world_size": 1, "extra": {},
                                                    "files": files}))
    ddpkit.init()
    loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with pytest.raises(ValueError) as info:
        ddpkit.Checkpointer(str(tmp_path / "run"), resume=True).restore(loader=loader)
    message = str(info.value)
    assert message.startswith(f"loader state {said}: expected whole numbers >= 0") and "\n" not in message


def test_an_honest_bytes_entry_still_loads(tmp_path):
    """Plain non-tensor values (an int in an optimizer's state) are bytes entries too: weights_only admits them."""
    shards = tmp_path / "shards"
    dcp.save({"opt": {"n_iter": 7, "lr": [0.1, 0.2]}}, storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    loaded: dict = {"opt": {"n_iter": 0, "lr": []}}
    dcp.load(loaded, storage_reader=safeload.reader(str(shards)), planner=safeload.planner(), no_dist=True)
    assert loaded == {"opt": {"n_iter": 7, "lr": [0.1, 0.2]}}


@pytest.mark.parametrize("pair", [("torch.distributed.checkpoint.metadata", "os.system"),
                                  ("torch.distributed.checkpoint.filesystem", "os.system"),
                                  ("torch", "load"), ("torch.serialization", "load"), ("builtins", "eval")])
def test_allow_list_is_exact_pairs(tmp_path, pair):
    (tmp_path / ".metadata").write_bytes(_stack_global(*pair, "true"))
    with pytest.raises(safeload.UnsafeCheckpoint, match="refused.*which ddpkit does not load"):
        safeload.read_metadata(str(tmp_path))


def test_metadata_pointing_outside_its_directory_is_refused(tmp_path):
    shards = tmp_path / "shards"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(shards)), no_dist=True)
    metadata = safeload.read_metadata(str(shards))
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.pt"
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(safeload.UnsafeCheckpoint, match="not a shard file of its own"):
        safeload.read_metadata(str(shards))


def _called(line):
    """An import line with each name followed by "(": ``import a, b as c`` -> ``import a( b( as c(``."""
    return (line + "(").replace(",", "(").replace(" as ", "( as ")


def test_no_object_crosses_ranks_as_pickle():
    """torch's *_object collectives pickle; every exchange between ranks goes through ddpkit.gather_object (JSON)."""
    import re
    from pathlib import Path

    pickling = re.compile(r"\b(all_gather_object|gather_object|broadcast_object_list|scatter_object_list|"
                          r"send_object_list|recv_object_list)\(")
    src = Path(ddpkit.__file__).parent
    found = [f"{path.relative_to(src)}:{n}: {line.strip()}" for path in sorted(src.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if (m := pickling.search(line)) and ("dist." in line[:m.start()] or "torch.distributed" in line)
             or (line.lstrip().startswith("from torch.distributed") and pickling.search(_called(line)))]
    assert not found, found
    assert len(list(src.rglob("*.py"))) > 60  # every subpackage is read, not the top-level files alone
