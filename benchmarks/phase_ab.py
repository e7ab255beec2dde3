"""The phase report's cost, in one job: blocks of training steps with the clock on and off in turn.

``ddpkit launch --nproc-per-node 2 --phase-window 0 phase_ab.py --pairs 40 --block 200``: the job itself starts no
clock (``--phase-window 0``); each rank builds the clock ``ddpkit launch`` would (its default window, the group's
store), and alternates: one block of ``--block`` steps with it running (installed, its optimizer hooks, the
model's hooks, the loader's fetch watcher), one block without any of them. The order within a pair alternates.
Both ranks switch together (the same block count). Rank 0 prints one ``BENCH`` line: per pair, on/off ratios
of the block's wall time (the slower rank's) and of rank 0's process CPU time. Pairs of blocks a second apart in
one warm process: the machine's slow phases hit both sides of a pair, and no launch's noise enters.
"""
import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
from ab_pairs import pairs, slowest
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.core import process
from ddpkit.runtime import phases

p = argparse.ArgumentParser()
p.add_argument("--pairs", type=int, default=40)
p.add_argument("--block", type=int, default=200)
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch", type=int, default=64)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                                           nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = TensorDataset(torch.randn(args.batch * state.world_size * args.block, args.width),
                     torch.randint(0, 10, (args.batch * state.world_size * args.block,)))
plain, watched = (ddpkit.data_loader(data, batch_size=args.batch) for _ in range(2))
store = dist.distributed_c10d._get_default_store() if state.world_size > 1 else None
clock = phases.PhaseClock(state.rank, state.local_rank, socket.gethostname(), phases.DEFAULT_WINDOW, store, None,
                          state.world_size)
watched.watch_fetch(clock.fetch)


def block(on):
    if on:
        process.current().phases = clock
        clock.start()
        clock.watch_model(model)
    wall, cpu = time.perf_counter(), time.process_time()
    for x, y in watched if on else plain:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if on:
        clock.stop()
    return slowest(wall), cpu


wall_ratios, cpu_ratios, last_off = pairs(block, args.pairs)
if state.rank == 0:
    print("BENCH " + json.dumps({"impl": "phase_ab", "wall_ratios": wall_ratios, "cpu_ratios": cpu_ratios,
                                 "block_steps": args.block, "steps_per_s": args.block / last_off[0],
                                 "pid": os.getpid()}), flush=True)
