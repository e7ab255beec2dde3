"""Raw, unnormalised features (values near 3000: years, prices) into Linear -> BatchNorm, trained with SGD: a
correct script whose float32 rounding cancels badly in the batch mean, so the step-1 gradients of one process
and of 2 start 0.13 apart (relative), more than per-rank BatchNorm statistics part them in a ResNet (0.064). In
float64 the runs agree to ~1e-8.

``verify_offset_bn.py [--lr-scaled]``: ``--lr-scaled`` multiplies the learning rate by the world size (a defect
verify must name, without a float64 re-run).
"""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 5, generator=g) + 3000.0, torch.randn(64, 1, generator=g))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)))
lr = 0.05 * (state.world_size if "--lr-scaled" in sys.argv else 1)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for x, y in ddpkit.data_loader(data, batch_size=16):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
