"""Worker for the equivalence suite: trains each case with a fixed global batch and saves the results.

``python equivalence.py OUT`` (one process, plus a plain-torch reference) or
``ddpkit launch --nproc-per-node N [--mode fsdp] equivalence.py OUT``. Rank 0 writes OUT/world<N>[-fsdp].pt.
"""
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddpkit

GLOBAL_BATCH, STEPS, CLIP = 12, 4, 0.05
out_dir = sys.argv[1]
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
state = ddpkit.init(seed=0)
W = state.world_size
assert GLOBAL_BATCH % (2 * W) == 0


def data(n):
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def net(bn=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.Tanh(), nn.Linear(16, 3))


def train(bn=False, accum=1, n=48, steps=STEPS):
    model = ddpkit.prepare_model(net(bn), shard=[nn.Linear])  # fsdp: one group per Linear (ignored elsewhere)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ddpkit.data_loader(data(n), batch_size=GLOBAL_BATCH // W // accum, seed=5)
    batches = iter(loader)
    norms = []
    for _ in range(steps):
        for micro in range(accum):
            x, y = (t.to(state.device) for t in next(batches))
            with ddpkit.no_sync(model, enabled=micro < accum - 1):
                (nn.functional.cross_entropy(model(x), y) / accum).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))  # global gradient norm
        opt.step()
        opt.zero_grad()
    assert min(norms) > CLIP, norms  # clipping was active at every step
    return {k: v.cpu() for k, v in model.state_dict().items()}


def plain_torch(n=48):
    """The same training with torch alone: the one-process ddpkit run must equal it bitwise."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    batches = iter(DataLoader(data(n), batch_size=GLOBAL_BATCH, sampler=order))
    for _ in range(STEPS):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def evaluate(n=49):
    """Exact evaluation over a size that divides by neither 2 nor 3."""
    model = ddpkit.prepare_model(net())
    model.eval()
    loss_sum, correct, count, preds = 0.0, 0, 0, []
    with torch.no_grad():
        for x, y in ddpkit.data_loader(data(n), batch_size=4, train=False):  # 25 vs 24 samples: 7 vs 6 batches
            x, y = x.to(state.device), y.to(state.device)
            logits = model(x)
            loss_sum += nn.functional.cross_entropy(logits, y, reduction="sum").double().item()
            correct += int((logits.argmax(1) == y).sum())
            count += len(y)
            preds.append(logits.cpu())
    return {"accuracy": ddpkit.reduce(correct) / ddpkit.reduce(count),
            "mean_loss": ddpkit.reduce(loss_sum, "mean", count=count),
            "max_correct": ddpkit.reduce(correct, "max"), "logits": ddpkit.gather(torch.cat(preds))}


def join_steps(n=49):
    """Unequal shards under Join: every rank finishes, none hangs; returns the steps this rank took."""
    model = ddpkit.prepare_model(net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    with ddpkit.join(model):
        for x, y in ddpkit.data_loader(data(n), batch_size=4, uneven="join"):
            x, y = x.to(state.device), y.to(state.device)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
    return steps


results = {"plain": train(), "bn": train(bn=True), "accum": train(accum=2), "uneven": train(n=49),
           "eval": evaluate()}
if state.mode != "fsdp":  # fsdp refuses join: every forward gathers from all ranks
    results["join_steps"] = ddpkit.gather(torch.tensor([join_steps()])).tolist()
if W == 1:
    results["plain_torch"] = plain_torch()
if state.is_main:
    torch.save(results, f"{out_dir}/world{W}{'-fsdp' if state.mode == 'fsdp' else ''}.pt")
