"""Checkpoints in one process: atomic commit, checksums, fallback, weights_only, clear errors."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import ddpkit
from conftest import ok, run_cmd


@pytest.fixture
def parts():
    ddpkit.init(cpu=True)
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return model, opt


def _saved(tmp_path, parts, steps=(1, 2, 3), keep=3):
    model, opt = parts
    ckpt = ddpkit.Checkpointer(str(tmp_path / "ckpt"), keep=keep, resume=True)
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(step, model=model, optimizer=opt, extra={"note": f"step {step}"})
    return ckpt


def test_save_restore_roundtrip_and_keep_last_k(tmp_path, parts):
    ckpt = _saved(tmp_path, parts, steps=(1, 2, 3, 4), keep=2)
    assert [os.path.basename(p) for p in ckpt.checkpoints()] == ["ckpt-0000000004", "ckpt-0000000003"]
    manifest = json.loads((tmp_path / "ckpt" / "ckpt-0000000004" / "manifest.json").read_text())
    assert manifest["extra"] == {"note": "step 4"} and len(manifest["files"]["state.pt"]["sha256"]) == 64
    model, opt = parts
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert ckpt.restore(model=model, optimizer=opt) == 4
    assert torch.equal(model.weight, saved)
    assert not any(k.startswith("module.") for k in torch.load(
        tmp_path / "ckpt" / "ckpt-0000000004" / "state.pt", weights_only=True)["objects"]["model"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest"])
def test_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, parts, damage):
    ckpt = _saved(tmp_path, parts)
    newest = tmp_path / "ckpt" / "ckpt-0000000003"
    data = bytearray((newest / "state.pt").read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit in tensor data: torch.load alone would not notice
        (newest / "state.pt").write_bytes(bytes(data))
    elif damage == "truncate":
        (newest / "state.pt").write_bytes(bytes(data[: len(data) // 2]))
    else:
        (newest / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="skipping checkpoint .*ckpt-0000000003"):
        assert ckpt.restore(model=parts[0], optimizer=parts[1]) == 2


def test_explicit_missing_or_damaged_path_is_an_error(tmp_path, parts):
    ckpt = _saved(tmp_path, parts)
    with pytest.raises(FileNotFoundError, match="cannot resume from .*nope: it does not exist"):
        ckpt.restore(str(tmp_path / "nope"), model=parts[0])


def test_no_resume_means_fresh_start(tmp_path, parts):
    _saved(tmp_path, parts)
    assert ddpkit.Checkpointer(str(tmp_path / "ckpt"), resume=False).restore(model=parts[0]) == 0


def test_checkpoint_of_another_model_names_the_mismatch(tmp_path, parts):
    ckpt = _saved(tmp_path, parts)
    other = nn.Linear(3, 5)
    with pytest.raises(ValueError, match=r"does not fit this model: shapes \['weight \(2, 3\) vs model \(5, 3\)'"):
        ckpt.restore(model=other)


def test_pickled_objects_are_never_unpickled(tmp_path, parts):
    ckpt = _saved(tmp_path, parts, steps=(1,))
    newest = tmp_path / "ckpt" / "ckpt-0000000001"
    torch.save({"step": 1, "objects": {"x": os.system}, "rng": {}, "world_size": 1}, newest / "state.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    import hashlib

    blob = (newest / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="Weights only load failed"):
        ckpt.restore(model=parts[0])


def test_directory_that_cannot_be_written_is_a_clear_error(tmp_path):
    ddpkit.init(cpu=True)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="checkpoint directory .*file/ckpt' is not writable"):
        ddpkit.Checkpointer(str(blocker / "ckpt"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_directories_are_cleaned(tmp_path, parts):
    (tmp_path / "ckpt" / f"ckpt-0000000009.tmp-{_dead_pid()}").mkdir(parents=True)
    (tmp_path / "ckpt" / "ckpt-0000000008.tmp-sharded").mkdir(parents=True)
    ckpt = ddpkit.Checkpointer(str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path / "ckpt") == [] and ckpt.latest() is None


def test_a_temporary_directory_of_a_live_writer_is_not_a_leftover(tmp_path, parts):
    """Another process (the trainer) writing ckpt-9 while an evaluation watcher starts a Checkpointer of the
    directory: the watcher leaves the write alone; once the writer is gone, its leftover is removed."""
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = tmp_path / "ckpt" / f"ckpt-0000000009.tmp-{writer.pid}"
        tmp.mkdir(parents=True)
        ddpkit.Checkpointer(str(tmp_path / "ckpt"))
        assert tmp.is_dir()
    finally:
        writer.kill()
        writer.wait()
    ddpkit.Checkpointer(str(tmp_path / "ckpt"))
    assert not tmp.exists()


def test_disk_full_during_save_keeps_the_previous_checkpoint(tmp_path):
    """A real write failure: the file-size limit (RLIMIT_FSIZE) stops the second, larger save."""
    script = textwrap.dedent(f"""
        import resource, signal, torch, ddpkit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ddpkit.init(cpu=True)
        ckpt = ddpkit.Checkpointer({str(tmp_path / 'ckpt')!r})
        ckpt.save(1, model=torch.nn.Linear(4, 4))
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
        try:
            ckpt.save(2, model=torch.nn.Linear(400, 400))
        except OSError as e:
            print("ERROR", e)
    """)
    r = ok(run_cmd([sys.executable, "-c", script]))
    assert "checkpoint step 2 was not saved: writing failed on rank 0 (OSError: [Errno 27] File too large)" \
        in r.stdout and "the newest checkpoint is still " in r.stdout, r.stdout
    assert r.stdout.rstrip().split("still ")[1].startswith(str(tmp_path / "ckpt" / "ckpt-0000000001")), r.stdout
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-0000000001"]  # no partial or temporary directory
    ddpkit.init(cpu=True)
    assert ddpkit.Checkpointer(str(tmp_path / "ckpt")).validate(str(tmp_path / "ckpt" / "ckpt-0000000001")) is None


def test_the_ranks_share_the_hashing_of_a_checkpoints_files(tmp_path):
    """validate(path, (i, n)) reads every n-th file from the i-th: together the parts read each file once."""
    import hashlib

    from ddpkit.checkpoint.checkpointer import validate

    files = {f"shards/__{r}_0.distcp": bytes([r]) * 100 for r in range(3)}
    (tmp_path / "shards").mkdir()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    manifest = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": 100} for name, data in files.items()}
    (tmp_path / "manifest.json").write_text(json.dumps({"files": manifest}))
    assert [validate(str(tmp_path), (i, 2)) for i in range(2)] == [None, None]
    (tmp_path / "shards/__1_0.distcp").write_bytes(bytes([9]) * 100)  # the second file, in rank 1's part of 2
    assert validate(str(tmp_path), (0, 2)) is None
    assert "__1_0.distcp does not match its sha256" in validate(str(tmp_path), (1, 2))
    assert validate(str(tmp_path / "missing")) == "it does not exist"
