"""The main job end to end: examples/digits.py under 2 DDP processes and as plain python."""
import sys

from conftest import ROOT, launch, ok, run_cmd

DIGITS = ROOT / "examples" / "digits.py"


def _accuracy(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("accuracy="), stdout
    return float(last.split("=")[1])


def test_demo_two_processes_reaches_accuracy_with_one_event_file(tmp_path):
    result = ok(launch(DIGITS, "--logdir", tmp_path / "tb", timeout=300))
    assert _accuracy(result.stdout) >= 0.95
    assert result.stdout.count("accuracy=") == 1
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_same_file_runs_as_one_plain_process(tmp_path):
    result = ok(run_cmd([sys.executable, str(DIGITS), "--epochs", "3", "--logdir", str(tmp_path / "tb")]))
    assert _accuracy(result.stdout) >= 0.9
    assert "single-device training" in result.stderr
