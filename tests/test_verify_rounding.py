"""``ddpkit verify`` tells float rounding from a defect (issue 44): a correct BatchNorm + Adam CNN, whose conv biases
before BatchNorm get pure float32 noise that Adam magnifies to lr-sized steps, FAILed as "rank-dependent code";
verify now runs both sides again in float64 and PASSes it, saying which test decided, while per-rank BatchNorm
statistics still FAIL in float64 too."""
import sys

import torch

from conftest import WORKERS, ok, run_cmd
from ddpkit.commands.verify.rounding import _cast

VERIFY = [sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "4", str(WORKERS / "verify_bn_adam.py")]


def test_a_correct_batchnorm_adam_cnn_passes_by_the_float64_rerun():
    """Also with a subclass of Adam (review: matched by exact name, no re-run), a torch.save of the whole model
    (review: the float64 hooks were lambdas, which pickle refused) and ``model.forward(x)`` (sixth held-out set:
    the model's own hooks did not run in the one-process run, and the float64 re-run stopped at a float32 input)."""
    r = ok(run_cmd(VERIFY + ["--own-adam", "--forward-call"], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]
    assert "decided by a float64 re-run: in float32 the runs ended '0.bias'" in r.stdout, r.stdout


def test_samples_fetched_in_loader_workers_do_not_stop_the_float64_rerun():
    """The fourth held-out set: a BatchNorm + Adam CNN whose Dataset is the script's own class (ddpkit's loader
    fetches it in worker processes) was "cannot compare exactly", blamed on the workers' draws, with no draw at
    all: each sample's draws are its own in verify's runs (samples.py), so only a collate_fn's could differ. With a
    float32 tensor made in the forward meeting the model's own in a ``bmm`` (R-BERT's ``mask.float()``, the seventh
    set: the float64 re-run stopped at "expected scalar type Double but found Float")."""
    r = ok(run_cmd(VERIFY + ["--own-dataset", "--mask-float"], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]
    assert "decided by a float64 re-run" in r.stdout, r.stdout


def test_code_that_finds_batchnorm_layers_by_isinstance_still_finds_them_once_synchronised():
    """network-slimming (the fourth held-out set) adds an L1 subgradient to each ``nn.BatchNorm2d`` weight after
    backward: once prepared they were SyncBatchNorm layers, no BatchNorm2d to isinstance, and the 2-process run
    skipped the penalty with no word (verify's FAIL was right). The synchronised layers keep their kind now."""
    r = ok(run_cmd(VERIFY + ["--l1-bn"], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]


def test_a_zero_padded_batchnorm_output_passes_by_the_rounding_floor():
    """DeepLabV3Plus (the fifteenth held-out set) FAILed in float64 too: a zero-padded border after a BatchNorm
    meets a second BatchNorm + ReLU at the sign of a rounding error, so step 1's gradients part by a real amount
    in any precision. One-process re-runs from initial weights perturbed by rounding measure that floor."""
    r = ok(run_cmd(VERIFY + ["--pad"], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]
    assert "decided by 2 one-process float64 re-runs from initial weights perturbed by float32 rounding" in r.stdout, \
        r.stdout


def test_per_rank_batchnorm_statistics_still_fail_in_float64_beyond_the_rounding_floor():
    """With the padded border too: the floor that rounding makes there does not hide per-rank statistics."""
    r = run_cmd(VERIFY + ["--local-bn", "--pad"], timeout=400)
    assert r.returncode != 0 and r.stdout.startswith("FAIL"), r.stdout + r.stderr[-2000:]
    assert "the float64 re-run differs too" in r.stdout and "not float rounding" in r.stdout, r.stdout
    assert "what one-process re-runs from rounding-perturbed initial weights make there" in r.stdout, r.stdout


def test_the_cast_keeps_model_output_types():
    """Review: a Hugging Face-style ModelOutput (a dict subclass read by attribute) came back a plain dict; a
    dataclass output was never cast back."""
    import dataclasses

    class Output(dict):
        __getattr__ = dict.__getitem__

    @dataclasses.dataclass
    class Result:
        logits: torch.Tensor
        name: str = "x"

    out = _cast(Output(logits=torch.ones(2, dtype=torch.float64)), torch.float32)
    assert type(out) is Output and out.logits.dtype == torch.float32
    res = _cast(Result(torch.ones(2, dtype=torch.float64)), torch.float32)
    assert type(res) is Result and res.logits.dtype == torch.float32 and res.name == "x"


def test_the_cast_keeps_structure_and_leaves_integers():
    x, ids = torch.ones(2), torch.arange(3)
    got = _cast({"a": [x, ids], "b": (x,)}, torch.float64)
    assert got["a"][0].dtype == torch.float64 and got["a"][1] is ids and isinstance(got["b"], tuple)


def test_a_crash_in_verifys_own_runs_is_one_line_naming_the_scripts_line():
    """Review: a batch-sized tensor crashed verify's one-process run with a raw traceback."""
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3",
                 str(WORKERS / "verify_crashes.py"), "--batch-sized"], timeout=300)
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddpkit verify: error:")]
    assert r.returncode != 0 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "the one-process run failed at verify_crashes.py:24 (RuntimeError: The size of tensor a (16)" in errors[0]
    assert "so a tensor sized from a fixed batch size breaks there" in errors[0]


def test_a_script_that_saves_its_whole_model_passes():
    """Review: verify's forward hook (a method of its recorder) made torch.save(model) fail at the end."""
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "100",
                    str(WORKERS / "verify_crashes.py"), "--save-whole"], timeout=300))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-1500:]


