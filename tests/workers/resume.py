"""Training with checkpoints, for the fault tests.

``resume.py OUT [--save-every K] [--die-at S] [--die-how exc|kill] [--stop-at S] [--epochs E] [--samples N]
[--global-batch B]``
Trains (dropout, python and numpy randomness, 2 epochs of an uneven dataset), saves every K steps into
OUT/ckpt, dies at step S on the first attempt only, and writes OUT/final.pt (rank 0) at the end.
"""
import argparse
import os
import random
import signal

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--save-every", type=int, default=3)
p.add_argument("--die-at", type=int, default=-1)
p.add_argument("--die-how", default="exc")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--stop-at", type=int, default=-1, help="exit cleanly (every rank) after this step")
p.add_argument("--samples", type=int, default=50)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--plain", action="store_true", help="no dropout, no noise: comparable across world sizes")
p.add_argument("--rank1-file-limit", type=int, default=0, help="rank 1 cannot write files past this many bytes")
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=3)
if args.rank1_file_limit and state.rank == 1:  # a real write failure (EFBIG), as a full disk gives ENOSPC
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.rank1_file_limit, args.rank1_file_limit))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not os.environ.get("DDPKIT_RESUME")
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(args.samples, 6, generator=g), torch.randn(args.samples, 1, generator=g))
torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.0 if args.plain else 0.2), nn.ReLU(),
                                           nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
loader = ddpkit.data_loader(data, global_batch_size=args.global_batch, seed=1)
ckpt = ddpkit.Checkpointer(os.path.join(args.out, "ckpt"), keep=2)
step = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=loader)
for _epoch in range(loader.epoch, args.epochs):
    for x, y in loader:
        noise = 0.0 if args.plain else random.random() * 0.01 + float(np.random.rand()) * 0.01  # python, numpy
        loss = nn.functional.mse_loss(model(x + noise), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % args.save_every == 0:
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, loader=loader)
        if step == args.die_at and first_attempt and state.rank == state.world_size - 1:
            if args.die_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"planned failure at step {step}")
        if step == args.stop_at:
            raise SystemExit(0)
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)
weights = model.state_dict()  # on every rank: in fsdp mode it gathers the shards
optimizer = None if state.mode == "fsdp" else opt.state_dict()  # fsdp's is sharded (DTensor)
if state.is_main:
    torch.save({"weights": weights, "optimizer": optimizer, "step": step}, os.path.join(args.out, "final.pt"))
