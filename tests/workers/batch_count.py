"""A plain loop over a token-mean loss (labels -100 on prompts and on a tail whose length differs by sample),
``batch_count=`` or not: ``batch_count.py OUT counted|plain|rewrap|bn`` saves the weights as ``OUT/w{world}_{case}.pt``
(bn: a BatchNorm between the embedding and the head, synchronised at N processes).
The model is built the way a script builds it: seeded once before ``init()``, nothing reseeded after."""
import sys

import torch
from torch import nn

import ddpkit

torch.manual_seed(0)
state = ddpkit.init()
g = torch.Generator().manual_seed(1)
ids = torch.randint(1, 50, (48, 10), generator=g)
labels = ids.roll(-1, dims=1)
labels[:, :2] = -100
for i in range(48):
    labels[i, 3 + i % 7:] = -100
data = [{"input_ids": a, "labels": b} for a, b in zip(ids, labels)]
case = sys.argv[2]


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(50, 16), nn.BatchNorm1d(16), nn.Linear(16, 50)

    def forward(self, x):
        return self.head(self.norm(self.emb(x).transpose(1, 2)).transpose(1, 2))


model = ddpkit.prepare_model(Normed() if case == "bn" else nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50)))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
loader = ddpkit.data_loader(data, global_batch_size=12, shuffle=True,
                            batch_count=(lambda b: (b["labels"] != -100).sum()) if case != "plain" else None)
for epoch in range(2):
    if case == "rewrap" and epoch == 1:  # prepared again (a second stage): its parameters weighed once, not twice
        model = ddpkit.prepare_model(ddpkit.unwrap(model))
    for batch in loader:
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for batch in ddpkit.data_loader(data, batch_size=8, train=False):  # an evaluation in between: not weighed
        model(batch["input_ids"])
if state.is_main:
    torch.save(ddpkit.unwrap(model).state_dict(), f"{sys.argv[1]}/w{state.world_size}_{case}.pt")
