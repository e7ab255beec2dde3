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
