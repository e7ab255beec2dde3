"""A step-loader script whose loss is a sum over each micro-batch (``reduction="sum"``): wrong wherever the
per-process micro-batch differs from one process's (at 4 processes: 6 samples, not 8), right by coincidence at 2
and 3 (8 samples each). ``ddpkit verify --nproc 2,3`` passes it and must say that it could not see the sum.
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
ddpkit.init(seed=0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(96, 5, generator=g), torch.randn(96, 1, generator=g))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = ddpkit.data_loader(data, global_batch_size=48, micro_batch_size=8)
for step in loader:
    for x, y in step.micro_batches(model):
        step.backward(nn.functional.mse_loss(model(x), y, reduction="sum"))
    optimizer.step()
    optimizer.zero_grad()
