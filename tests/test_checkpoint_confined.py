"""Names read from a checkpoint directory stay in it: a manifest entry, ``state.pt``, ``manifest.json``, a shard
file or a ``ckpt-*`` entry that is an absolute path, climbs out with ``..``, is a symlink out, or is no regular
file (``/dev/zero``, a FIFO) is refused with one line before it is opened. ``validate``, ``restore``/``latest()``
and ``ddpkit consolidate`` never hang on one, and read, write and delete nothing outside the directory.
Each directory is made by hand, as an attacker would make it, with a manifest that matches what it names."""
import hashlib
import json
import os
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import ddpkit
from conftest import run_cmd
from ddpkit.checkpoint import disk

pytestmark = pytest.mark.timeout(30)  # before the fix several of these hung for ever


def _entry(path):
    data = path.read_bytes() if path.is_file() else b""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _write_manifest(ckpt, files):
    record = {"format": 1, "step": 1, "commit": 1, "world_size": 1, "extra": {}, "files": files}
    (ckpt / "manifest.json").write_text(json.dumps(record))


def _checkpoint(run, sharded=False):
    """``run/ckpt-0000000001``: an honest checkpoint of a Linear(3, 2) (a sharded one: its model in shards/)."""
    ckpt = run / "ckpt-0000000001"
    ckpt.mkdir(parents=True)
    model = nn.Linear(3, 2).state_dict()
    if sharded:
        dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(str(ckpt / "shards")), no_dist=True)
    objects = {} if sharded else {"model": model}
    torch.save({"step": 1, "world_size": 1, "rng": {}, "objects": objects, "sharded": ["model"] if sharded else []},
               ckpt / "state.pt")
    _write_manifest(ckpt, {str(p.relative_to(ckpt)): _entry(p) for p in sorted(ckpt.rglob("*")) if p.is_file()})
    return ckpt


def _fifo(path):
    os.mkfifo(path)
    return path


def _outside(tmp_path):
    """A file beside the run directory, whose sha256 a crafted manifest names: it must not validate."""
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"not the checkpoint's")
    return secret


# each: (what the test does to the checkpoint -> the name it plants in the manifest, a word the refusal says)
def _absolute(tmp_path, ckpt):
    return str(_outside(tmp_path)), "absolute"


def _dotdot(tmp_path, ckpt):
    _outside(tmp_path)
    return "../../secret.pt", ".."


def _symlink_out(tmp_path, ckpt):
    os.symlink(_outside(tmp_path), ckpt / "extra.pt")
    return "extra.pt", "symlink"


def _dev_zero(tmp_path, ckpt):
    return "/dev/zero", "absolute"


def _link_to_dev_zero(tmp_path, ckpt):
    os.symlink("/dev/zero", ckpt / "zeros.pt")
    return "zeros.pt", "symlink"


def _a_fifo(tmp_path, ckpt):
    _fifo(ckpt / "pipe.pt")
    return "pipe.pt", "FIFO"


def _linked_folder(tmp_path, ckpt):
    """A folder of the checkpoint linked out of it: only the name's last part was looked at (a review)."""
    _outside(tmp_path)
    os.symlink(tmp_path, ckpt / "ext")
    return "ext/secret.pt", "symlink"


def _dotted(tmp_path, ckpt):
    """One file under another name (./state.pt): a manifest listing it thousands of times hashed it each time."""
    return "./state.pt", "plain relative path"


PLANTED = {"absolute": _absolute, "dotdot": _dotdot, "symlink out": _symlink_out, "/dev/zero": _dev_zero,
           "symlink to /dev/zero": _link_to_dev_zero, "FIFO": _a_fifo, "linked folder": _linked_folder,
           "not canonical": _dotted}


def _plant(tmp_path, kind):
    ckpt = _checkpoint(tmp_path / "run")
    name, word = PLANTED[kind](tmp_path, ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    target = tmp_path / "secret.pt"
    manifest["files"][name] = _entry(target) if target.exists() else {"sha256": hashlib.sha256(b"").hexdigest(),
                                                                      "bytes": 0}
    _write_manifest(ckpt, manifest["files"])
    return ckpt, name, word


def _one_line(reason, *words):
    assert reason and "\n" not in reason, reason
    for word in words:
        assert word in reason, reason


@pytest.mark.parametrize("kind", PLANTED)
def test_validate_refuses_a_name_that_leaves_the_checkpoint(tmp_path, kind):
    ckpt, name, word = _plant(tmp_path, kind)
    started = time.monotonic()
    reason = disk.validate(str(ckpt))
    assert time.monotonic() - started < 2
    _one_line(reason, name, word, "expected")


@pytest.mark.parametrize("kind", PLANTED)
def test_resume_skips_it_and_consolidate_refuses_it(tmp_path, kind):
    ckpt, name, word = _plant(tmp_path, kind)
    ddpkit.init()
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    with pytest.warns(UserWarning) as caught:
        assert ddpkit.Checkpointer(str(tmp_path / "run"), resume=True).restore(model=model) == 0
    _one_line(str(caught[0].message), name, word)
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(ckpt), str(tmp_path / "out.pt")], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and name in r.stderr, r.stderr
    assert not (tmp_path / "out.pt").exists()
    assert (tmp_path / "secret.pt").read_bytes() == b"not the checkpoint's" if kind in ("absolute", "dotdot") else 1


