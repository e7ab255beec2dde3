"""Training on a stream with checkpoints, for the mid-stream resume test.

``stream_resume.py OUT [--die-at S1,S2,..] [--workers K] [--hf DIR]``: a deterministic stream of 90 samples,
shuffled through a buffer, 2 epochs, a checkpoint every 3 steps, SIGKILL of the last rank at step S<i+1> on
attempt i (run it with ``--max-restarts``: each restart resumes from the newest checkpoint); rank 0 appends
"<attempt> <restored step>" to OUT/restored.txt and writes OUT/final.pt. ``--hf DIR``: the same samples from
DIR/*.jsonl through a Hugging Face ``datasets`` stream.
"""
import argparse
import glob
import os
import signal

import torch
from torch import nn
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.core import contract

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--die-at", type=lambda text: [int(s) for s in text.split(",")], default=[])
p.add_argument("--workers", type=int, default=1)
p.add_argument("--hf", default=None)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=3)
attempt = contract.RESTART_COUNT.number(os.environ) or 0
die_at = args.die_at[attempt] if attempt < len(args.die_at) else -1


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(90):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(6, generator=g)
            yield x, x.sum(0, keepdim=True) * 0.5


def hugging_face(directory):
    from datasets import load_dataset

    files = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
    rows = load_dataset("json", data_files=files, split="train", streaming=True)
    return rows.map(lambda row: {"x": row["x"], "y": [sum(row["x"]) * 0.5]}).with_format("torch")


torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
stream = hugging_face(args.hf) if args.hf else Stream()
loader = ddpkit.data_loader(stream, batch_size=4, num_workers=args.workers, seed=1, shuffle_buffer=10)
ckpt = ddpkit.Checkpointer(os.path.join(args.out, "ckpt"), keep=2)
step = ckpt.restore(model=model, optimizer=opt, loader=loader)
if state.is_main:
    with open(os.path.join(args.out, "restored.txt"), "a") as f:
        f.write(f"{attempt} {step}\n")
for _epoch in range(loader.epoch, 2):
    for batch in loader:
        x, y = (batch["x"], batch["y"]) if args.hf else batch
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 3 == 0:
            ckpt.save(step, model=model, optimizer=opt, loader=loader)
        if step == die_at and state.rank == state.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
weights = model.state_dict()
if state.is_main:
    torch.save({"weights": weights, "step": step}, os.path.join(args.out, "final.pt"))
