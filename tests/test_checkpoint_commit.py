"""Committing a checkpoint: re-saving a step is atomic (a crash at any point keeps a whole checkpoint of it)."""
import os
import signal
import sys
import textwrap

import torch

import ddpkit
from conftest import run_cmd
from ddpkit.checkpoint import newest_valid

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
