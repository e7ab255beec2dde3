# Style: raw FSDP2 (fully_shard) by hand, with the two sharding mistakes: an optimizer built before sharding,
# and a state dict taken on rank 0 only.
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
early = torch.optim.AdamW(model.parameters(), lr=1e-3)  # expect: DDP014
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after sharding: fine
for step in range(10):
    loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
    loss.backward()
    opt.step()
    opt.zero_grad()
full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank: fine
if rank == 0:
    torch.save(full, "model.pt")
    torch.save(model.state_dict(), "shard0.pt")  # expect: DDP015
dist.destroy_process_group()
