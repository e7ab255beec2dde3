# Style: ddpkit in hybrid sharding (mode hsdp, shard inside a node): the state dict taken on rank 0 only.
import torch
from torch import nn

import ddpkit

state = ddpkit.init(mode="hsdp")
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1)), shard_size=2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for x, y in ddpkit.data_loader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), 4):
    loss = nn.functional.mse_loss(model(x.to(state.device)), y.to(state.device))
    loss.backward()
    opt.step()
    opt.zero_grad()
if state.is_main:
    torch.save(model.state_dict(), "model.pt")  # expect: DDP015
