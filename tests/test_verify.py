"""`ddpkit verify` end to end: passes on equivalent scripts, fails naming the difference on broken ones.
(The digits example and the README quickstart are verified by tests/test_docs.py, as the docs show them.)"""
import json
import sys

import pytest
import torch

from conftest import WORKERS, ok, run_cmd
from ddpkit.verify import compare_weights

VERIFY = [sys.executable, "-m", "ddpkit", "verify"]


@pytest.mark.parametrize("mode, bug, first", [("ddp", "sum", "0.weight"), ("ddp", "nosync", "0.weight"),
                                              ("fsdp", "sum", "0.weight")])  # fsdp: a SUM where AVG was meant
def test_broken_scripts_fail_naming_the_first_difference(mode, bug, first):
    r = run_cmd(VERIFY + ["--json", "--mode", mode, "--steps", "3", str(WORKERS / "verify_bugs.py"), "--bug", bug],
                timeout=240)
    result = json.loads(r.stdout)
    assert r.returncode == 4 and result["passed"] is False and result["mode"] == mode
    assert result["first_diverging"] == first and result["first_max_abs_diff"] > 1e-4


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_correct_script_passes_with_json(mode):
    r = ok(run_cmd(VERIFY + ["--json", "--mode", mode, "--steps", "3", str(WORKERS / "verify_bugs.py")], timeout=240))
    result = json.loads(r.stdout)
    assert result["passed"] is True and result["max_abs_diff"] < 1e-5 and result["tensors"] == 9


def test_compare_reports_keys_and_shapes():
    a = {"w": torch.zeros(2), "b": torch.zeros(1)}
    assert compare_weights(a, {"w": torch.zeros(2)}, 1e-6, 0)["reason"].startswith("keys differ")
    assert compare_weights(a, {"w": torch.zeros(3), "b": torch.zeros(1)}, 1e-6, 0)["reason"] == "shape (2,) vs (3,)"
    assert compare_weights(a, {"w": torch.tensor([0.0, 1.0]), "b": torch.zeros(1)}, 1e-6, 0)["first_diverging"] == "w"


def test_bad_arguments_exit_2():
    r = run_cmd(VERIFY + ["--nproc-per-node", "1", "missing.py"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_a_script_with_dropout_passes_unedited(tmp_path):
    """Issue 12: verify sets dropout to p=0 in both runs; --keep-dropout leaves it (and then they differ)."""
    script = tmp_path / "dropout.py"
    source = (WORKERS / "verify_bugs.py").read_text()
    script.write_text(source.replace("nn.Tanh(), nn.Linear(8, 1)", "nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1)"))
    assert "nn.Dropout(0.5)" in script.read_text()
    assert ok(run_cmd(VERIFY + ["--steps", "3", str(script)], timeout=240)).stdout.startswith("PASS")
    r = run_cmd(VERIFY + ["--steps", "3", "--keep-dropout", str(script)], timeout=240)
    assert r.returncode == 4 and r.stdout.startswith("FAIL"), r.stdout + r.stderr


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_model_built_inside_init_empty_is_verified_in_every_mode(mode):
    """Issue 24.9: in fsdp a meta-built model was never captured ("the script saved no weights"). The script
    does not seed and has dropout: a PASS needs verify's initial weights and dropout-off on the sharded model."""
    r = run_cmd(VERIFY + ["--json", "--mode", mode, "--steps", "3", str(WORKERS / "verify_empty.py")], timeout=240)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    result = json.loads(r.stdout)
    assert result["passed"] is True and result["tensors"] == 9 and result["max_abs_diff"] < 1e-5, result


def test_a_run_that_diverged_only_with_n_processes_fails_naming_the_non_finite_tensor():
    """Issue 24.12: NaN weights in the N-process run compared as "max abs diff 0.0", PASS (NaN > tol is False)."""
    r = run_cmd(VERIFY + ["--steps", "3", str(WORKERS / "verify_bugs.py"), "--bug", "std"], timeout=240)
    assert r.returncode == 4 and r.stdout.startswith("FAIL"), r.stdout + r.stderr[-3000:]
    assert "non-finite" in r.stdout and "'0.weight'" in r.stdout and "2 processes" in r.stdout, r.stdout


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("one, many, reason", [
    ([0.5, 1.0], [0.5, NAN], "non-finite values differ in 'w': 1 (1 process) vs nan (2 processes) at [1]"),
    ([INF, 1.0], [-INF, 1.0], "non-finite values differ in 'w': inf (1 process) vs -inf (2 processes) at [0]"),
    ([NAN, 1.0], [0.5, 1.0], "non-finite values differ in 'w': nan (1 process) vs 0.5 (2 processes) at [0]"),
    ([NAN, 1.0], [NAN, 1.0], "both runs diverged: 'w' holds nan in both"),
    ([INF, 1.0], [INF, 1.0], "both runs diverged: 'w' holds inf in both"),
])
def test_compare_fails_on_any_non_finite_weight(one, many, reason):
    """No PASS with a NaN or inf anywhere: a mismatch names both values, the same non-finite value in both runs
    is a divergence of the training itself. The reported max abs diff stays a finite number (valid JSON)."""
    ref = {"b": torch.zeros(3), "w": torch.tensor(one), "z": torch.zeros(1)}
    got = {"b": torch.zeros(3), "w": torch.tensor(many), "z": torch.ones(1)}  # 'z' differs, but after 'w'
    result = compare_weights(ref, got, 1e-5, 1e-4, labels=("1 process", "2 processes"))
    assert result["passed"] is False and result["first_diverging"] == "w", result
    assert result["non_finite"] is True and result["reason"].startswith(reason), result["reason"]
    json.dumps(result, allow_nan=False)


def test_compare_of_finite_weights_is_unchanged():
    ref, got = {"w": torch.tensor([1.0, 2.5])}, {"w": torch.tensor([1.0, 2.5 + 2**-20])}  # exact in float32
    result = compare_weights(ref, got, 1e-5, 1e-4)
    assert result["passed"] is True and result["non_finite"] is False and 0 < result["max_abs_diff"] < 1e-6


def test_compare_sees_the_imaginary_part():
    ref = {"w": torch.tensor([1 + 1j, 2 + 0j])}
    assert compare_weights(ref, {"w": torch.tensor([1 + 1j, complex(2, float("nan"))])}, 1e-5, 1e-4)["non_finite"]
    assert not compare_weights(ref, {"w": torch.tensor([1 + 2j, 2 + 0j])}, 1e-5, 1e-4)["passed"]
    assert compare_weights(ref, {"w": ref["w"].clone()}, 1e-5, 1e-4)["passed"]
