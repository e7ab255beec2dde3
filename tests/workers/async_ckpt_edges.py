"""Worker for the background-checkpoint edge tests (``Checkpointer(..., async_save=True)``), each a way a script
ends or fails that a synchronous save survives.

``ddpkit launch [--mode fsdp] ... async_ckpt_edges.py OUT ACTION``:
- ``destroy``: saves steps 1 and 2, the last one slow to write, then ends with the usual
  ``dist.destroy_process_group()``; rank 0 writes OUT/destroyed.json (whether the group is down).
- ``skip``: step 2's write fails on one rank; each rank writes OUT/skip<R>.json: what ``save(3)`` raised and the
  checkpoints there after it.
- ``metafail`` (fsdp): rank 0's ``.metadata`` write fails (a full disk) once every shard is written; each rank
  writes OUT/metafail<R>.json: what its ``wait()`` raised, how long it took, the directory's listing.
- ``die`` (run without the launcher, which would stop rank 0 at once): rank 1 is killed (SIGKILL) while step 2's
  sharded write runs; rank 0 writes OUT/died.json: what its next ``wait()`` raised.
"""
import json
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
from async_ckpt_slow import SlowState
from torch import nn

import ddpkit

out, action = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
state = ddpkit.init(seed=0, timeout_s=60)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of a signal
directory = os.path.join(out, "ckpt")
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 4)), shard=[nn.Linear])
opt = torch.optim.Adam(model.parameters(), lr=0.01)
ckpt = ddpkit.Checkpointer(directory, async_save=True, keep=10)


def train_step():
    loss = model(torch.randn(6, 8).to(state.device)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def listing():
    return sorted(n for n in os.listdir(directory) if n.startswith("ckpt-"))


def write(name, value):
    with open(os.path.join(out, name), "w") as f:
        json.dump(value, f)


train_step()
ckpt.save(1, model=model, optimizer=opt)
ckpt.wait()
train_step()
if action == "destroy":
    if state.mode == "fsdp":  # a slow disk: each rank's shard file takes 1.5 s, so the destroy comes mid-write
        from torch.distributed.checkpoint import filesystem

        fast = filesystem._write_files_from_queue
        filesystem._write_files_from_queue = lambda *a, **k: (time.sleep(1.5), fast(*a, **k))[1]
    ckpt.save(2, model=model, optimizer=opt, slow=SlowState(1.0))
    train_step()
    dist.destroy_process_group()  # what most DDP scripts end with, the write still running
    if state.is_main:
        write("destroyed.json", {"initialized": dist.is_initialized()})
elif action == "skip":
    failing = 1 if state.mode == "fsdp" else 0
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if state.rank == failing:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))  # a full disk for this rank's files
    ckpt.save(2, model=model, optimizer=opt)
    time.sleep(2)  # the write has failed by now: save(3) finds it failed
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    train_step()
    try:
        returned, error = ckpt.save(3, model=model, optimizer=opt), None
    except OSError as exc:
        returned, error = None, str(exc)
    waited = ckpt.wait()
    write(f"skip{state.rank}.json", {"error": error, "returned": returned and os.path.basename(returned),
                                     "waited": waited and os.path.basename(waited), "listing": listing()})
elif action == "metafail":  # rank 0's own .metadata write fails, after every shard was written
    if state.rank == 0:
        from torch.distributed.checkpoint import FileSystemWriter

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        FileSystemWriter.finish = full
    ckpt.save(2, model=model, optimizer=opt)
    start = time.monotonic()
    try:
        ckpt.wait()
        error = None
    except OSError as exc:
        error = str(exc)
    write(f"metafail{state.rank}.json", {"error": error, "seconds": time.monotonic() - start,
                                          "listing": sorted(os.listdir(directory))})
elif action == "die":
    ckpt.save(2, model=model, optimizer=opt)
    if state.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # save() returned: its writer is in DCP's collectives of the write
    time.sleep(1)
    try:
        ckpt.wait()
        error = None
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    write("died.json", {"error": error, "listing": listing()})
