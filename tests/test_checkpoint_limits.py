"""Values a caller passes that a checkpoint cannot hold are one line, before anything is written: a step a
checkpoint's 10-digit name cannot hold (before: ``ckpt-10000000000`` was written and never listed, so resume went
back and ``keep=`` never deleted it), and ``--max-shard-mb`` that is no size (``inf`` was an OverflowError's
traceback)."""
import sys

import numpy as np
import pytest
import torch
from torch import nn

import ddpkit
from conftest import run_cmd


@pytest.fixture
def ckpts(tmp_path):
    ddpkit.init(cpu=True)
    return ddpkit.Checkpointer(str(tmp_path / "run"), resume=True), ddpkit.prepare_model(nn.Linear(3, 2))


@pytest.mark.parametrize("step, said", [(10**10, "outside 0..9999999999"), (-1, "outside 0..9999999999"),
                                        (2.0, "is a float, expected a whole number"),
                                        (True, "is a bool, expected a whole number")])
def test_a_step_no_checkpoint_name_holds_is_refused_at_save(tmp_path, ckpts, step, said):
    ckpt, model = ckpts
    with pytest.raises(ValueError) as info:
        ckpt.save(step, model=model)
    message = str(info.value)
    assert message.startswith(f"checkpoint step {step}") and said in message and "\n" not in message, message
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").iterdir())


def test_steps_at_the_ends_of_the_range_are_saved_and_listed(tmp_path, ckpts):
    ckpt, model = ckpts
    ckpt.save(0, model=model)
    ckpt.save(np.int64(10**10 - 1), model=model)  # numpy and tensor steps are whole numbers too
    ckpt.save(torch.tensor(7), model=model)
    assert [p.rsplit("-", 1)[1] for p in ckpt.checkpoints()] == ["0000000007", "9999999999", "0000000000"]
    assert ckpt.restore(model=model) == 7


@pytest.mark.parametrize("size", ["inf", "nan", "-1", "0"])
def test_max_shard_mb_that_is_no_size_is_one_line(tmp_path, ckpts, size):
    ckpt, model = ckpts
    path = ckpt.save(1, model=model)
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", path, str(tmp_path / "out"), "--max-shard-mb", size],
                timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--max-shard-mb" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_safetensors_export_again_into_its_directory_leaves_only_the_new_files(tmp_path, ckpts):
    """A re-export with another part size, or as one file, into the directory of an earlier export: the earlier
    parts went unlisted beside the new ones (transformers loads ``model.safetensors`` before an index, so a stale
    one shadowed the new parts). A file of the user's there is kept."""
    pytest.importorskip("safetensors")
    from ddpkit.checkpoint.export import INDEX, to_safetensors

    ckpt, _ = ckpts
    path = ckpt.save(1, model=ddpkit.prepare_model(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])))
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-extra.safetensors.bak").write_text("mine too")

    def names():
        return sorted(p.name for p in out.iterdir())

    to_safetensors(path, str(out))  # one file: export/model.safetensors
    to_safetensors(path, str(out), max_shard_mb=0.02)
    many = names()
    assert "model.safetensors" not in many and INDEX in many, many
    parts = [n for n in many if n.startswith("model-0")]
    assert len(parts) > 3 and all(n.endswith(f"-of-{len(parts):05d}.safetensors") for n in parts), many
    to_safetensors(path, str(out), max_shard_mb=0.05)  # fewer parts: the earlier ones go
    fewer = [n for n in names() if n.startswith("model-0")]
    assert 1 < len(fewer) < len(parts) and all(n.endswith(f"-of-{len(fewer):05d}.safetensors") for n in fewer)
    to_safetensors(path, str(out))  # one file again: no index, no parts left to shadow or be shadowed
    assert names() == ["model-extra.safetensors.bak", "model.safetensors", "notes.txt"], names()
