"""Public-script shapes converted to ddpkit (tests/realworld/, see its README): ``ddpkit launch``, ``ddpkit
verify`` and ``ddpkit check`` on each, as a user runs them after following the README.

Every subprocess starts at once in a module fixture (as many at a time as the cores allow, each worker one
thread), so the file costs roughly its slowest few runs. Exactness runs use ``--lr 0``: the weights stay the
seeded initial ones, so the reduced test metrics of 2 processes must be the one-process ones (counts exactly,
float sums up to summation order); training equivalence is verify's part.
"""
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, launch, ok, run_cmd

HERE = ROOT / "tests" / "realworld"
# the VAE and the Trainer get their 2-process launch from verify; exactness where the metric is an evaluation
EXACT = {"mnist": ("--epochs", "1", "--lr", "0"), "word_lm": ("--epochs", "1", "--lr", "0")}
# the fixture's runs are set up in the first test: on a machine shared with other suites they take minutes
pytestmark = pytest.mark.timeout(900)
# word_lm's refusal (hand-fed batches) is tests/test_verify.py's "handshard" case: not run twice
VERIFY = {"mnist": ("--epochs", "1"), "vae": ("--epochs", "1"), "trainer_gpt": ("--max-iters", "20")}


def _jobs():
    jobs = {}
    for name, args in EXACT.items():
        jobs[f"{name}:1"] = lambda n=name, a=args: run_cmd([sys.executable, str(HERE / f"{n}.py"), *a])
        jobs[f"{name}:2"] = lambda n=name, a=args: launch(HERE / f"{n}.py", *a)
    for name, args in VERIFY.items():
        jobs[f"verify:{name}"] = lambda n=name, a=args: run_cmd(
            [sys.executable, "-m", "ddpkit", "verify", "--nproc-per-node", "2", str(HERE / f"{n}.py"), *a])
    return jobs


@pytest.fixture(scope="module")
def runs():
    # a launch is 2 one-thread workers (verify: 1, then 2): one job per two cores keeps the machine unsaturated
    width = max(1, len(os.sched_getaffinity(0)) // 2)
    with ThreadPoolExecutor(width) as pool:
        futures = {key: pool.submit(job) for key, job in _jobs().items()}
        return {key: future.result() for key, future in futures.items()}


def _last(pattern, result):
    found = re.findall(pattern, ok(result).stdout)
    assert found, (pattern, result.stdout[-2000:], result.stderr[-2000:])
    return found[-1]


def _same_metric(runs, name, pattern):
    one, two = _last(pattern, runs[f"{name}:1"]), _last(pattern, runs[f"{name}:2"])
    return [float(v) for v in (one if isinstance(one, tuple) else (one,))], \
        [float(v) for v in (two if isinstance(two, tuple) else (two,))]


def test_mnist_test_set_metrics_reduced_exactly(runs):
    one, two = _same_metric(runs, "mnist", r"Average loss: ([\d.]+), Accuracy: (\d+)/(\d+)")
    assert one[1:] == two[1:] and one[2] == 101, (one, two)   # correct / seen: every test sample counted once
    assert two[0] == pytest.approx(one[0], rel=1e-5)


def test_word_lm_hand_sharded_columns_valid_loss_exact(runs):
    one, two = _same_metric(runs, "word_lm", r"valid loss ([\d.]+)")
    assert two[0] == pytest.approx(one[0], rel=1e-5)


def test_verify_passes_the_mnist_conversion(runs):
    assert ok(runs["verify:mnist"]).stdout.startswith("PASS: 2 processes match 1 process"), runs["verify:mnist"]


def test_verify_on_vae_passes_or_names_sampling_noise(runs):
    """Its 2-process run reaches model.decode(z) on the prepared model after the epoch."""
    r = runs["verify:vae"]
    assert "AttributeError" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith("PASS") or "random draws" in r.stdout + r.stderr, (r.stdout, r.stderr[-2000:])


def test_verify_passes_the_trainer_with_an_endless_loop(runs):
    """The 2-process run also trains the Trainer under ddpkit launch: configure_optimizers, the endless loop."""
    assert ok(runs["verify:trainer_gpt"]).stdout.startswith("PASS"), runs["verify:trainer_gpt"]


def _check(paths, capsys):
    from ddpkit.commands.check.command import main

    code = main(["--json", *map(str, paths)])
    return code, json.loads(capsys.readouterr().out)


def test_check_is_silent_on_the_correct_conversions(capsys):
    code, report = _check(sorted(HERE.glob("*.py")), capsys)
    assert (code, report["findings"], report["not_analysed"]) == (0, [], [])


def test_check_finds_the_classic_mistakes_in_a_ddpkit_conversion(tmp_path, capsys):
    """The MNIST conversion with the three mistakes a converter makes: test sums not reduced, a plain print,
    an unguarded save. Each must be reported on its line."""
    text = (HERE / "mnist.py").read_text()
    broken = (text.replace("    test_loss, correct, seen = ddpkit.reduce(test_loss), ddpkit.reduce(correct), "
                           "ddpkit.reduce(seen)\n", "")
                  .replace('    ddpkit.print(f"Test set:', '    print(f"Test set:')
                  .replace("if args.save_model and state.is_main:", "if args.save_model:"))
    assert broken.count("\n") == text.count("\n") - 1
    script = tmp_path / "mnist_broken.py"
    script.write_text(broken)
    lines = broken.split("\n")
    where = {key: next(i + 1 for i, line in enumerate(lines) if key in line)
             for key in ('print(f"Test set:', "torch.save(")}
    code, report = _check([script], capsys)
    # the unreduced metric: this script divides by its own (unreduced) count, so each rank prints its own
    # accuracy, which DDP017 names at the print ("each with only this rank's value"); dividing by
    # len(loader.dataset) instead is DDP018 (tests/check_corpus/mnist_ddpkit_mistakes.py)
    rules = {(f["line"], f["rule"]) for f in report["findings"]}
    assert {(where['print(f"Test set:'], "DDP017"), (where["torch.save("], "DDP007")} <= rules, report
