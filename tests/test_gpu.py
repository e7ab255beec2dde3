"""GPU tier: NCCL and DataParallel. Skipped cleanly where CUDA (or a second GPU) is missing."""
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, launch, ok, run_cmd

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


@needs_gpu
def test_nccl_ddp_on_own_gpu(tmp_path):
    nproc = min(GPUS, 2)
    ok(launch(WORKERS / "skeleton.py", tmp_path, nproc=nproc))
    states = [torch.load(tmp_path / f"rank{r}.pt")["state"] for r in range(nproc)]
    assert [s["device"] for s in states] == [f"cuda:{r}" for r in range(nproc)]
    expected_mode, expected_backend = ("ddp", "nccl") if nproc > 1 else ("single", None)
    assert {(s["mode"], s["backend"]) for s in states} == {(expected_mode, expected_backend)}


@needs_two
def test_dataparallel_mode_runs_the_demo(tmp_path):
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--mode", "dp", str(ROOT / "examples" / "digits.py"),
                    "--epochs", "3", "--logdir", str(tmp_path)]))
    assert "DataParallel" in r.stderr and float(r.stdout.strip().splitlines()[-1].split("=")[1]) >= 0.9


@needs_gpu
def test_demo_on_gpu(tmp_path):
    r = ok(launch(ROOT / "examples" / "digits.py", "--logdir", tmp_path, nproc=min(GPUS, 2)))
    assert float(r.stdout.strip().splitlines()[-1].split("=")[1]) >= 0.95
