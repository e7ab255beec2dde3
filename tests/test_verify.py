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
