"""A model none of whose parameters trains (a BYOL target network, a frozen teacher), prepared in ddp: torch's DDP
refuses it, so ddpkit leaves it unwrapped, with rank 0's weights on every rank and its BatchNorm over the global
batch. Real 2-process launches: the targets a train-mode forward gives equal one process's on the whole batch."""
from conftest import launch, ok

FROZEN = """
import copy, torch, torch.distributed as dist, ddpkit
from torch import nn
state = ddpkit.init()
torch.manual_seed(state.rank)  # a per-rank draw: each rank builds other weights until prepare_model
net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).requires_grad_(False)
truth = copy.deepcopy(net)  # rank 0's is what every rank must hold
net = ddpkit.prepare_model(net)
assert not isinstance(net, nn.parallel.DistributedDataParallel)
torch.manual_seed(100)
x = torch.randn(8, 4)
with torch.no_grad():  # a target's forward: train mode (batch statistics), no gradients
    out = net(x[state.rank * 4:(state.rank + 1) * 4].to(state.device))
outs = [torch.empty_like(out) for _ in range(2)]
dist.all_gather(outs, out)
if state.rank == 0:
    with torch.no_grad():
        want = truth(x)
    print("outputs", (torch.cat(outs) - want).abs().max().item())
    print("running", (net[1].running_mean - truth[1].running_mean).abs().max().item())
ddpkit.shutdown()
"""


def test_a_frozen_batchnorm_model_runs_as_one_process_on_the_whole_batch(tmp_path):
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN)
    res = ok(launch(script))
    found = dict(line.split() for line in res.stdout.splitlines() if line.startswith(("outputs", "running")))
    assert float(found["outputs"]) < 1e-5 and float(found["running"]) < 1e-6, res.stdout
    assert "Sequential trains no parameter (none requires grad): not wrapped in DDP" in res.stderr, res.stderr


TARGET = """
import sys, torch, ddpkit
from torch import nn
state = ddpkit.init()
torch.manual_seed(0)
def net():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
online = ddpkit.prepare_model(net())
with torch.device("meta"):
    spare = net()  # a BatchNorm model on the meta device, kept alive (built to count parameters): never ran
target = net()
if sys.argv[1] == "prepared":  # (its BatchNorm left plain on purpose: prepared all the same)
    target = ddpkit.prepare_model(target.requires_grad_(False), sync_batchnorm=False)
opt = torch.optim.SGD(online.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(8, 4)
    with torch.no_grad():
        t = target(x)  # train mode: batch statistics
    loss = (online(x) - t).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
ddpkit.shutdown()
"""


def test_a_target_networks_batchnorm_left_outside_any_prepared_model_is_said_at_the_first_step(tmp_path):
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    said = "ddpkit: 1 BatchNorm layer(s) outside any prepared model ran in train mode before the first optimizer"
    plain = ok(launch(script, "plain")).stderr
    assert plain.count(said) == 1 and "target = ddpkit.prepare_model(target.requires_grad_(False))" in plain, plain
    assert said not in ok(launch(script, "prepared")).stderr
