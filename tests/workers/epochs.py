"""Passes left early and the script's own set_epoch, for tests/test_epochs.py.

``epochs.py OUT order``: every rank writes OUT/order-<rank>.json: the sample ids of passes left after K steps
(``break``), of a pass after an iterator kept unfinished, of passes after ``loader.sampler.set_epoch(e)``, and
``loader.epoch`` after each.

``epochs.py OUT train [--idiom plain|set-epoch] [--die-at S]``: K steps per epoch (``break``), 3 epochs, on 50
samples (7 batches of 4 per epoch per rank). ``plain``: ``for epoch in range(loader.epoch, 3)``, a checkpoint after
each epoch's loop. ``set-epoch``: ``for epoch in range(step // K, 3): loader.sampler.set_epoch(epoch)``, a
checkpoint every 2 steps (so one on each breaking step). SIGKILL at step S on the first attempt; rank 0 writes
OUT/final.pt.
"""
import argparse
import json
import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

K, EPOCHS = 3, 3
p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("what", choices=["order", "train"])
p.add_argument("--idiom", choices=["plain", "set-epoch"], default="plain")
p.add_argument("--die-at", type=int, default=-1)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=3)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(50, 6, generator=g), torch.randn(50, 1, generator=g), torch.arange(50))
loader = ddpkit.data_loader(data, global_batch_size=8, seed=1)


def one_pass(batches, steps=None):
    seen = []
    for i, (_x, _y, ids) in enumerate(batches):
        seen += ids.tolist()
        if steps is not None and i == steps - 1:
            break
    return seen


def order():
    out = {"left_early": [], "epoch_after": [], "set_epoch": [], "epoch_read": []}
    for _epoch in range(loader.epoch, EPOCHS):
        out["left_early"].append(one_pass(loader, K))
        out["epoch_after"].append(loader.epoch)
    held = iter(loader)  # epoch 3: one batch taken, the iterator kept and never finished
    next(held)
    out["after_held"] = one_pass(loader)
    del held  # closing the old pass now must not move the loader
    out["epoch_after_held"] = loader.epoch
    for epoch in (7, 7, 2):  # the DistributedSampler idiom: the script's epoch wins
        loader.sampler.set_epoch(epoch)
        out["epoch_read"].append(loader.epoch)
        out["set_epoch"].append(one_pass(loader))
    out["epoch_after_set"] = loader.epoch
    with open(os.path.join(args.out, f"order-{state.rank}.json"), "w") as f:
        json.dump(out, f)


def train():
    first_attempt = not os.environ.get("DDPKIT_RESUME")
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = ddpkit.Checkpointer(os.path.join(args.out, "ckpt"), keep=2)
    step = ckpt.restore(model=model, optimizer=opt, loader=loader)
    epochs = range(step // K, EPOCHS) if args.idiom == "set-epoch" else range(loader.epoch, EPOCHS)
    for epoch in epochs:
        if args.idiom == "set-epoch":
            loader.sampler.set_epoch(epoch)
        for x, y, _ids in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.idiom == "set-epoch" and step % 2 == 0:
                ckpt.save(step, model=model, optimizer=opt, loader=loader)
            if step == args.die_at and first_attempt and state.rank == state.world_size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step % K == 0:
                break
        if args.idiom == "plain":
            ckpt.save(step, model=model, optimizer=opt, loader=loader)
    weights = model.state_dict()
    if state.is_main:
        torch.save({"weights": weights, "step": step, "epoch": loader.epoch}, os.path.join(args.out, "final.pt"))


order() if args.what == "order" else train()
