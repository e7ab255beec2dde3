"""Worker for the gloo multi-process tests: exercises the public API and saves what each rank saw.

Run as ``ddpkit launch --nproc-per-node 2 skeleton.py OUT_DIR [SEED]``; writes OUT_DIR/rank<R>.pt.
"""
import logging
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

out_dir, seed = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0
torch.set_num_threads(1)
state = ddpkit.init()
assert torch.distributed.is_initialized() == (state.world_size > 1)

# Sharding: which dataset indices each epoch gives this rank.
dataset = TensorDataset(torch.arange(40))
loader = ddpkit.data_loader(dataset, batch_size=4, seed=seed)
epochs = [[int(i) for (batch,) in loader for i in batch] for _ in range(3)]

# One DDP step: gradients must be equal on every rank although the batches differ.
torch.manual_seed(1000 + state.rank)  # different initial weights: DDP must broadcast rank 0's
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))
x = torch.randn(6, 4, generator=torch.Generator().manual_seed(state.rank)).to(state.device)
model(x).pow(2).mean().backward()
grads = {n: p.grad.cpu() for n, p in ddpkit.unwrap(model).named_parameters()}
weights = {k: v.cpu() for k, v in model.state_dict().items()}
# a state dict saved by hand from a DDP model loads into ddpkit's wrappers (one process holds the plain module)
prefix = "module." if ddpkit.unwrap(model) is not model else ""
model.load_state_dict({prefix + k: v for k, v in model.state_dict().items()})

# Output once: the test counts these markers in the launcher's stdout.
ddpkit.print("MARKER-print")
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
ddpkit.get_logger("skeleton").info("MARKER-log")
ddpkit.get_logger("skeleton", all_ranks=True).info("MARKER-every-rank")
print("MARKER-same-on-every-rank", flush=True)  # plain print: the launcher's console shows it once, x2
writer = ddpkit.summary_writer(f"{out_dir}/tb")
writer.add_scalar("x", 1.0, 0)
writer.close()
bar = ddpkit.progress(range(3), desc="MARKER-bar")
for _ in bar:
    bar.set_postfix(loss=1.0)  # a bar's own methods run on every rank (do nothing off rank 0)

torch.save({"state": {"rank": state.rank, "local_rank": state.local_rank, "world_size": state.world_size,
                      "node_rank": state.node_rank, "mode": state.mode, "device": str(state.device),
                      "backend": state.backend, "is_main": state.is_main},
            "epochs": epochs, "grads": grads, "weights": weights,
            "bn_type": type(ddpkit.unwrap(model)[1]).__name__}, f"{out_dir}/rank{state.rank}.pt")
