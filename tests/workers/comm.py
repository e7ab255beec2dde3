"""Every CommConfig setting on the backend at hand: ``comm.py OUT`` trains the same MLP with each and rank 0
saves, per setting, the final weights, whether all ranks hold identical weights, and the final loss."""
import sys

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

SETTINGS = {"default": None, "tuned": {"bucket_mb": 0.05, "gradient_as_bucket_view": True, "static_graph": True},
            "bf16": {"compression": "bf16"}, "fp16": {"compression": "fp16"}}
state = ddpkit.init()
torch.set_num_threads(1)
results = {}
for name, fields in SETTINGS.items():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    model = ddpkit.prepare_model(net, comm=ddpkit.CommConfig(**fields) if fields else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + state.rank)  # each rank its own batches
    for _ in range(10):
        x = torch.randn(16, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), x[:, :1] * 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(flat) for _ in range(state.world_size)]
    dist.all_gather(copies, flat)
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    results[name] = {"weights": flat, "in_sync": all(torch.equal(c, flat) for c in copies),
                     "loss": loss_sum.item() / state.world_size}
try:
    ddpkit.prepare_model(nn.Linear(4, 4), comm=ddpkit.CommConfig(compression="powersgd"))
    results["powersgd"] = "accepted"
except ValueError as exc:
    results["powersgd"] = str(exc)
if state.is_main:
    torch.save(results, sys.argv[1])
