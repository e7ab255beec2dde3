"""A script that builds its model inside ``ddpkit.init_empty()`` and never seeds, for ``ddpkit verify``.

Every process of every run draws its own initial weights (and its own dropout masks), so verify passes only if
it captures the model after ``prepare_model`` has materialised it (in fsdp: one shard per rank), hands the
one-process run's initial weights to the N-process run, turns dropout off and saves the final weights.

    ddpkit verify --mode fsdp tests/workers/verify_empty.py
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
ddpkit.init()  # no seed: the runs start from different weights unless verify aligns them
g = torch.Generator().manual_seed(0)  # the data is the same in both runs, as a script's dataset file would be
data = TensorDataset(torch.randn(64, 5, generator=g) * 2 + 1, torch.randn(64, 1, generator=g))
with ddpkit.init_empty():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1))
model = ddpkit.prepare_model(model, shard=[nn.Linear])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    for x, y in ddpkit.data_loader(data, batch_size=8):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
