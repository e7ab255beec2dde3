"""One loader-throughput run: the same samples as a map-style dataset or as a stream, through ddpkit.data_loader.

``torchrun --standalone --nproc-per-node 2 stream_worker.py --impl map|stream``: each rank trains a small
linear model for one epoch (loading included in the time: the stream's agreement per window is part of it);
rank 0 prints BENCH {"impl", "samples_per_s"} (global samples over the slowest rank's wall time).
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True, choices=["map", "stream"])
# 200,000 rows: about 3 s of training per run; 40,000 (0.6 s) gave pairs from 0.79 to 1.09 on the same code
p.add_argument("--samples", type=int, default=200000)
p.add_argument("--batch", type=int, default=64)
args = p.parse_args()
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(args.samples, 64, generator=g), torch.randn(args.samples, 1, generator=g)


class Rows(IterableDataset):
    """The same rows as a stream in 16 shards (n_shards / shard(): ddpkit hands whole shards to each rank).

    Each row is read as TensorDataset reads it (``x[i], y[i]``), so both sides pay the same per-sample reading
    and the ratio measures ddpkit's stream machinery; iterating strided views (``zip(x[i::16], ...)``, torch's
    unbind) cost about 4x TensorDataset's indexing and was measured here before 2026-12-01."""

    n_shards = 16

    def shard(self, num_shards, index):
        return ((x[i], y[i]) for i in range(index, len(x), num_shards))

    def __iter__(self):
        return ((x[i], y[i]) for i in range(len(x)))


dataset = TensorDataset(x, y) if args.impl == "map" else Rows()
loader = ddpkit.data_loader(dataset, batch_size=args.batch)
model = ddpkit.prepare_model(nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
dist.barrier()
start, seen = time.perf_counter(), 0
for xb, yb in loader:
    loss = nn.functional.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    seen += len(xb)
elapsed = torch.tensor([time.perf_counter() - start])
dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
total = ddpkit.reduce(seen)
if state.is_main:
    print("BENCH " + json.dumps({"impl": args.impl, "samples_per_s": total / elapsed.item()}), flush=True)
