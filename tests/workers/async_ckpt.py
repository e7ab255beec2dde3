"""Worker for the background-checkpoint tests (``Checkpointer(..., async_save=True)``).

``[ddpkit launch [--mode fsdp] ...] async_ckpt.py OUT ACTION``:
- ``train``: saves steps 1-3, each followed at once by a training step (the write goes on meanwhile); the last
  save is still being written when the script ends. Rank 0 writes OUT/snaps.pt: the weights each save was asked for.
- ``fail``: the background write of step 2 fails on one rank (ddp: rank 0's file-size limit; fsdp: rank 1's
  shard); the save of step 3 raises it on every rank; a save after that works; step 4's write fails again and
  the script ends: every rank says so at exit. Each rank writes OUT/rank<R>.json.
- ``kill``: saves step 1 (finished), then step 2, whose write is slow; prints ``WRITING`` and waits to be killed.
- ``latest``: with ``keep=1``, every rank lists the checkpoints while step 2 is being written; OUT/latest<R>.json.
- ``exit``: rank 1 leaves with ``sys.exit(3)`` while step 2 is being written; rank 0 trains on.
- ``resume``: restores the newest valid checkpoint; writes OUT/resumed.pt.
"""
import json
import os
import resource
import signal
import sys
import time

import torch
from async_ckpt_slow import SlowState
from torch import nn

import ddpkit

out, action = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
state = ddpkit.init(seed=0, timeout_s=60)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of a signal
directory = os.path.join(out, "ckpt")
LIMIT = 16384  # bytes: a full disk for a checkpoint's files (~40 KB; a shard ~20 KB), not for the logs (~2 KB)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 4)), shard=[nn.Linear])
opt = torch.optim.Adam(model.parameters(), lr=0.01)


def train_step():
    loss = model(torch.randn(6, 8).to(state.device)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot():  # collective in fsdp: every rank calls it
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def listing():
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


def limit_files(rank, limit):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if state.rank == rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return soft, hard


if action == "train":
    ckpt = ddpkit.Checkpointer(directory, async_save=True, keep=10)
    snaps, metrics = {}, {}
    for step in (1, 2, 3):
        train_step()
        snaps[step] = snapshot()
        metrics["step"] = step  # one dict the script keeps updating: each manifest keeps the value of its save
        returned = ckpt.save(step, model=model, optimizer=opt, extra=metrics, slow=SlowState(1.0 if step == 2 else 0))
        assert (returned is not None) == state.is_main
        metrics["step"] = f"after {step}"
        if step == 2:  # a second Checkpointer of the directory while step 2 is being written (an evaluation helper)
            ddpkit.Checkpointer(directory, resume=True)
    train_step()  # changes every weight while step 3 is being written
    if state.is_main:
        torch.save(snaps, os.path.join(out, "snaps.pt"))
elif action == "fail":
    ckpt = ddpkit.Checkpointer(directory, async_save=True, keep=10)
    failing = 1 if state.mode == "fsdp" else 0
    results = {}
    train_step()
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.wait()
    train_step()
    limits = limit_files(failing, LIMIT)
    ckpt.save(2, model=model, optimizer=opt)  # returns: the write fails behind it
    train_step()
    try:
        ckpt.save(3, model=model, optimizer=opt)
        results["error"] = None
    except OSError as exc:
        results["error"] = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    results["after_failure"] = listing()
    ckpt.save(3, model=model, optimizer=opt)
    results["waited"] = os.path.basename(ckpt.wait() or "")
    results["after_save"] = listing()
    with open(os.path.join(out, f"rank{state.rank}.json"), "w") as f:
        json.dump(results, f)
    train_step()
    limit_files(failing, LIMIT)
    ckpt.save(4, model=model, optimizer=opt)  # fails in the background; the script ends before any wait()
elif action == "kill":
    ckpt = ddpkit.Checkpointer(directory, async_save=True)
    train_step()
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.wait()
    torch.save({"weights": snapshot(), "optimizer": opt.state_dict()}, os.path.join(out, "step1.pt"))
    train_step()
    ckpt.save(2, model=model, optimizer=opt, slow=SlowState())
    print("WRITING", flush=True)
    time.sleep(120)
elif action == "latest":
    ckpt = ddpkit.Checkpointer(directory, async_save=True, keep=1)
    train_step()
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.wait()
    ckpt.save(2, model=model, optimizer=opt, slow=SlowState(1.5))  # the commit of 2 removes 1 (keep=1)
    named = {"checkpoints": [os.path.basename(p) for p in ckpt.checkpoints()],
             "latest": os.path.basename(ckpt.latest() or "")}
    named["restored"] = ckpt.restore(ckpt.latest(), model=model, optimizer=opt)
    with open(os.path.join(out, f"latest{state.rank}.json"), "w") as f:
        json.dump(named, f)
elif action == "exit":
    ckpt = ddpkit.Checkpointer(directory, async_save=True)
    train_step()
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.wait()
    train_step()
    ckpt.save(2, model=model, optimizer=opt, slow=SlowState(2.0))
    if state.rank == 1:
        sys.exit(3)  # leaves alone while step 2 is being written
    for _ in range(20):
        train_step()  # rank 0 goes on: its next collective finds rank 1 gone
else:
    ckpt = ddpkit.Checkpointer(directory, async_save=True, resume=True)
    step = ckpt.restore(model=model, optimizer=opt)
    torch.save({"step": step, "weights": snapshot(), "optimizer": opt.state_dict(), "listing": listing()},
               os.path.join(out, "resumed.pt"))
