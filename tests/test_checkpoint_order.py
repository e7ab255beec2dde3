"""Retention and resume follow commit order, not step numbers: after ``restore(path=older)`` and in a directory an
earlier run left behind. A run that would save over another run's checkpoints is stopped with one line, on every
rank, before anything is written or deleted; ``resume=False`` starts over there on purpose."""
import os
import textwrap

import pytest
import torch
from torch import nn

import ddpkit
from conftest import launch


@pytest.fixture
def model():
    ddpkit.init(cpu=True)
    return ddpkit.prepare_model(nn.Linear(3, 2))


def _names(ckpt):
    return [int(os.path.basename(p).split("-")[1]) for p in ckpt.checkpoints()]


def _old_run(tmp_path, model, steps, monkeypatch):
    """Checkpoints another job wrote in ``tmp_path`` (another torchrun job id)."""
    with monkeypatch.context() as m:
        m.setenv("TORCHELASTIC_RUN_ID", "an-earlier-job")
        _save(ddpkit.Checkpointer(str(tmp_path), keep=3), model, steps)


def _save(ckpt, model, steps):
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt.save(step, model=model)


def test_after_restoring_an_older_checkpoint_the_new_saves_are_kept_and_resumed(tmp_path, model):
    first = ddpkit.Checkpointer(str(tmp_path), keep=3)
    _save(first, model, range(2, 13, 2))  # 8, 10, 12 kept
    second = ddpkit.Checkpointer(str(tmp_path), keep=3)
    assert second.restore(str(tmp_path / "ckpt-0000000008"), model=model) == 8
    _save(second, model, (9, 10, 11))  # the run goes on from 8: 10 and 12 of the abandoned branch must go first
    assert _names(second) == [11, 10, 9]
    assert ddpkit.Checkpointer(str(tmp_path), resume=True).restore(model=model) == 11
    assert float(model.weight[0, 0]) == 11.0


def test_a_new_run_in_a_used_directory_is_stopped_before_it_loses_anything(tmp_path, model, monkeypatch):
    _old_run(tmp_path, model, (40, 44, 48), monkeypatch)
    before = sorted(os.listdir(tmp_path))
    for call in ("restore", "save"):
        again = ddpkit.Checkpointer(str(tmp_path), keep=3)
        with pytest.raises(FileExistsError) as info:
            again.restore(model=model) if call == "restore" else again.save(4, model=model)
        message = str(info.value)
        assert "ckpt-0000000048" in message and "--resume" in message and "\n" not in message, message
        assert sorted(os.listdir(tmp_path)) == before


def test_resume_false_starts_over_in_a_used_directory(tmp_path, model, monkeypatch):
    _old_run(tmp_path, model, (40, 44, 48), monkeypatch)
    fresh = ddpkit.Checkpointer(str(tmp_path), keep=3, resume=False)
    assert fresh.restore(model=model) == 0
    _save(fresh, model, (4, 8))
    assert _names(fresh) == [8, 4, 48]  # newest commits first; the old run's go as new ones come
    _save(fresh, model, (12,))
    assert _names(fresh) == [12, 8, 4]
    assert ddpkit.Checkpointer(str(tmp_path), resume=True).restore(model=model) == 12


def test_two_checkpointers_of_one_run_share_its_directory(tmp_path, model):
    _save(ddpkit.Checkpointer(str(tmp_path), keep=3), model, (4,))
    _save(ddpkit.Checkpointer(str(tmp_path), keep=3), model, (8,))  # one per save, as some scripts do
    assert _names(ddpkit.Checkpointer(str(tmp_path))) == [8, 4]


def test_restoring_from_another_directory_does_not_claim_this_one(tmp_path, model, monkeypatch):
    _save(ddpkit.Checkpointer(str(tmp_path / "pretrain")), model, (1000,))
    _old_run(tmp_path / "finetune", model, (40, 44, 48), monkeypatch)
    finetune = ddpkit.Checkpointer(str(tmp_path / "finetune"), keep=3)
    with pytest.raises(FileExistsError, match="ckpt-0000000048"):  # before anything is loaded
        finetune.restore(str(tmp_path / "pretrain" / "ckpt-0000001000"), model=model)
    assert _names(finetune) == [48, 44, 40]


def test_every_rank_gets_the_same_line_and_a_restart_resumes_nothing_of_the_other_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, ddpkit
        ddpkit.init()
        model = ddpkit.prepare_model(torch.nn.Linear(3, 2))
        ckpt = ddpkit.Checkpointer(sys.argv[1])
        ckpt.restore(model=model)
        ckpt.save(1, model=model)
        ddpkit.shutdown()
    """))
    first = launch(script, tmp_path / "ckpt", nproc=2)
    assert first.returncode == 0, first.stderr
    # the refusal fails the group; its restart (resume on) must not continue the earlier run instead
    r = launch(script, tmp_path / "ckpt", nproc=2, timeout=180, launcher_args=("--max-restarts", "1"))
    assert r.returncode != 0 and "resumed from" not in r.stderr, r.stderr[-3000:]
    line = "holds checkpoints of an earlier run (newest ckpt-0000000001)"
    assert line in r.stderr, r.stderr[-2000:]
    assert "failed first" in r.stderr and "failed after it" in r.stderr, r.stderr[-2000:]  # both raised, none hung
