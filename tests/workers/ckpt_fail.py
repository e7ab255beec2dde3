"""Checkpoint writes that fail on one rank: ``ddpkit launch [--mode fsdp] --nproc-per-node 2 ckpt_fail.py OUT``.

Saves step 1; step 2 fails on rank 0 (its file-size limit stops the manifest: a full disk on rank 0's node);
step 3 fails on rank 1 (in fsdp its shard write stops at the file-size limit; in ddp an object's state_dict
reads a file rank 1 lost). A save with a stream loader (whose state_dict is collective) fails when rank 1's
object raises KeyError before the loader's turn: a RuntimeError on every rank, no OSError. Every rank
catches the errors and carries on: one training step, then step 4 saves, the stream loader with it.
Each rank writes OUT/rank<R>.json. The collective timeout is 30 s: a hang fails fast.
"""
import json
import os
import resource
import signal
import sys

import torch
from torch import nn
from torch.utils.data import IterableDataset

import ddpkit

out = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0, timeout_s=30)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of a signal
directory = os.path.join(out, "ckpt")


class Notes:
    """State kept in a file beside the script (a tokenizer's vocabulary, say), which rank 1's node loses."""

    path = os.path.join(out, f"notes-rank{state.rank}.txt")

    def state_dict(self):
        with open(self.path) as f:
            return {"notes": f.read()}

    def load_state_dict(self, saved):
        pass


with open(Notes.path, "w") as f:
    f.write("seen: 3 files")
class Vocabulary:
    """An object whose state_dict raises KeyError on rank 1 (a programming error, not a disk problem)."""

    broken = False

    def state_dict(self):
        if self.broken and state.rank == 1:
            raise KeyError("'<pad>'")
        return {"words": 3}

    def load_state_dict(self, saved):
        pass


class Numbers(IterableDataset):
    def __iter__(self):
        return (torch.full((4,), float(i)) for i in range(1000))


torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
notes = Notes()
ckpt = ddpkit.Checkpointer(directory)


def train_step():
    loss = model(torch.randn(4, 4)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def limited(rank, limit, save):
    """``save()`` with this rank's file-size limit at ``limit`` bytes; the OSError it raised, as text."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if state.rank == rank:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        save()
        return None
    except OSError as exc:
        return str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def seen():
    # everything but the job's lock on its directory (.ddpkit-lock): no partial or temporary directory
    listing = sorted(n for n in os.listdir(directory) if n != ".ddpkit-lock")
    return {"listing": listing, "latest": os.path.basename(ckpt.latest() or "")}


results = {"errors": [], "after": []}
train_step()
ckpt.save(1, model=model, optimizer=opt, notes=notes)
first = os.path.join(directory, "ckpt-0000000001")
biggest = max(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(first) for n in names)
limit = 2 * biggest  # every file of a checkpoint fits, but not a manifest holding 4 x that in extra
train_step()
results["errors"].append(limited(0, limit, lambda: ckpt.save(2, model=model, optimizer=opt, notes=notes,
                                                             extra={"blob": "x" * (4 * limit)})))
results["after"].append(seen())
train_step()
if state.mode == "fsdp":
    results["errors"].append(limited(1, 200, lambda: ckpt.save(3, model=model, optimizer=opt, notes=notes)))
else:
    if state.rank == 1:
        os.remove(Notes.path)
    results["errors"].append(limited(1, 1 << 40, lambda: ckpt.save(3, model=model, optimizer=opt, notes=notes)))
results["after"].append(seen())
with open(Notes.path, "w") as f:  # the file is back
    f.write("seen: 3 files")
stream, vocabulary = ddpkit.data_loader(Numbers(), 2), Vocabulary()
batches = iter(stream)
next(batches)
vocabulary.broken = True
try:  # the vocabulary comes before the loader: rank 1 fails while rank 0 would be in the loader's gather
    ckpt.save(3, model=model, optimizer=opt, vocabulary=vocabulary, loader=stream)
    results["errors"].append(None)
except Exception as exc:
    results["errors"].append(f"{type(exc).__name__}: {exc}")
vocabulary.broken = False
next(batches)
train_step()
ckpt.save(4, model=model, optimizer=opt, notes=notes, vocabulary=vocabulary, loader=stream)
results["after"].append(seen())
with open(os.path.join(out, f"rank{state.rank}.json"), "w") as f:
    json.dump(results, f)
