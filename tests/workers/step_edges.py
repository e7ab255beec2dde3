"""Worker for tests/test_token_loss.py's step-loader edges: ``static_graph=True`` with the step loader and with
``ddpkit.accumulate`` (torch's reducer asserted at the first no_sync backward), and ``zero_grad()`` inside
``step.micro_batches()`` (stopped at the step's second micro-batch), and the error for a global batch the world
size does not divide (the step loader is advised for training only: evaluation refuses it).
Rank 0 writes OUT/edges<N>.pt.
"""
import sys

import torch
from torch import nn

import ddpkit

out_dir = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
g = torch.Generator().manual_seed(4)
data = [(torch.randn(5, generator=g), torch.randn(1, generator=g)) for _ in range(36)]


def model_and_optimizer(static):
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)),
                                 comm=ddpkit.CommConfig(static_graph=static))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def steps(static):
    model, opt = model_and_optimizer(static)
    for step in ddpkit.data_loader(data, global_batch_size=12, micro_batch_size=2):
        for x, y in step.micro_batches(model):
            step.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accumulated(static):
    model, opt = model_and_optimizer(static)
    loader = ddpkit.data_loader(data, batch_size=2)
    for i, (x, y) in enumerate(loader):
        with ddpkit.accumulate(model, i, steps=3, total=len(loader)) as micro:
            (nn.functional.mse_loss(model(x), y) / micro.size).backward()
        if micro.sync:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def zero_grad_inside(variant):
    """``plain``: zero_grad() at the top of each micro-batch; ``in_place``: zero_grad(set_to_none=False);
    ``step``: the step iterated itself (no model given to watch)."""
    model, opt = model_and_optimizer(False)
    try:
        for step in ddpkit.data_loader(data, global_batch_size=12, micro_batch_size=2):
            for x, y in step if variant == "step" else step.micro_batches(model):
                opt.zero_grad(set_to_none=variant != "in_place")
                step.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
    except RuntimeError as error:
        return str(error)
    return None


def odd_global_batch(train):
    try:
        ddpkit.data_loader(data, global_batch_size=3, train=train)
    except ValueError as error:
        return str(error)
    return None


results = {"odd": [odd_global_batch(False), odd_global_batch(True)], "steps": [steps(False), steps(True)],
           "accumulate": [accumulated(False), accumulated(True)],
           "zero_grad": {v: zero_grad_inside(v) for v in ("plain", "in_place", "step")}}
if state.is_main:
    torch.save(results, f"{out_dir}/edges{state.world_size}.pt")
