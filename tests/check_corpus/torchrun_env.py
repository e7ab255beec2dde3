# Style: torchrun with environment variables, mostly right, a few classic slips.
import io
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank = dist.get_rank()

model = nn.Linear(10, 1).to(local_rank)
model = DistributedDataParallel(model, device_ids=[local_rank])
data = TensorDataset(torch.randn(1000, 10), torch.randn(1000, 1))
sampler = DistributedSampler(data, shuffle=True)
loader = DataLoader(data, batch_size=32, sampler=sampler)
state = torch.load("init.pt")  # expect: DDP010
model.module.load_state_dict(state)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
    snapshot = io.BytesIO()
    torch.save(model.module.state_dict(), snapshot)  # into memory on every rank: not a file race
    torch.save(opt.state_dict(), io.BytesIO())  # the same, inline
    if rank == 0:
        torch.save(model.module.state_dict(), "model.pt")
        dist.barrier()  # expect: DDP008
    stats = torch.zeros(1, device="cuda:0")  # expect: DDP004
    dist.all_reduce(stats)
dist.destroy_process_group()
