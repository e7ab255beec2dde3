"""`ddpkit verify` end to end: passes on equivalent scripts, fails naming the difference on broken ones."""
import json
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, ok, run_cmd
from ddpkit.verify import compare

VERIFY = [sys.executable, "-m", "ddpkit", "verify"]


def test_digits_example_passes():
    r = ok(run_cmd(VERIFY + ["--steps", "4", str(ROOT / "examples" / "digits.py")], timeout=240))
    assert r.stdout.startswith("PASS: 2 processes match 1 process after 4 steps"), r.stdout


@pytest.mark.parametrize("bug, first", [("sum", "0.weight"), ("nosync", "0.weight")])
def test_broken_scripts_fail_naming_the_first_difference(bug, first):
    r = run_cmd(VERIFY + ["--json", "--steps", "3", str(WORKERS / "verify_bugs.py"), "--bug", bug], timeout=240)
    result = json.loads(r.stdout)
    assert r.returncode == 1 and result["passed"] is False
    assert result["first_diverging"] == first and result["first_max_abs_diff"] > 1e-4


def test_correct_script_passes_with_json():
    r = ok(run_cmd(VERIFY + ["--json", "--steps", "3", str(WORKERS / "verify_bugs.py")], timeout=240))
    result = json.loads(r.stdout)
    assert result["passed"] is True and result["max_abs_diff"] < 1e-5 and result["tensors"] == 9


def test_compare_reports_keys_and_shapes():
    a = {"w": torch.zeros(2), "b": torch.zeros(1)}
    assert compare(a, {"w": torch.zeros(2)}, 1e-6, 0)["reason"].startswith("keys differ")
    assert compare(a, {"w": torch.zeros(3), "b": torch.zeros(1)}, 1e-6, 0)["reason"] == "shape (2,) vs (3,)"
    assert compare(a, {"w": torch.tensor([0.0, 1.0]), "b": torch.zeros(1)}, 1e-6, 0)["first_diverging"] == "w"


def test_bad_arguments_exit_2():
    r = run_cmd(VERIFY + ["--nproc-per-node", "1", "missing.py"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