def test_a_model_that_makes_tensors_in_its_forward_runs_in_the_float64_rerun():
    """Review: an LSTM's h0 = torch.zeros(...) made in forward crashed the re-run (float32 beside float64)."""
    from torch import nn

    from ddpkit.commands.verify.rounding import to_float64

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 2)

        def forward(self, x):
            h0 = torch.zeros(1, x.size(0), 8)
            out, _ = self.rnn(x, (h0, torch.zeros(1, x.size(0), 8)))
            return self.fc(out[:, -1]), torch.fft.rfft(out[:, -1])

    model = Recurrent()
    try:
        to_float64(model)
        logits, spectrum = model(torch.randn(2, 5, 4, dtype=torch.float32))
    finally:
        torch.set_default_dtype(torch.float32)  # the re-run's process keeps it; this test's must not
    assert logits.dtype == torch.float32 and spectrum.dtype == torch.complex64
    assert model.fc.weight.dtype == torch.float64


def test_a_correct_resnet_trained_with_sgd_passes_by_the_float64_rerun():
    """Issue 44's held-out CIFAR ResNets (SGD, lr 0.1, momentum): their float32 rounding grew over 5 steps to ~2e-3
    and FAILed as "rank-dependent code"; the float64 re-run was made for adaptive optimizers only."""
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "5",
                    str(WORKERS / "verify_resnet_sgd.py")], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]
    assert "float rounding grown over the steps (the step-1 gradients" in r.stdout, r.stdout


