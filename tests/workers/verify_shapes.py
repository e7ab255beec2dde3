"""The script shapes of verify_cases.py's second review (issue 26.2), written as a user's script would be.

    ddpkit verify tests/workers/verify_cases.py --case gan
"""
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

import ddpkit


def mlp(width_in: int, norm: bool = False) -> nn.Sequential:
    middle = [nn.BatchNorm1d(8)] if norm else []
    return nn.Sequential(nn.Flatten(), nn.Linear(width_in, 8), *middle, nn.Tanh(), nn.Linear(8, 1))


def sgd_step(model, opt, loss):
    opt.zero_grad()
    loss.backward()
    opt.step()


def run(case: str, data, state) -> None:
    mse = nn.functional.mse_loss
    if case == "gan":  # G prepared first and broken (summed loss), D prepared last and correct
        G, D = ddpkit.prepare_model(mlp(12)), ddpkit.prepare_model(mlp(1))
        og, od = torch.optim.SGD(G.parameters(), lr=0.05), torch.optim.SGD(D.parameters(), lr=0.1)
        for _epoch in range(3):
            for x, y in ddpkit.data_loader(data, batch_size=8):
                sgd_step(D, od, mse(D(y), y))
                sgd_step(G, og, mse(G(x), y, reduction="sum"))
    elif case == "manual":  # no torch.optim: no optimizer step hook fires
        model = ddpkit.prepare_model(mlp(12))
        for _epoch in range(3):
            for x, y in ddpkit.data_loader(data, batch_size=8):
                model.zero_grad()
                mse(model(x), y).backward()
                with torch.no_grad():
                    for q in model.parameters():
                        q -= 0.1 * q.grad
    elif case == "accum8":  # gradients accumulated over 8 micro-batches: a cap of 3 batches sees no update
        model = ddpkit.prepare_model(mlp(12))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(ddpkit.data_loader(data, batch_size=4)):
            mse(model(x), y).backward()
            if (i + 1) % 8 == 0:
                opt.step()
                opt.zero_grad()
    elif case == "peekbn":  # a preview batch takes the cap of 1, then a train-mode forward moves BatchNorm only
        loader = ddpkit.data_loader(data, batch_size=8)
        next(iter(loader))
        model = ddpkit.prepare_model(mlp(12, norm=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            sgd_step(model, opt, mse(model(x), y))
        with torch.no_grad():
            model(torch.randn(8, 12))
    elif case == "phases":  # a warm-up optimizer steps twice, then the main one
        model = ddpkit.prepare_model(mlp(12))
        loader = ddpkit.data_loader(data, batch_size=8)
        warm, opt = (torch.optim.SGD(model.parameters(), lr=lr) for lr in (0.01, 0.1))
        for i, (x, y) in enumerate(loader):
            if i == 2:
                break
            sgd_step(model, warm, mse(model(x), y))
        for _epoch in range(5):
            for x, y in loader:
                sgd_step(model, opt, mse(model(x), y))
    elif case == "bnplain":  # per-rank BatchNorm statistics, and a plain DataLoader for the evaluation
        model = ddpkit.prepare_model(mlp(12, norm=True), sync_batchnorm=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        test = DataLoader(data, batch_size=32)
        for _epoch in range(3):
            model.train()
            for x, y in ddpkit.data_loader(data, batch_size=8):
                sgd_step(model, opt, mse(model(x), y))
            model.eval()
            with torch.no_grad():
                sum(mse(model(x), y, reduction="sum").item() for x, y in test)
    elif case == "exit":  # ends by os._exit: no shutdown hook runs
        model = ddpkit.prepare_model(mlp(12))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in ddpkit.data_loader(data, batch_size=32):
            sgd_step(model, opt, mse(model(x), y))
        sys.stdout.flush()
        os._exit(0)
