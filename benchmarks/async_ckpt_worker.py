"""The background-checkpoint figure of `make bench`: how long a save stops training, synchronous against
``async_save=True``, and how much slower the steps taken while the background write runs are.

One process (ddpkit's ``single`` mode, one thread), an MLP of ``--width`` x ``--depth`` with Adam: at the default
2560 x 4, 26M parameters, 315 MB of saved state (parameters and both Adam moments). Each repetition, side by side:
a synchronous save (its time is what the loop stops for), then a background save (the time ``save()`` takes to
return: collecting and staging) followed by steps until its write ends, then ``wait()``. Prints one ``BENCH {json}``
line with every repetition's figures.

    python benchmarks/async_ckpt_worker.py --reps 5 --dir /tmp/ckpt-bench
"""
import argparse
import json
import shutil
import statistics
import time

import torch
from torch import nn

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=5)
p.add_argument("--width", type=int, default=2560)
p.add_argument("--depth", type=int, default=4)
p.add_argument("--dir", required=True)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
model = ddpkit.prepare_model(nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)]))
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
x = torch.randn(8, args.width)


def step():
    start = time.perf_counter()
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - start


for _ in range(3):  # warm-up; Adam's moments exist from here
    step()
state_mb = sum(t.numel() * t.element_size() for t in [*model.state_dict().values(),
               *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]) / 2**20
shutil.rmtree(args.dir, ignore_errors=True)
sync_ckpt = ddpkit.Checkpointer(f"{args.dir}/sync", keep=1, resume=False)
async_ckpt = ddpkit.Checkpointer(f"{args.dir}/async", keep=1, resume=False, async_save=True)
reps = []
for rep in range(args.reps):
    normal = [step() for _ in range(5)]
    start = time.perf_counter()
    sync_ckpt.save(rep, model=model, optimizer=opt)
    sync_s = time.perf_counter() - start
    start = time.perf_counter()
    async_ckpt.save(rep, model=model, optimizer=opt)
    blocked_s = time.perf_counter() - start
    during = []
    while not async_ckpt._pending.done():  # steps while the write runs
        during.append(step())
    start = time.perf_counter()
    async_ckpt.wait()
    reps.append({"sync_s": sync_s, "async_block_s": blocked_s, "wait_s": time.perf_counter() - start,
                 "normal_step_s": statistics.median(normal), "steps_during": len(during),
                 "during_step_s": statistics.median(during) if during else float("nan")})
shutil.rmtree(args.dir, ignore_errors=True)
print("BENCH " + json.dumps({"impl": "async_ckpt", "state_mb": state_mb, "reps": reps}))
