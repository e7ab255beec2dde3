"""A script of optimizer steps at a fixed global batch, for ``ddpkit verify --nproc 1,2,3``.

``verify_steps.py [--unscaled] [--fail-at N]``: ``--unscaled`` calls ``loss.backward()`` instead of
``step.backward(loss)``, so the sum over a step's micro-batches grows with their count, which differs by world
size (a bug verify must see); ``--fail-at N`` raises at world size N.
"""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=0)
if "--fail-at" in sys.argv and state.world_size == int(sys.argv[sys.argv.index("--fail-at") + 1]):
    raise RuntimeError(f"this script fails at world size {state.world_size}")
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(60, 5, generator=g), torch.randn(60, 1, generator=g))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = ddpkit.data_loader(data, global_batch_size=12, micro_batch_size=2)
for _epoch in range(2):
    for step in loader:
        for x, y in step.micro_batches(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward() if "--unscaled" in sys.argv else step.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
