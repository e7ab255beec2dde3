"""A script of optimizer steps at a fixed global batch, for ``ddpkit verify --nproc 1,2,3``.

``verify_steps.py [--unscaled]``: ``--unscaled`` calls ``loss.backward()`` instead of ``step.backward(loss)``, so
the sum over a step's micro-batches grows with their count, which differs by world size (a bug verify must see).
"""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
ddpkit.init(seed=0)
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
