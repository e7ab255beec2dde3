"""Worker: rank 1 leaves with ``sys.exit(3)`` after a DDP forward, while rank 0 goes on into its backward, an
all-reduce rank 1 never joins. ``ddpkit launch --nproc-per-node 2 early_exit.py OUT``: rank 1 writes the time it
leaves to OUT/leaving.

The collective timeout is long (120 s): a job that ends in seconds did not wait for it.
"""
import os
import sys
import time

import torch

import ddpkit

state = ddpkit.init(timeout_s=120, seed=0)
model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
loss = model(torch.randn(8, 4, device=state.device)).sum()
if state.rank == 1:
    with open(os.path.join(sys.argv[1], "leaving"), "w") as f:
        f.write(str(time.time()))
    sys.exit(3)
loss.backward()  # waits for rank 1's gradients, which never come
print("rank 0 finished its backward", flush=True)
