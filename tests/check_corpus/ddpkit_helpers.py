# Style: a ddpkit script whose decisions are made on rank 0 only: its collectives would hang the others.
import torch
from torch import nn

import ddpkit

state = ddpkit.init()
model = ddpkit.prepare_model(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
best = float("inf")
for epoch in range(10):
    loss = nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    mean_loss = ddpkit.reduce(loss.item(), "mean")  # every rank: fine
    if state.is_main:
        ddpkit.print("epoch", epoch, mean_loss)  # printing on rank 0 only is what print is for
        tag = ddpkit.broadcast(f"epoch-{epoch}")  # expect: DDP008
        if ddpkit.any_rank(mean_loss > best):  # expect: DDP008
            break
    best = min(best, mean_loss)
    if ddpkit.any_rank(mean_loss > 10.0):  # every rank: fine
        break
