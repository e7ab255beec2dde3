"""Training datasets built on every rank, the ways scripts build them.

``same_data.py CASE``: ``unseeded`` draws its samples at random with no seed; ``split`` splits a seeded dataset
with an unseeded ``random_split``; ``init_seed`` draws them after ``ddpkit.init(seed=0)`` (its streams differ per
rank); ``seeded`` seeds torch first and ``seeded_split`` gives the split a generator: both train, the same on
every rank; ``concat`` joins two seeded parts.
"""
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, TensorDataset, random_split

import ddpkit

case = sys.argv[1]
torch.set_num_threads(1)
ddpkit.init(seed=0 if case == "init_seed" else None)
if case == "seeded":
    torch.manual_seed(0)
if case in ("unseeded", "init_seed", "seeded"):  # drawn from torch's global generator
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
else:  # the same on every rank: its own generator (as a dataset read from files is)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
if case == "split":  # torch's global generator: seeded differently in each process
    data, _ = random_split(data, [48, 16])
elif case == "seeded_split":
    data, _ = random_split(data, [48, 16], generator=torch.Generator().manual_seed(1))
elif case == "concat":
    data = ConcatDataset([data, data])
model = ddpkit.prepare_model(torch.nn.Linear(6, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in ddpkit.data_loader(data, batch_size=8):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
print("trained")
