"""`ddpkit check`: the planted mistakes in the corpus at the right lines, nothing in ddpkit's examples."""
import json
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cmd
from ddpkit.check import RULES, analyze

CORPUS = sorted((ROOT / "tests" / "check_corpus").glob("*.py"))
# ddpkit's examples, and the test workers that are not wrong on purpose (hang.py, misc.py and verify_bugs.py are)
EXAMPLES = sorted((ROOT / "examples").glob("*.py")) + [
    ROOT / "tests" / "workers" / name for name in ("skeleton.py", "equivalence.py", "resume.py")]


def expected(path: Path) -> set[tuple[int, str]]:
    found = set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if m := re.search(r"# expect: (.*)$", line):
            found |= {(number, rule) for rule in m.group(1).split()}
    return found


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_corpus_findings_are_exactly_the_planted_ones(path):
    assert {(f.line, f.rule) for f in analyze(path.read_text())} == expected(path)


def test_every_rule_is_exercised_by_the_corpus():
    planted = {rule for path in CORPUS for _, rule in expected(path)}
    assert planted == set(RULES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_false_positives_on_ddpkit_scripts(path):
    assert analyze(path.read_text()) == []


def test_command_line_json_and_exit_codes():
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", "--json", str(CORPUS[0])], timeout=60)
    findings = json.loads(r.stdout)["findings"]
    assert r.returncode == 1 and {"line", "rule", "message", "why", "fix"} <= set(findings[0])
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", str(ROOT / "examples" / "digits.py")], timeout=60)
    assert r.returncode == 0 and r.stdout == ""
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", "missing.py"], timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1


def test_several_files_and_directories_as_linters_take_them():
    """Issue 12: a second path used to be refused."""
    corpus = ROOT / "tests" / "check_corpus"
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", "--json", str(corpus), str(ROOT / "examples" / "digits.py")],
                timeout=60)
    findings = json.loads(r.stdout)["findings"]
    assert r.returncode == 1 and {f["path"] for f in findings} == {str(p) for p in CORPUS if expected(p)}
    assert sum(len(expected(p)) for p in CORPUS) == len(findings)
    r = run_cmd([sys.executable, "-m", "ddpkit", "check"], timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("ddpkit check: error: ") and r.stderr.count("\n") == 1


def test_severities_and_strict(tmp_path):
    """Issue 17: every rule has a severity; the exit code follows errors only, unless --strict."""
    from ddpkit.check import SEVERITY

    assert set(SEVERITY) == set(RULES) and set(SEVERITY.values()) == {"error", "warning", "advice"}
    advice_only = tmp_path / "dp.py"
    advice_only.write_text("import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", str(advice_only)], timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("advice: ") and "DDP011" in r.stdout
    assert run_cmd([sys.executable, "-m", "ddpkit", "check", "--strict", str(advice_only)], timeout=60).returncode == 1
    spawn_script = ROOT / "tests" / "check_corpus" / "mp_spawn.py"
    r = run_cmd([sys.executable, "-m", "ddpkit", "check", "--json", str(spawn_script)], timeout=60)
    assert r.returncode == 1
    assert {(f["rule"], f["severity"]) for f in json.loads(r.stdout)["findings"]} == {("DDP017", "warning"),
                                                                                      ("DDP018", "error")}
