"""Worker for tests/test_global_batch.py: steps of ``global_batch_size=16`` checkpointed after every step; killed
(``os._exit``) halfway through the step after ``CRASH`` when CRASH >= 0; resumed by ``ddpkit launch --resume``,
at any world size.

``global_batch_resume.py OUT CRASH [SLEEP]``: SLEEP seconds after each step (time for a test to kill a node);
rank 0 appends one JSON line per finished step to OUT/steps.jsonl
(epoch, step index, the ids of its samples over all ranks, the world size) and writes OUT/final.pt at the end.
"""
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

out, crash = sys.argv[1], int(sys.argv[2])
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(98, 6, generator=g), torch.randint(0, 3, (98,), generator=g), torch.arange(98))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = ddpkit.data_loader(data, global_batch_size=16, micro_batch_size=4, seed=3)
checkpoints = ddpkit.Checkpointer(os.path.join(out, "ckpt"), keep=2)
done = checkpoints.restore(model=model, optimizer=optimizer, loader=loader)
for epoch in range(loader.epoch, 2):
    for step in loader:
        used = []
        for j, (x, y, ids) in enumerate(step.micro_batches(model)):
            if crash >= 0 and done == crash and j == step.micro_steps // 2:
                os._exit(1)  # killed in the middle of a step: its half-accumulated gradients are lost
            step.backward(nn.functional.cross_entropy(model(x), y))
            used += ids.tolist() if step.scale > 0 else []
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        checkpoints.save(done, model=model, optimizer=optimizer, loader=loader)
        time.sleep(pause)
        ids = sorted(sum(ddpkit.gather_object(used), []))
        if state.is_main:
            with open(os.path.join(out, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "index": step.index, "ids": ids,
                                    "world_size": state.world_size, "micro_steps": step.micro_steps}) + "\n")
if state.is_main:
    torch.save({k: v.detach().cpu().clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
               os.path.join(out, "final.pt"))
