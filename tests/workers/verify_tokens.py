"""An SFT-style script for ``ddpkit verify --nproc 1,2,3,4``: a small causal LM, labels -100 on the prompt and the
padding, answers of different lengths, a global batch of 12 in micro-batches of at most 2.

``verify_tokens.py [--uncounted]``: ``--uncounted`` builds the loader without ``count=``, so each micro-batch's
token mean weighs as its samples do (a loss that changes with the world size: verify must FAIL and say why).
"""
import sys

import torch
from torch import nn

import ddpkit

torch.set_num_threads(1)
ddpkit.init(seed=0)
g = torch.Generator().manual_seed(2)
ids = torch.randint(1, 30, (48, 8), generator=g)
labels = ids.roll(-1, dims=1)
labels[:, :2] = -100
for i in range(48):
    labels[i, 2 + int(torch.randint(0, 6, (), generator=g)):] = -100
data = [{"input_ids": a, "labels": b} for a, b in zip(ids, labels)]
model = ddpkit.prepare_model(nn.Sequential(nn.Embedding(30, 12), nn.Tanh(), nn.Linear(12, 30)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
count = None if "--uncounted" in sys.argv else (lambda batch: (batch["labels"] != -100).sum())
loader = ddpkit.data_loader(data, global_batch_size=12, micro_batch_size=2, count=count)
for step in loader:
    for batch in step.micro_batches(model):
        logits = model(batch["input_ids"])
        step.backward(nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100))
    optimizer.step()
    optimizer.zero_grad()
