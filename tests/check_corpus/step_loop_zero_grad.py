# Style: a fine-tuning loop moved onto ddpkit's step loader with the per-batch habit kept: zero_grad() at the top of
# each micro-batch erases the micro-batches before it (the one beside optimizer.step() is right).
import torch
from torch import nn

import ddpkit

ddpkit.init()
model = ddpkit.prepare_model(nn.Linear(8, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
train_set = [(torch.randn(8), torch.tensor(0)) for _ in range(64)]
loader = ddpkit.data_loader(train_set, global_batch_size=16, micro_batch_size=4)
for step in loader:
    for x, y in step.micro_batches(model):
        optimizer.zero_grad()  # expect: DDP020
        step.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
for step in loader:
    for i, (x, y) in enumerate(step.micro_batches(model)):
        optimizer.zero_grad()  # expect: DDP020
        step.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
for step in loader:  # right: the step and its zero_grad beside it, on the last micro-batch only
    for x, y in step.micro_batches(model):
        step.backward(nn.functional.cross_entropy(model(x), y))
        if step.sync:
            optimizer.step()
            optimizer.zero_grad()