def test_a_badly_conditioned_correct_batchnorm_passes_and_an_lr_scaled_by_the_world_size_is_named():
    """Review: a gate on the step-1 gradients' gap (1e-2) left this correct script a FAIL ("rank-dependent code",
    its gap 0.13); the float64 re-run is made for every FAIL with no cause found. A learning rate scaled by the
    world size is such a cause: named, with no re-run (it cost one, 57 s instead of 24)."""
    script = str(WORKERS / "verify_offset_bn.py")
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", script], timeout=400))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]
    assert "decided by a float64 re-run" in r.stdout, r.stdout
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", script, "--lr-scaled"],
                timeout=400)
    assert r.returncode != 0 and r.stdout.startswith("FAIL"), r.stdout + r.stderr[-2000:]
    assert "likely cause: the learning rate differs: 0.05 at 1 process, 0.1 at 2 processes" in r.stdout, r.stdout
    assert "float64" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_module_is_verified_as_launch_runs_it(tmp_path):
    """The third held-out run: a Hugging Face project started as ``python -m src.main`` ran under ``ddpkit launch
    -m`` but ``ddpkit verify -m`` was refused (unrecognized arguments)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(
        "import sys\nimport torch\nimport ddpkit\nassert sys.argv[1:] == ['--lr', '0.1'], sys.argv\n"
        "g = torch.Generator().manual_seed(0)\n"
        "data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), "
        "generator=g))\nmodel = ddpkit.prepare_model(torch.nn.Linear(6, 3))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in ddpkit.data_loader(data, batch_size=8):\n"
        "    opt.zero_grad()\n    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", "-m", "pkg.train",
                    "--lr", "0.1"], timeout=300, cwd=str(tmp_path)))
    assert r.stdout.startswith("PASS: 2 processes match 1 process"), r.stdout + r.stderr[-2000:]


def test_each_samples_draws_are_seeded_from_its_index_and_the_scripts_own_streams_stay():
    """verify/samples.py, a review: fetching a sample reseeded the GPUs' generators too (torch.manual_seed), which
    the step's own draws come from; a 0-d tensor index was seeded by its id."""
    import random

    from torch.utils.data import Dataset

    from ddpkit.commands.verify.samples import SampleSeeded

    class Jitter(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return float(torch.rand(())) + random.random()

    seeded = SampleSeeded(Jitter(), 0)
    before = torch.random.default_generator.get_state()
    assert seeded[2] == SampleSeeded(Jitter(), 0)[torch.tensor(2)] != seeded[3]
    assert torch.equal(before, torch.random.default_generator.get_state())  # the script's stream, untouched


def test_a_difference_the_float64_runs_shrink_a_thousandfold_is_rounding_the_training_amplifies():
    """Stand-Alone-Self-Attention at its published lr 0.1 on 20 images (the eleventh held-out set): the float32
    runs ended 0.903 apart, the float64 ones 9.2e-05, and verify said "rank-dependent code" (at lr 0.001 it
    PASSed). A defect parts the float64 runs about as far as the float32 ones (per-rank statistics above)."""
    from ddpkit.commands.verify.rounding import decided

    f32 = {"passed": False, "first_diverging": "init.0.weight", "first_max_abs_diff": 0.903, "optimizers": ["SGD"],
           "gradient_gap": 0.013, "cause": "rank-dependent code"}
    f64 = {"passed": False, "first_diverging": "init.0.weight", "first_max_abs_diff": 9.22e-05, "tensors": 208,
           "max_abs_diff": 9.22e-05, "gradient_gap": 4e-15}
    result = decided(f32, f64)
    assert result["passed"] and result["decided_by"] == "float64", result
    assert "9.8e+03 times closer, their step-1 gradients 4e-15 apart: float rounding that this training amplifies" \
        in result["rounding_note"], result
    # review: a later tensor far apart, step-1 gradients a defect's size apart, or no step-1 gap measured: a FAIL
    for other in ({"max_abs_diff": 0.6}, {"gradient_gap": 1e-4}, {"gradient_gap": None}):
        defect = decided(f32, {**f64, **other})
        assert not defect["passed"] and "not float rounding" in defect["rounding_note"], (other, defect)


def test_a_module_that_fails_is_named_by_its_file_not_by_the_flag(tmp_path):
    """dlwpt's ``-m p2ch11.training``: its failure said "the 2-process run failed at -m"."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("import ddpkit\nddpkit.init()\nraise ValueError('no data here')\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", "-m", "pkg.train"],
                timeout=300, cwd=str(tmp_path))
    assert r.returncode == 1 and "failed at train.py:3 (ValueError: no data here)" in r.stdout + r.stderr, \
        r.stdout + r.stderr[-2000:]


def test_the_rounding_floor_adds_no_tolerance_and_needs_a_repeatable_run():
    """Review: the floor check added the draws check's L2 tolerance, which in float64 passed a rank-0-only L2
    penalty (2.8e-5 apart, a floor of 1.7e-15); and an unseeded ``np.random.default_rng()`` in the step (draws
    verify cannot see) made the floor the noise's, passing per-rank BatchNorm statistics."""
    from ddpkit.commands.verify.perturbed import measure
    one = {"w": torch.zeros(100, dtype=torch.float64)}
    many = {"w": torch.full((100,), 3e-4, dtype=torch.float64)}
    near = {"w": torch.full((100,), 1e-16, dtype=torch.float64)}
    assert measure(one, many, [one, near, near], (1e-5, 1e-4))["worst"][0] == "w"
    assert measure(one, many, [one, {"w": torch.full((100,), 2e-4, dtype=torch.float64)}, near],
                   (1e-5, 1e-4))["worst"] is None
    assert measure(one, many, [near, near, near], (1e-5, 1e-4)).get("unrepeatable")


def test_a_failed_two_process_run_names_the_ranks_likely_cause(tmp_path):
    """Set 23: verify's error for a 2-process run that failed on a tensor sized by the global batch named the line
    and the exception only; the launcher's report, for the same run, gave the likely cause and its fix."""
    (tmp_path / "fixed.py").write_text(
        "import torch\nimport ddpkit\nstate = ddpkit.init(seed=0)\n"
        "model = ddpkit.prepare_model(torch.nn.Linear(3, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ds = torch.utils.data.TensorDataset(torch.randn(32, 3, generator=torch.Generator().manual_seed(0)))\n"
        "target = torch.zeros(8, 1)  # sized by the batch the script was written for\n"
        "for (x,) in ddpkit.data_loader(ds, global_batch_size=8):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), target)\n"
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "2", "fixed.py"],
                timeout=300, cwd=str(tmp_path))
    errors = [line for line in r.stderr.splitlines() if line.startswith("ddpkit verify: error:")]
    assert r.returncode != 0 and len(errors) == 1, r.stdout + r.stderr[-2000:]
    assert "failed at fixed.py:9" in errors[0] and \
        "likely cause: a tensor sized by the global batch (8) met this rank's batch (4" in errors[0], errors[0]


