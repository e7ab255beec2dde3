"""Ranks that do not see one checkpoint directory: ``ddpkit launch [--mode fsdp] --nproc-per-node 2
ckpt_agree_split.py OUT``.

Each step catches what every rank raises and writes it to OUT/rank<R>.json ({"name": [type, first line] or
"ok ..."}), so the job ends 0 and the test reads what each rank saw:

- "split save": each rank saves into a directory of its own, OUT/node<R> (node-local disks); in ddp rank 0
  alone writes, so steps 3 and 6 commit there; in fsdp rank 0 must not commit without rank 1's shard.
- "async split save" (fsdp): the same with ``async_save=True``: ``wait()`` raises it on every rank.
- "split restore": a resume in those per-node directories (rank 0 sees ckpt-6, rank 1 none in ddp).
- "copied restore" (ddp): rank 1's node gets a copy of rank 0's directory; then both resume from step 6.
- "steps": a shared directory OUT/shared with ckpt-2 (keep=1); rank 0 saves step 4, rank 1 step 5; after it
  OUT/shared must still hold ckpt-2 alone, valid.
- "held": OUT/held holds a lock naming a live process of another job (the test's pytest process, written by the
  test): the first save is refused on every rank.
- "path split" (ddp): ``restore(path=...)`` of OUT/A/ckpt-5 on rank 0 and OUT/B/ckpt-5 (other weights) on rank 1:
  the same name, two checkpoints: refused on every rank, nothing loaded.
- "rng split" (ddp): a checkpoint whose saved generator state only rank 1's generator refuses: refused on every
  rank, the same line.
- "mixed copies" (fsdp): OUT/mixed<R> holds, on rank 0, a copy of one save and, on rank 1, of another, both
  ckpt-7: a resume there is refused on every rank (their shards would mix).
- "damaged copy" (fsdp): OUT/copy<R> holds each node's copy of one save (ckpt-9), rank 1's with its own shard
  file swapped for another save's of the same size (a bad copy: the manifest still names the first): refused on
  every rank, though the validation that the ranks split hashes that file on rank 0's (intact) copy alone.
- "damaged state" (fsdp, hsdp): the same with rank 0's copy of state.pt (another save's, another lr): refused.
The collective timeout is 30 s: a hang fails fast.
"""
import json
import os
import shutil
import sys

import torch
from torch import nn

import ddpkit

out = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0, timeout_s=30)
model = ddpkit.prepare_model(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen: dict = {}


def caught(name, action):
    try:
        seen[name] = f"ok {action()}"
    except Exception as exc:  # every rank must raise the same: recorded, compared by the test
        seen[name] = [type(exc).__name__, str(exc)]


def listing(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


own = os.path.join(out, f"node{state.rank}")
os.makedirs(own, exist_ok=True)  # each node its own disk: made there by whoever runs on it
os.makedirs(os.path.join(out, f"async{state.rank}"), exist_ok=True)


def split_save():
    ckpt = ddpkit.Checkpointer(own, keep=3)
    ckpt.save(3, model=model, optimizer=opt)
    ckpt.save(6, model=model, optimizer=opt)
    return listing(own)


caught("split save", split_save)
seen["after split save"] = listing(own)
if state.mode != "ddp":  # the same in the background: wait() raises it on every rank
    background = ddpkit.Checkpointer(os.path.join(out, f"async{state.rank}"), async_save=True)
    caught("async split save", lambda: (background.save(3, model=model, optimizer=opt), background.wait()))
    seen["after async split save"] = listing(os.path.join(out, f"async{state.rank}"))
caught("split restore", lambda: ddpkit.Checkpointer(own, resume=True).restore(model=model, optimizer=opt))
if state.mode == "ddp":
    ddpkit.barrier()
    if state.rank == 1:
        shutil.rmtree(own)
        shutil.copytree(os.path.join(out, "node0"), own)
    ddpkit.barrier()
    caught("copied restore", lambda: ddpkit.Checkpointer(own, resume=True).restore(model=model, optimizer=opt))

shared = os.path.join(out, "shared")
steps = ddpkit.Checkpointer(shared, keep=1)
steps.save(2, model=model, optimizer=opt)
caught("steps", lambda: steps.save(4 + state.rank, model=model, optimizer=opt))
seen["after steps"] = [listing(shared), steps.latest() and os.path.basename(steps.latest())]
caught("held", lambda: ddpkit.Checkpointer(os.path.join(out, "held")).save(1, model=model, optimizer=opt))


def path_split():
    ddpkit.Checkpointer(os.path.join(out, "A")).save(5, model=model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    ddpkit.Checkpointer(os.path.join(out, "B")).save(5, model=model)
    mine = os.path.join(out, "A" if state.rank == 0 else "B", "ckpt-0000000005")
    return ddpkit.Checkpointer(os.path.join(out, "finetune")).restore(path=mine, model=model)


def mixed_copies():
    """fsdp: each node holds a copy of another save under the same name (ckpt-7): the shards must not mix."""
    for name in ("C", "D"):
        ddpkit.Checkpointer(os.path.join(out, name)).save(7, model=model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
    ddpkit.barrier()
    mine = os.path.join(out, f"mixed{state.rank}")
    shutil.copytree(os.path.join(out, "C" if state.rank == 0 else "D"), mine)
    ddpkit.barrier()
    return ddpkit.Checkpointer(mine, resume=True).restore(model=model)


def rng_split():
    """ddp: rank 1's row of the saved torch generator zeroed (a shape the checks pass, a state the generator
    refuses), the manifest rewritten to match: refused on rank 1 alone, the others went on into their next
    collective."""
    import hashlib

    directory = os.path.join(out, "rng")
    ddpkit.Checkpointer(directory).save(8, model=model, optimizer=opt)
    ddpkit.barrier()
    if state.rank == 0:
        ckpt = os.path.join(directory, "ckpt-0000000008")
        path = os.path.join(ckpt, "state.pt")
        payload = torch.load(path, weights_only=True)
        payload["rng"]["torch"][1].zero_()
        torch.save(payload, path)
        with open(os.path.join(ckpt, "manifest.json")) as f:
            manifest = json.load(f)
        with open(path, "rb") as f:
            manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(f.read()).hexdigest(),
                                             "bytes": os.path.getsize(path)}
        with open(os.path.join(ckpt, "manifest.json"), "w") as f:
            json.dump(manifest, f)
    ddpkit.barrier()
    return ddpkit.Checkpointer(directory, resume=True).restore(model=model, optimizer=opt)


def damaged_copy():
    """fsdp: rank 1's node holds a copy of ckpt-9 whose shards/__1_0.distcp (rank 1's own shard) came from
    another save: a manifest that matches on rank 0's copy, a file that does not on rank 1's."""
    ddpkit.Checkpointer(os.path.join(out, "E")).save(9, model=model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    ddpkit.Checkpointer(os.path.join(out, "F")).save(9, model=model)
    ddpkit.barrier()
    mine = os.path.join(out, f"copy{state.rank}")
    shutil.copytree(os.path.join(out, "E"), mine)
    if state.rank == 1:
        shard = os.path.join("ckpt-0000000009", "shards", "__1_0.distcp")
        shutil.copyfile(os.path.join(out, "F", shard), os.path.join(mine, shard))
    ddpkit.barrier()
    return ddpkit.Checkpointer(mine, resume=True).restore(model=model)


def damaged_state():
    """fsdp: rank 0's node holds a copy of ckpt-11 whose state.pt (the optimizer's param_groups, read by every rank)
    came from another save of the same size: the split validation hashes state.pt on rank 1's intact copy alone."""
    ddpkit.Checkpointer(os.path.join(out, "G")).save(11, model=model, optimizer=opt)
    opt.param_groups[0]["lr"] = 0.5
    ddpkit.Checkpointer(os.path.join(out, "H")).save(11, model=model, optimizer=opt)
    opt.param_groups[0]["lr"] = 0.1
    ddpkit.barrier()
    mine = os.path.join(out, f"state{state.rank}")
    shutil.copytree(os.path.join(out, "G"), mine)
    if state.rank == 0:
        name = os.path.join("ckpt-0000000011", "state.pt")
        shutil.copyfile(os.path.join(out, "H", name), os.path.join(mine, name))
    ddpkit.barrier()
    ddpkit.Checkpointer(mine, resume=True).restore(model=model, optimizer=opt)
    return opt.param_groups[0]["lr"]


if state.mode == "ddp":
    caught("path split", path_split)
    caught("rng split", rng_split)
else:
    caught("mixed copies", mixed_copies)
    caught("damaged copy", damaged_copy)
    caught("damaged state", damaged_state)
with open(os.path.join(out, f"rank{state.rank}.json"), "w") as f:
    json.dump(seen, f)