@pytest.mark.parametrize("what", ["state.pt", "manifest.json"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused(tmp_path, what):
    """state.pt listed with 0 bytes (a FIFO's size), or manifest.json itself: open() of a FIFO blocks until a
    writer comes, so latest(), restore and consolidate hung."""
    ckpt = _checkpoint(tmp_path / "run")
    (ckpt / what).unlink()
    if what == "state.pt":
        _write_manifest(ckpt, {"state.pt": _entry(ckpt / what)})
    _fifo(ckpt / what)
    ddpkit.init()
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    ckpts = ddpkit.Checkpointer(str(tmp_path / "run"), resume=True)
    with pytest.warns(UserWarning) as caught:
        assert ckpts.latest() is None
    _one_line(str(caught[0].message), what, "FIFO")
    with pytest.raises((ValueError, OSError)) as info:  # FileNotFoundError: "cannot resume from ..."
        ckpts.restore(str(ckpt), model=model)
    _one_line(str(info.value), what, "FIFO")
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(ckpt), str(tmp_path / "out.pt")], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and what in r.stderr, r.stderr


@pytest.mark.parametrize("target", ["outside", "fifo"])
def test_a_shard_file_that_is_no_regular_file_inside_is_refused(tmp_path, target):
    """A shard file not listed in the manifest, replaced by a symlink to a file outside the checkpoint (DCP read
    the weights from there) or by a FIFO (refused before only as "shard files hold 0" bytes, naming no file)."""
    ckpt = _checkpoint(tmp_path / "run", sharded=True)
    shard = next((ckpt / "shards").glob("*.distcp"))
    if target == "fifo":
        shard.unlink()
        _fifo(shard)
    else:
        shard.rename(tmp_path / "elsewhere.distcp")
        os.symlink(tmp_path / "elsewhere.distcp", shard)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    _write_manifest(ckpt, {k: v for k, v in manifest["files"].items() if not k.endswith(".distcp")})
    ddpkit.init()
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    with pytest.raises(ValueError) as info:
        ddpkit.Checkpointer(str(tmp_path / "run"), resume=True).restore(str(ckpt), model=model)
    _one_line(str(info.value), shard.name, "expected")
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(ckpt), str(tmp_path / "out.pt")], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and shard.name in r.stderr, r.stderr


def test_a_checkpoint_entry_that_links_elsewhere_is_neither_resumed_nor_deleted(tmp_path):
    """``run/ckpt-0000000009`` a symlink to a checkpoint outside the run: not resumed (its files are not the
    run's), and retention never deletes through it."""
    elsewhere = _checkpoint(tmp_path / "other")
    (tmp_path / "run").mkdir()
    os.symlink(elsewhere, tmp_path / "run" / "ckpt-0000000009")
    ddpkit.init()
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    ckpts = ddpkit.Checkpointer(str(tmp_path / "run"), keep=1, resume=True)
    with pytest.warns(UserWarning) as caught:
        assert ckpts.restore(model=model) == 0
    _one_line(str(caught[0].message), "ckpt-0000000009", "symlink")
    ckpts.save(1, model=model)
    ckpts.save(2, model=model)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["manifest.json", "state.pt"]
    assert disk.validate(str(elsewhere)) is None


def test_manifest_files_not_an_object_is_one_line(tmp_path):
    """``"files": [...]``: validate raised AttributeError (a traceback in consolidate)."""
    ckpt = _checkpoint(tmp_path / "run")
    record = json.loads((ckpt / "manifest.json").read_text())
    record["files"] = list(record["files"])
    (ckpt / "manifest.json").write_text(json.dumps(record))
    _one_line(disk.validate(str(ckpt)), '"files"', "expected")
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(ckpt), str(tmp_path / "out.pt")], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and '"files"' in r.stderr, r.stderr


def test_an_honest_checkpoint_still_validates(tmp_path):
    assert disk.validate(str(_checkpoint(tmp_path / "run"))) is None
    assert disk.validate(str(_checkpoint(tmp_path / "sharded", sharded=True))) is None


def test_a_commit_number_past_any_count_stops_no_later_save(tmp_path):
    """A manifest's commit of 4300 digits restored fine, then every save raised: the next number was past what str()
    writes (a review). Such a number is no commit number: that checkpoint reads as unreadable, the saves go on."""
    ckpt = _checkpoint(tmp_path / "run")
    record = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**record, "commit": 10**4300 - 1}))  # 4300 nines
    saver = ddpkit.Checkpointer(str(tmp_path / "run"), resume=False)  # start over there: the older one stays
    saver.save(2, model=nn.Linear(3, 2))
    saver.save(3, model=nn.Linear(3, 2))
    assert os.path.basename(saver.latest()) == "ckpt-0000000003"