def test_a_project_package_named_like_the_standard_librarys_does_not_break_the_launch(tmp_path):
    """Set 24's LSGAN keeps its tests in a package ``unittest/`` at the project's root: ``python train.py`` and
    ``ddpkit launch`` ran, but verify's N-process run (``python -m ddpkit launch``, the working directory first on
    sys.path) failed in torch's own ``import unittest.mock``."""
    (tmp_path / "unittest").mkdir()
    (tmp_path / "unittest" / "__init__.py").write_text("")
    (tmp_path / "src").mkdir()  # (the script in a folder of its own: beside unittest/, python fit.py breaks too)
    (tmp_path / "src" / "fit.py").write_text(
        "import torch\nimport ddpkit\nstate = ddpkit.init(seed=0)\n"
        "model = ddpkit.prepare_model(torch.nn.Linear(3, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "ds = torch.utils.data.TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0)))\n"
        "for (x,) in ddpkit.data_loader(ds, global_batch_size=4):\n"
        "    loss = model(x).pow(2).mean()\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    # (cold: a warm fork has torch, and so unittest.mock, imported already)
    from ddpkit.commands import itself  # (as the ddpkit command runs: not python -m, which has the same trouble)

    r = run_cmd(itself.command("verify", "--nproc", "2", "--steps", "2", "src/fit.py"),
                timeout=300, cwd=str(tmp_path), env={"DDPKIT_TEST_WARM": "0"})
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr[-2000:]
