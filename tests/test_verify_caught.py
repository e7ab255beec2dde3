"""A script that catches verify's stop at the step cap (a ``SystemExit``): training inside a ``unittest.TestCase``
(set 27's VAE tests), whose runner reports the stop as a test error and exits 1."""
import sys

from conftest import ok, run_cmd

VERIFY = [sys.executable, "-m", "ddpkit", "verify"]
UNIT = '''import unittest
import torch
import ddpkit


class TestTrain(unittest.TestCase):
    def test_train(self):
        torch.manual_seed(0)
        ds = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        loader = ddpkit.data_loader(ds, global_batch_size=64, shuffle=True)
        model = ddpkit.prepare_model(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for epoch in range(2):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()


if __name__ == "__main__":
    unittest.main()
'''


def test_a_step_cap_caught_by_a_unittest_runner_still_compares(tmp_path):
    """verify said "the one-process run failed ... (FAILED (errors=1))" for a correct script: unittest had caught
    its stop at the cap. A run that reached the cap and wrote its weights is compared, and the catch said."""
    script = tmp_path / "tests.py"
    script.write_text(UNIT)
    r = ok(run_cmd(VERIFY + ["--steps", "2", str(script)], timeout=240))
    assert r.stdout.startswith("PASS") and "caught verify's stop" in r.stdout + r.stderr, r.stdout + r.stderr


UNSEEDED = '''import torch
import ddpkit

state = ddpkit.init(cpu=True)
g = torch.Generator().manual_seed(0)
loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g)), global_batch_size=16)
gen = ddpkit.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)))
opt = torch.optim.Adam(gen.parameters(), lr=1e-2)
fixed_noise = torch.randn(10, 4)  # unseeded, each run its own
for (x,) in loader:
    loss = ((gen(x[:, :4] * 0.5) - x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    fake = gen(fixed_noise)  # a picture in train mode: BatchNorm's statistics move with the noise
'''


def test_a_fail_against_a_one_process_run_that_does_not_repeat_itself_cannot_compare(tmp_path):
    """Set 27's cGAN: a sample picture of unseeded fixed noise drawn in train mode moves BatchNorm's statistics
    differently in every run; verify saw the one-process run, run again unchanged, end elsewhere and still said
    FAIL naming rank-dependent code. It cannot compare such runs, and says why."""
    script = tmp_path / "cgan.py"
    script.write_text(UNSEEDED)
    r = run_cmd(VERIFY + ["--steps", "2", str(script)], timeout=400)
    assert r.returncode == 5 and "did not end where it did" in r.stderr, r.stdout + r.stderr[-3000:]


PER_RANK_BN = '''import numpy as np
import torch
import ddpkit

state = ddpkit.init(cpu=True)
torch.manual_seed(0)
loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randn(128, 1)),
                            global_batch_size=32, shuffle=True)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = ddpkit.prepare_model(net, sync_batchnorm=False)  # each rank's own statistics: a real difference
opt = torch.optim.SGD(model.parameters(), lr=0.1)
rng = np.random.default_rng()  # unseeded, verify cannot see it
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    model(torch.from_numpy(1e-6 * rng.standard_normal((4, 8))).float())  # moves the statistics by a hair
'''


def test_a_true_fail_beside_a_hair_of_unrepeatable_drift_stays_a_fail(tmp_path):
    """Review 43's D07: per-rank BatchNorm statistics (a true FAIL) beside an unseeded draw that moves a running
    statistic by 1e-9 became "cannot compare": the one-process control's drift is weighed against the gap now."""
    script = tmp_path / "bn.py"
    script.write_text(PER_RANK_BN)
    r = run_cmd(VERIFY + ["--steps", "3", str(script)], timeout=400)
    assert r.returncode == 4 and r.stdout.startswith("FAIL"), r.stdout + r.stderr[-3000:]
