# Style: a hand-written DDP script over a stream of log files, fed to a plain DataLoader.
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


class LogLines(IterableDataset):
    def __init__(self, paths):
        self.paths = paths

    def __iter__(self):
        for path in self.paths:
            with open(path) as f:
                for line in f:
                    yield torch.tensor([float(x) for x in line.split(",")])


class ShardedLines(LogLines):
    """Splits by rank itself: fine."""

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        for i, row in enumerate(super().__iter__()):
            if i % world == rank:
                yield row


dist.init_process_group("gloo")
model = DDP(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stream = LogLines(sorted(os.listdir("logs")))
loader = DataLoader(stream, batch_size=32)  # expect: DDP016
split = DataLoader(ShardedLines(sorted(os.listdir("logs"))), batch_size=32)
for batch in loader:
    loss = model(batch[:, :4]).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
