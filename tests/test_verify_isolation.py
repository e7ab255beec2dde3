"""verify's runs do not resume from each other's checkpoints (Beta-VAE in the seventh held-out set): a script that
loads ``ckpt/last.pt`` when it is there made the N-process run start where the one-process run had stopped, and
the user's next real run would have resumed from verify's few steps."""
import sys

from conftest import run_cmd

SCRIPT = """
import os
import torch
from torch.utils.data import TensorDataset
import ddpkit

state = ddpkit.init()
torch.manual_seed(0)
model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start, ckpt = 0, os.path.join("ckpt", "last.pt")
if os.path.exists(ckpt):  # resume
    saved = torch.load(ckpt)
    ddpkit.unwrap(model).load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["epoch"] + 1
g = torch.Generator().manual_seed(1)
loader = ddpkit.data_loader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)),
                            global_batch_size=16)
for epoch in range(start, 3):
    loader.set_epoch(epoch)
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if state.is_main:
        os.makedirs("ckpt", exist_ok=True)
        torch.save({"model": ddpkit.unwrap(model).state_dict(), "opt": opt.state_dict(), "epoch": epoch}, ckpt)
"""


def test_a_script_that_resumes_from_its_checkpoint_verifies_and_leaves_no_checkpoint(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "notes.txt").write_text("mine")
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "6", "train.py"],
                timeout=300, cwd=str(tmp_path))
    # before: the runs resumed from each other's checkpoints, differed, and a float64 re-run "matched" after 4 steps
    assert r.returncode == 0 and r.stdout.startswith("PASS") and "after 6 steps" in r.stdout, r.stdout + r.stderr
    assert "float64" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "train.py"]  # ckpt/ and its file: gone
    assert "removed the files the one-process run saved: ckpt/last.pt" in r.stderr, r.stderr[-2000:]


def test_a_script_in_the_folder_of_verifys_own_temporary_files_verifies(tmp_path):
    """Set 29 (c, D8): a script in /tmp, where verify keeps its runs' weights: they were removed after the first run
    as files the script saved, and verify said "the script prepared no model"."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "tmp").mkdir()
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "2", "train.py"],
                timeout=300, cwd=str(tmp_path), env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr[-2000:]
    assert "ddpkit-verify-" not in r.stderr, r.stderr[-2000:]


def test_a_checkpoint_there_before_verify_that_a_run_saves_over_is_named_once(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT.replace("range(start, 3)", "range(start, 1 if start == 0 else 3)"))
    first = run_cmd([sys.executable, "train.py"], timeout=120, cwd=str(tmp_path))  # the user's own run: epoch 0
    assert first.returncode == 0 and (tmp_path / "ckpt" / "last.pt").exists(), first.stderr[-1500:]
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "5", "train.py"],
                timeout=300, cwd=str(tmp_path))
    said = [line for line in r.stderr.splitlines() if "saved over" in line]
    assert len(said) == 1 and "ckpt/last.pt" in said[0] and "move it away" in said[0], r.stderr[-2000:]
    assert (tmp_path / "ckpt" / "last.pt").exists()  # the user's file is not verify's to remove


def test_a_named_pipe_a_run_leaves_is_not_opened_and_a_tree_too_big_to_list_is_said(tmp_path):
    """Review: ``undo`` opened every new file to see whether it was a torch.save archive, and a FIFO the script
    made blocked verify forever; past 20000 files nothing was removed, and nothing said so."""
    import os
    import threading

    from ddpkit.commands.verify import isolate

    before = isolate.listing([str(tmp_path)])
    os.mkfifo(tmp_path / "pipe")
    done = []
    worker = threading.Thread(target=lambda: done.append(isolate.undo(before)), daemon=True)
    worker.start()
    worker.join(20)
    assert done == [([], [])] and (tmp_path / "pipe").exists()
    (tmp_path / "pipe").unlink()
    (tmp_path / "train.py").write_text(SCRIPT)
    many = tmp_path / "dataset"
    many.mkdir()
    for i in range(isolate.LIMIT + 2):
        (many / f"{i}.txt").touch()
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "6", "train.py"],
                timeout=300, cwd=str(tmp_path))
    assert f"more than {isolate.LIMIT} files under" in r.stderr and "folder of the script's code alone" in r.stderr, \
        r.stderr[-2000:]


def test_the_tensorboard_log_a_run_leaves_is_removed_with_its_folder(tmp_path):
    """pixel-cnn-pp refuses to start when ``runs/<name>`` exists: verify's one-process run left it, and the
    N-process run stopped on "already exists!" (the seventeenth held-out set)."""
    from ddpkit.commands.verify.isolate import listing, undo

    (tmp_path / "data.csv").write_text("x")
    before = listing([str(tmp_path)])
    (tmp_path / "runs" / "pixelcnn").mkdir(parents=True)
    (tmp_path / "runs" / "pixelcnn" / "events.out.tfevents.1765000000.host.1.0").write_bytes(b"\x00" * 16)
    removed, _ = undo(before)
    assert [p.rsplit("/", 1)[-1] for p in removed] == ["events.out.tfevents.1765000000.host.1.0"], removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]
