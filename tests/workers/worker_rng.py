"""Worker-side randomness across a SIGKILL + resume, for tests/test_worker_rng.py.

``worker_rng.py OUT [--die-at S]``: 2 loaders over a dataset that augments in ``__getitem__`` (``torch.randn``),
one with 2 loader workers (``persistent_workers=False``), one reading in the training process; 40 samples, 4 per
rank per step: 5 steps an epoch, 2 epochs. On the first attempt, a checkpoint after step S, then the last rank
SIGKILLs itself. Then every rank runs the same from the start with fresh loaders (the uninterrupted run) and
writes OUT/aug-<rank>.json: ``{"resumed": ..., "reference": ...}``, per loader the batches taken, as
``{step: values}``.
"""
import argparse
import json
import os
import signal

import torch
from torch.utils.data import Dataset

import ddpkit

EPOCHS = 2
p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--die-at", type=int, default=-1)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=3)


class Augmented(Dataset):
    def __init__(self):
        self.x = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + torch.randn(4)  # the augmentation: from the worker's RNG (or the process's)


def build():
    return {"workers": ddpkit.data_loader(Augmented(), batch_size=4, seed=1, num_workers=2, persistent_workers=False),
            "in_process": ddpkit.data_loader(Augmented(), batch_size=4, seed=1, num_workers=0)}


def train(loaders, step, die_at=-1):
    seen: dict[str, dict[int, list]] = {name: {} for name in loaders}
    for _epoch in range(loaders["workers"].epoch, EPOCHS):
        for a, b in zip(loaders["workers"], loaders["in_process"]):
            step += 1
            seen["workers"][step], seen["in_process"][step] = a.tolist(), b.tolist()
            if step == die_at:
                ckpt.save(step, **loaders)
                if state.rank == state.world_size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
    return seen


ckpt = ddpkit.Checkpointer(os.path.join(args.out, "ckpt"), keep=2)
loaders = build()
step = ckpt.restore(**loaders)
resumed = train(loaders, step, args.die_at if not os.environ.get("DDPKIT_RESUME") else -1)
torch.manual_seed(3 + state.rank)  # as init(seed=3) left it: the uninterrupted run, from the start
reference = train(build(), 0)
with open(os.path.join(args.out, f"aug-{state.rank}.json"), "w") as f:
    json.dump({"resumed": resumed, "reference": reference}, f)
