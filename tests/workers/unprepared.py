"""A training loop over a ddpkit loader whose model is prepared on one path only (``if use_gpu:``, false on CPU):
``ddpkit launch --nproc-per-node 2 unprepared.py cond`` must stop at the first step on every rank; ``handddp`` wraps
the model in torch's own DDP instead, which trains in sync: it runs."""
import sys

import torch
from torch import nn

import ddpkit

torch.set_num_threads(1)
use_gpu = torch.cuda.is_available()
state = ddpkit.init(seed=0)
model = nn.Linear(4, 1)
if use_gpu:
    model = ddpkit.prepare_model(model)
if sys.argv[1] == "handddp":
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)  # the same data on every rank (init(seed=0) seeds each rank apart)
data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
loader = ddpkit.data_loader(data, batch_size=8)
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained", state.rank)
