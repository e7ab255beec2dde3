"""One optimizer step of gradient accumulation, timed: ddpkit's loader of steps against the hand-written loop.

``torchrun --standalone --nproc-per-node 2 accum_worker.py --impl hand|ddpkit``: ``--accum`` micro-batches of
``--micro`` samples per process and step. ``hand`` is what a script writes with torch alone (DistributedSampler,
``model.no_sync()`` on all but the last micro-batch, the loss divided by the count); ``ddpkit`` is
``data_loader(global_batch_size=, micro_batch_size=)``, ``step.micro_batches(model)`` and ``step.backward``. Each
step is timed whole, fetches included (the step loader fetches inside the step). Prints ``BENCH {json}``.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True, choices=["hand", "ddpkit"])
p.add_argument("--width", type=int, default=512)
p.add_argument("--micro", type=int, default=16)
p.add_argument("--accum", type=int, default=4)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--warmup", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                      nn.Linear(args.width, 10))


def timed_steps(steps):
    """Yields once per optimizer step; the time between the yields is the step's."""
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        yield
        times.append(time.perf_counter() - start)
    steps.extend(times)


times: list = []
if args.impl == "hand":
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = TensorDataset(torch.randn(args.micro * args.accum * world * (args.steps + 1), args.width),
                         torch.randint(0, 10, (args.micro * args.accum * world * (args.steps + 1),)))
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(DataLoader(data, batch_size=args.micro, sampler=DistributedSampler(data, seed=0)))
    for _ in timed_steps(times):
        for i in range(args.accum):
            x, y = next(batches)
            context = model.no_sync() if i < args.accum - 1 else torch.enable_grad()
            with context:
                (nn.functional.cross_entropy(model(x), y) / args.accum).backward()
        opt.step()
        opt.zero_grad()
else:
    import ddpkit

    state = ddpkit.init()
    world = state.world_size
    data = TensorDataset(torch.randn(args.micro * args.accum * world * (args.steps + 1), args.width),
                         torch.randint(0, 10, (args.micro * args.accum * world * (args.steps + 1),)))
    model = ddpkit.prepare_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ddpkit.data_loader(data, global_batch_size=args.micro * args.accum * world, micro_batch_size=args.micro)
    assert loader.micro_steps == args.accum
    steps = iter(loader)
    for _ in timed_steps(times):
        step = next(steps)
        for x, y in step.micro_batches(model):
            step.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

stats = torch.tensor(times, dtype=torch.float64)
everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, stats)
if dist.get_rank() == 0:
    per_step = torch.stack(everyone).max(0).values[args.warmup:]  # the slowest rank sets the pace
    print("BENCH " + json.dumps({"impl": args.impl, "median_ms": per_step.median().item() * 1e3,
                                 "mean_ms": per_step.mean().item() * 1e3}), flush=True)
dist.barrier()
dist.destroy_process_group()
