"""A model built as scripts build it, right after ``ddpkit.init(seed=0)`` with no reseed, is the same model in every
mode and at every world size: fsdp at 2 and 3 processes holds bitwise the 1-process build (normal and
``init_empty()``, with a structured init), ties survive ``init_empty()`` in every mode, and an optimizer built
before ``prepare_model`` on an ``init_empty()`` model raises instead of training nothing (real gloo processes)."""
import sys

import pytest
import torch

from conftest import WORKERS, launch, ok, run_cmd

WORKER = WORKERS / "init_paths.py"


def _one_process(out, *args):
    ok(run_cmd([sys.executable, str(WORKER), str(out), *args]))
    return torch.load(out / "weights.pt")


def _launched(out, nproc, mode, *args):
    ok(launch(WORKER, out, *args, nproc=nproc, launcher_args=("--mode", mode, "--device", "cpu")))
    return torch.load(out / "weights.pt")


def _same(a, b):
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ from the 1-process build: {differ}"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    found = {}
    for build in ("normal", "empty"):
        out = tmp_path_factory.mktemp(f"ref-{build}")
        found[build] = _one_process(out, build, "--init-fn", "--tie")
    return found


@pytest.mark.parametrize("build,nproc", [("normal", 2), ("empty", 2), ("normal", 3), ("empty", 3)])
def test_fsdp_holds_the_one_process_model_without_a_reseed(tmp_path, references, build, nproc):
    got = _launched(tmp_path, nproc, "fsdp", build, "--init-fn", "--tie")
    _same(got["initial"], references[build]["initial"])


@pytest.mark.parametrize("flags", [("--tie-head",), ("--numpy",)])
def test_fsdp_init_empty_holds_the_one_process_model_with_nanogpt_ties_and_numpy_inits(tmp_path, flags):
    reference = _one_process(tmp_path, "normal", *flags)
    got = _launched(tmp_path, 2, "fsdp", "empty", *flags)
    _same(got["initial"], reference["initial"])


def test_init_empty_replays_the_normal_build(references):
    _same(references["empty"]["initial"], references["normal"]["initial"])


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp"])
def test_ties_survive_init_empty(tmp_path, references, mode):
    got = _one_process(tmp_path, "empty", "--init-fn", "--tie") if mode == "single" else \
        _launched(tmp_path, 2, mode, "empty", "--init-fn", "--tie")
    normal = references["normal"]
    assert got["tied"] and got["parameters"] == normal["parameters"] == 7, (got["tied"], got["parameters"])
    assert torch.equal(got["trained"]["head.weight"], got["trained"]["emb.weight"])  # still one tensor after a step
    _same(got["initial"], normal["initial"])


@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp"])
def test_optimizer_built_before_prepare_model_on_init_empty_raises(tmp_path, mode):
    args = [str(tmp_path), "empty", "--early-optimizer"]
    r = run_cmd([sys.executable, str(WORKER), *args]) if mode == "single" else \
        launch(WORKER, *args, nproc=2, launcher_args=("--mode", mode, "--device", "cpu"))
    assert r.returncode != 0, "an optimizer over the meta parameters trained nothing, silently"
    assert "was built before prepare_model" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "weights.pt").exists()
