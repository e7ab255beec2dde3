"""Scripts that broke ``ddpkit verify`` itself (issue 44): ``--batch-sized`` weighs the loss with a tensor sized from
the fixed batch size (verify's one-process run takes N x that batch, so it fails there); ``--save-whole`` ends with
``torch.save`` of the whole model (verify's own hook made the module unpicklable). Writes nothing else."""
import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init()
batch_size = 8
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 5, generator=g), torch.randn(64, 1, generator=g))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
weights = torch.ones(batch_size, 1)
for x, y in ddpkit.data_loader(data, batch_size=batch_size):
    error = (model(x) - y) ** 2
    loss = (error * weights).mean() if "--batch-sized" in sys.argv else error.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
if "--save-whole" in sys.argv and state.is_main:
    torch.save(ddpkit.unwrap(model), os.path.join(tempfile.mkdtemp(), "model.pt"))
