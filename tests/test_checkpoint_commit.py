"""Committing a checkpoint: re-saving a step is atomic (a crash at any point keeps a whole checkpoint of it)."""
import errno
import os
import signal
import sys
import textwrap

import pytest
import torch

import ddpkit
from conftest import run_cmd
from ddpkit.checkpoint.checkpointer import newest_valid
from ddpkit.checkpoint.lock import LOCK

STEP5 = "ckpt-0000000005"


def _save_twice_and_die(directory, ref, when):
    """Save step 5, then save it again and SIGKILL this process at ``when``: just before the new copy takes the
    checkpoint's name ("rename"), or just before the replaced copy is removed ("remove")."""
    script = textwrap.dedent(f"""
        import os, shutil, signal, torch, ddpkit
        ddpkit.init(cpu=True)
        ckpt = ddpkit.Checkpointer({str(directory)!r})
        first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        torch.save({{"first": first.state_dict(), "second": second.state_dict()}}, {str(ref)!r})
        ckpt.save(5, model=first)
        final = os.path.join({str(directory)!r}, {STEP5!r})

        def dying(call, hit):
            def run(path, *args, **kwargs):
                if hit(path, *args):
                    os.kill(os.getpid(), signal.SIGKILL)
                return call(path, *args, **kwargs)
            return run

        if {when!r} == "rename":  # the new copy is about to take the name
            os.rename = dying(os.rename, lambda src, dst: os.path.abspath(dst) == final)
            os.replace = dying(os.replace, lambda src, dst: os.path.abspath(dst) == final)
        else:  # the old copy, set aside, is about to go
            shutil.rmtree = dying(shutil.rmtree, lambda path: os.path.basename(path).startswith({STEP5!r} + "."))
        ckpt.save(5, model=second)
    """)
    return run_cmd([sys.executable, "-c", script], timeout=120)


def _restored(directory):
    ddpkit.init(cpu=True)
    model = torch.nn.Linear(2, 2)
    step = ddpkit.Checkpointer(str(directory), resume=True).restore(model=model)
    return step, model.state_dict()


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_crash_while_resaving_a_step_keeps_a_whole_checkpoint_of_it(tmp_path):
    for when, kept in (("rename", "first"), ("remove", "second")):
        directory, ref = tmp_path / when / "ckpt", tmp_path / when / "ref.pt"
        r = _save_twice_and_die(directory, ref, when)
        assert r.returncode == -signal.SIGKILL, (when, r.returncode, r.stderr[-2000:])
        assert newest_valid(str(directory)) is not None, (when, os.listdir(directory))
        step, weights = _restored(directory)
        assert step == 5 and _same(weights, torch.load(ref)[kept]), when
        # the next run's first save of the step again leaves the one checkpoint, and nothing set aside
        ddpkit.Checkpointer(str(directory), resume=True).save(5, model=torch.nn.Linear(2, 2))
        assert sorted(os.listdir(directory)) == [STEP5], (when, os.listdir(directory))


def test_a_leftover_copy_set_aside_does_not_block_saving_its_step_again(tmp_path):
    """A copy set aside that could not be removed (an NFS .nfsXXXX file still open) took the only name the
    next re-save of its step would use: every re-save failed with [Errno 39] Directory not empty."""
    ddpkit.init(cpu=True)
    ckpt = ddpkit.Checkpointer(str(tmp_path), keep=3)
    ckpt.save(5, model=torch.nn.Linear(2, 2))
    stuck = tmp_path / f"{STEP5}.replaced-{os.getpid()}"
    stuck.mkdir()
    (stuck / ".nfs000000001").write_text("busy")
    for _ in range(2):
        model = torch.nn.Linear(2, 2)
        assert ckpt.save(5, model=model) == str(tmp_path / STEP5)
        step, weights = _restored(tmp_path)
        assert step == 5 and _same(weights, model.state_dict())
    # no copy of this process's re-saves is left (the leftover too went here: root may remove .nfs files)
    assert STEP5 in os.listdir(tmp_path) and set(os.listdir(tmp_path)) <= {STEP5, stuck.name, LOCK}


def test_a_failure_after_the_rename_reports_the_checkpoint_saved(tmp_path, monkeypatch):
    """Once the new copy holds the name the checkpoint is committed: an fsync error of the directory after it
    is a warning about durability, not "not saved ... the newest checkpoint is still" the one before."""
    from ddpkit.checkpoint import disk as checkpoint_files
    ddpkit.init(cpu=True)
    ckpt = ddpkit.Checkpointer(str(tmp_path), keep=1)
    ckpt.save(5, model=torch.nn.Linear(2, 2))
    real = checkpoint_files.fsync_dir

    def failing(path):
        if os.path.abspath(path) == str(tmp_path):  # the parent's fsync, after the rename
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(checkpoint_files, "fsync_dir", failing)
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match=r"ckpt-0000000006 was saved, but .*Input/output error"):
        assert ckpt.save(6, model=model) == str(tmp_path / "ckpt-0000000006")
    monkeypatch.undo()
    # committed, and retention ran (keep=1); the lock is the live job's own
    assert sorted(os.listdir(tmp_path)) == [LOCK, "ckpt-0000000006"]
    step, weights = _restored(tmp_path)
    assert step == 6 and _same(weights, model.state_dict())
