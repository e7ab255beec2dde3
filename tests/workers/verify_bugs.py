"""A script whose distributed run differs from its single run, for `ddpkit verify` to catch.

--bug sum: the loss is a sum over the batch, so N processes average N per-rank sums (1/N of the gradient).
--bug nosync: BatchNorm statistics per rank (sync_batchnorm=False).
--bug std: inputs standardised per batch with x.std(0); at one sample per process that is NaN, so only the
N-process run diverges (the one-process run gets N samples per batch).
--optim adamw: AdamW instead of SGD (a real defect must still FAIL where verify excuses float-noise gradients).
--bug lr: the learning rate times the number of processes (the update differs, not the gradients).
--lr: the learning rate (1e-9: a warm-up's, the weights move less than verify's tolerance in a few steps).
"""
import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["none", "sum", "nosync", "std", "lr"], default="none")
parser.add_argument("--optim", choices=["sgd", "adamw"], default="sgd")
parser.add_argument("--lr", type=float, default=None)
args = parser.parse_args()
torch.set_num_threads(1)
world = ddpkit.init(seed=0).world_size
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 5, generator=g) * 2 + 1, torch.randn(64, 1, generator=g))
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)),
                             sync_batchnorm=args.bug != "nosync")
opt = (torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-3) if args.optim == "adamw"
       else torch.optim.SGD(model.parameters(), lr=(args.lr or 0.1) * (world if args.bug == "lr" else 1)))
for _ in range(3):
    for x, y in ddpkit.data_loader(data, batch_size=1 if args.bug == "std" else 8):
        if args.bug == "std":
            x = (x - x.mean(0)) / x.std(0)
        loss = nn.functional.mse_loss(model(x), y, reduction="sum" if args.bug == "sum" else "mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
