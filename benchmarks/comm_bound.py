"""A communication-bound ddpkit script for ``ddpkit bench``: ~33 MB of fp32 gradients, a tiny batch.

On 2 CPU processes over gloo most of its step is the gradient all-reduce, so DDP's communication settings
change its step time (``gradient_as_bucket_view`` by ~1.2x here); make bench's "advice" part checks that
``ddpkit bench`` finds that setting. ``ddpkit bench --nproc 2 benchmarks/comm_bound.py``
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
torch.manual_seed(0)
ddpkit.init()
width = 2048
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                           nn.Linear(width, 10)))
data = TensorDataset(torch.randn(2048, width), torch.randint(0, 10, (2048,)))
loader = ddpkit.data_loader(data, batch_size=8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _epoch in range(10):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
ddpkit.shutdown()
