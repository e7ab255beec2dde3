"""A model whose training state does not fit one process's memory budget: ddp refuses it, fsdp trains it.

    ddpkit launch --nproc-per-node 2 --mode fsdp examples/big.py --budget-mb 600   # trains under 600 MB
    ddpkit launch --nproc-per-node 2 --mode ddp examples/big.py --budget-mb 600    # does not fit: ... MB needed

The model is declared on the meta device (no memory) and each rank materialises only its shard. The budget
is checked twice: before anything is allocated (ddpkit.init_empty), and at the end against how far the
process's peak RSS rose during training (this example exits 1 when it went over).
"""
import argparse
import ctypes
import resource
import sys

import torch
from torch import nn

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--budget-mb", type=float, default=600)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--depth", type=int, default=12, help="12 layers of 2048 x 2048: 50M parameters")
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


state = ddpkit.init(seed=0)
if sys.platform == "linux":  # glibc keeps freed buffers of 16 MB in its heap; return them so RSS shows what is live
    ctypes.CDLL(None).mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD: 128 KiB
start = peak_rss_mb()
try:
    with ddpkit.init_empty(budget_mb=args.budget_mb, optimizer_slots=2):  # Adam: two tensors per parameter
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU())
                                for _ in range(args.depth)])
except MemoryError as exc:
    ddpkit.print(f"ddpkit: {exc}")
    sys.exit(1)
model = ddpkit.prepare_model(model, shard=[nn.Linear])  # fsdp: one all-gather group per layer
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
x, y = torch.randn(8, args.width), torch.randn(8, args.width)
for step in range(args.steps):
    loss = nn.functional.mse_loss(model(x.to(state.device)), y.to(state.device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    ddpkit.print(f"step {step} loss {loss.item():.4f}")
grew = ddpkit.reduce(peak_rss_mb() - start, "max")
ddpkit.print(f"peak RSS rose {grew:.0f} MB per process (budget {args.budget_mb:.0f} MB) in mode {state.mode}")
sys.exit(0 if grew <= args.budget_mb else 1)
