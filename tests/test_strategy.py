"""The strategy seam: a new mode is one entry. This file registers a test-only mode from outside ddpkit, through
the `ddpkit.strategies` entry point group, and runs it with `ddpkit launch --mode` touching no other module."""
import sys

import pytest
import torch

from conftest import ok, run_cmd
from ddpkit import strategy
from ddpkit.core.environment import LaunchEnvError, ProcessEnv
from ddpkit.runtime.group import choose_mode

# A mode that is DDP without DistributedDataParallel: each gradient is all-reduced and averaged by a hook.
FAKE_MODE = '''
import contextlib
import torch.distributed as dist
from ddpkit.strategy import Distributed


class HandAveraged(Distributed):
    name = "hand-avg"
    title = "hand-averaged gradients (test-only)"

    def wrap(self, model, state, **options):
        def average(param):
            dist.all_reduce(param.grad)
            param.grad /= state.world_size

        for param in model.parameters():
            dist.broadcast(param.data, 0)  # every rank starts from rank 0's weights, as DDP does
            param.register_post_accumulate_grad_hook(average)
        model.hand_averaged = True
        return model

    def no_sync(self, model):
        return contextlib.nullcontext()
'''

TRAIN = '''
import sys, torch, ddpkit
from torch.utils.data import TensorDataset
state = ddpkit.init(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
model = ddpkit.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in ddpkit.data_loader(data, batch_size=8):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
if state.is_main:
    print("MODE", state.mode, getattr(model, "hand_averaged", False))
    torch.save(ddpkit.unwrap(model).state_dict(), sys.argv[1])
'''


@pytest.fixture()
def plugin(tmp_path):
    """A package on PYTHONPATH that declares the mode as an entry point, as a real plugin would."""
    (tmp_path / "fake_mode.py").write_text(FAKE_MODE)
    info = tmp_path / "fake_mode-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-mode\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ddpkit.strategies]\nhand-avg = fake_mode:HandAveraged\n")
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def test_a_new_mode_is_one_entry_and_runs_through_ddpkit_launch(plugin):
    results = {}
    for mode in ("hand-avg", "ddp"):
        out = plugin / f"{mode}.pt"
        r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--mode", mode, "--nproc-per-node", "2",
                        "--log-dir", str(plugin / "logs"), str(plugin / "train.py"), str(out)],
                       env={"PYTHONPATH": str(plugin)}, timeout=120))
        assert f"MODE {mode} {mode == 'hand-avg'}" in r.stdout, r.stderr[-2000:]
        results[mode] = torch.load(out)
    for name, weight in results["ddp"].items():  # the same training as torch's DDP
        assert torch.allclose(weight, results["hand-avg"][name], atol=1e-6), name


def test_the_table_answers_mode_questions():
    two = ProcessEnv("torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)
    assert [s.multi_process for s in map(strategy.get, ("single", "dp", "ddp"))] == [False, False, True]
    assert choose_mode("auto", two, 0) == ("ddp", "2 processes started by torchrun: DistributedDataParallel")
    with pytest.raises(LaunchEnvError, match="mode 'dp' runs one process, but 2 processes"):
        choose_mode("dp", two, 4)
    with pytest.raises(ValueError, match="'nope' is not one of auto, ddp, dp, fsdp, hsdp, single"):
        strategy.get("nope")
    with pytest.raises(ValueError, match="other than 'auto'"):
        strategy.register(type("Auto", (strategy.Strategy,), {"name": "auto"})())


def test_the_banner_names_ddpkit_when_ddpkit_started_the_processes():
    """Issue 26.6: spawn's (and launch's) banner said "started by torchrun"."""
    from ddpkit.core.environment import ProcessEnv
    from ddpkit.runtime.group import choose_mode

    two = ProcessEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, source="torchrun")
    assert choose_mode("auto", two, 0, launcher="ddpkit")[1] == "2 processes started by ddpkit: DistributedDataParallel"
