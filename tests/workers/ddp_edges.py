"""Worker for DDP's edges: ``ddpkit launch --nproc-per-node 2 ddp_edges.py OUT``; each rank writes OUT/rank<R>.json.

- static_graph: ``CommConfig(static_graph=True)`` with a head unused by design trains (torch's DDP supports it).
- check_sync_every=1 with uneven ``train=False`` evaluation loaders (in eval mode and under no_grad) and an
  uneven ``ddpkit.join`` loop, and one under torch's own ``Join([model])`` (which asks for ``join_hook()``,
  not ``model.join()``), complete; a real desync in a training step after them is still caught.
The collective timeout is 30 s, so a hang fails the test fast instead of holding it.
"""
import json
import os
import sys

import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=0, timeout_s=30)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(10, 4, generator=g), torch.randn(10, 1, generator=g))
five = TensorDataset(data.tensors[0][:5], data.tensors[1][:5])  # batch 1 on 2 ranks: 3 batches on rank 0, 2 on 1


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x):
        return self.used(torch.relu(self.body(x)))  # self.unused never runs: by design


def train(model, loader):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps


def evaluate(model, loader):
    with torch.no_grad():
        return sum(1 for x, _ in loader if model(x) is not None)


results = {}
torch.manual_seed(0)
model = ddpkit.prepare_model(TwoHeads(), comm=ddpkit.CommConfig(static_graph=True))
results["static_graph_steps"] = train(model, ddpkit.data_loader(data, 2))

torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), check_sync_every=1)
model.eval()
results["eval_batches"] = evaluate(model, ddpkit.data_loader(five, 1, train=False))
model.train()  # forgot model.eval(): no_grad alone still makes it an evaluation forward
results["no_grad_batches"] = evaluate(model, ddpkit.data_loader(five, 1, train=False))
results["train_steps"] = train(model, ddpkit.data_loader(data, 2))
with ddpkit.join(model):
    results["join_steps"] = train(model, ddpkit.data_loader(five, 1, uneven="join"))
uneven = [(x[None], y[None]) for x, y in five][state.rank::2]  # 3 batches on rank 0, 2 on rank 1
with Join([model]):
    results["torch_join_steps"] = train(model, uneven)
results["after_join_steps"] = train(model, ddpkit.data_loader(data, 2))
results["weights"] = [float(p.detach().double().sum()) for p in model.parameters()]
kept = next(model.parameters()).detach().clone()
if state.rank == 1:  # a real desync: the next training step's check must still see it
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
try:
    train(model, ddpkit.data_loader(data, 2))
    results["desync"] = None
except RuntimeError as exc:
    results["desync"] = str(exc)
with torch.no_grad():  # caught before any step trained on it: put back, or the check at the job's end says it
    next(model.parameters()).copy_(kept)
with open(os.path.join(sys.argv[1], f"rank{state.rank}.json"), "w") as f:
    json.dump(results, f)
