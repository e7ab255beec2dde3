"""A model prepared for N processes, trained from a plain torch DataLoader: ``unsharded.py plain`` (every rank
reads every batch: rank 0 says so at the first step), ``unsharded.py own`` (sharded by the script's own
DistributedSampler: nothing said)."""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init()
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
model = ddpkit.prepare_model(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = DistributedSampler(data, num_replicas=state.world_size, rank=state.rank) if sys.argv[1] == "own" else None
for x, y in DataLoader(data, batch_size=8, sampler=sampler):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
print("trained")
