"""The divergence guards' cost (issue 47), in one job: blocks of training steps with the guards on and off in turn.

``ddpkit launch --nproc-per-node 2 guard_ab.py --pairs 40 --block 200``: two DDP models of the same weights, one
with the replica fingerprints on (``check_sync_every='auto'``, the default) and one with them off (``0``); "on"
blocks train the first with this rank's desync watch looking, "off" blocks the second with the watch paused. The
order within a pair alternates and both ranks switch together. Rank 0 prints one ``BENCH`` line: per pair, the
on/off ratio of the block's wall time (the slower rank's) and of rank 0's process CPU time.
"""
import argparse
import json
import time

import torch
from ab_pairs import pairs, slowest
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.core import process

p = argparse.ArgumentParser()
p.add_argument("--pairs", type=int, default=40)
p.add_argument("--block", type=int, default=200)
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--no-watch", action="store_true", help="the desync watch off in both arms: the fingerprints alone")
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=0)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                         nn.Linear(args.width, 10))


models = {True: ddpkit.prepare_model(net()), False: ddpkit.prepare_model(net(), check_sync_every=0)}
optimizers = {on: torch.optim.SGD(m.parameters(), lr=0.01) for on, m in models.items()}
data = TensorDataset(torch.randn(args.batch * state.world_size * args.block, args.width),
                     torch.randint(0, 10, (args.batch * state.world_size * args.block,)))
loader = ddpkit.data_loader(data, batch_size=args.batch)
watch = process.current().desync


def block(on):
    if watch is not None:  # one thread, as a run has; asleep in the "off" blocks (and in both with --no-watch)
        watch.paused = not on or args.no_watch
    model, opt = models[on], optimizers[on]
    wall, cpu = time.perf_counter(), time.process_time()
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return slowest(wall), cpu


wall_ratios, cpu_ratios, last_off = pairs(block, args.pairs)
if state.rank == 0:
    print("BENCH " + json.dumps({"impl": "guard_ab", "wall_ratios": wall_ratios, "cpu_ratios": cpu_ratios,
                                 "block_steps": args.block, "steps_per_s": args.block / last_off[0],
                                 "check_every": models[True]._replicas.every}), flush=True)
