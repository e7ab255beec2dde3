"""`ddpkit doctor` on this machine: a real 2-process all-reduce, JSON output, verdicts."""
import json
import sys

from conftest import run_cmd
from ddpkit.commands.doctor import smoke_test


def test_doctor_json_on_this_machine():
    r = run_cmd([sys.executable, "-m", "ddpkit", "doctor", "--json"], timeout=120)
    report = json.loads(r.stdout)
    names = {f["name"]: f for f in report["findings"]}
    assert r.returncode == 0 and report["ok"] is True
    assert {"torch", "gpus", "gloo", "allreduce-gloo", "free-port", "threads"} <= set(names)
    assert names["allreduce-gloo"]["verdict"] == "ok" and "latency" in names["allreduce-gloo"]["detail"]
    assert all(f["verdict"] in ("ok", "warn", "fail", "info") for f in report["findings"])


def test_an_all_reduce_that_cannot_finish_in_time_is_a_failure():
    finding = smoke_test("gloo", timeout_s=0.01)  # processes cannot even start in 10 ms
    assert finding.verdict == "fail" and "did not complete" in finding.detail and finding.hint


def test_unknown_option_exits_2():
    r = run_cmd([sys.executable, "-m", "ddpkit", "doctor", "--bogus"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
