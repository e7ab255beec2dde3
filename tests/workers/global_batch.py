"""Worker for tests/test_global_batch.py: the same script at any world size, with ``global_batch_size=48``.

``python global_batch.py OUT`` (one process) or ``ddpkit launch --nproc-per-node N [--mode fsdp] global_batch.py
OUT``. Each case trains 2 epochs; rank 0 writes OUT/world<N>[-fsdp].pt: per case the final weights, the ids of
every sample each step used (all ranks, padding left out) and the micro-steps; and the all-reduces counted
in each micro-step of a no-buffer model.
"""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

out_dir = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
tag = f"{state.world_size}" + ("-fsdp" if state.mode == "fsdp" else "")


def data(n):
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g), torch.arange(n))


def net(bn=False):  # built right after the previous case, as a script would: no reseed
    return nn.Sequential(nn.Linear(6, 16), *([nn.BatchNorm1d(16)] if bn else []), nn.Tanh(), nn.Linear(16, 3))


def train(bn=False, adamw=False, clip=None, bf16=False, n=98, epochs=2, **loader_kwargs):
    model = ddpkit.prepare_model(net(bn), shard=[nn.Linear])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01) if adamw else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ddpkit.data_loader(data(n), global_batch_size=48, seed=5, **loader_kwargs)
    log = []
    for _epoch in range(epochs):
        for step in loader:
            used = []
            for x, y, ids in step.micro_batches(model):
                with ddpkit.autocast("bf16" if bf16 else None):
                    loss = nn.functional.cross_entropy(model(x), y)
                step.backward(loss)
                if step.scale > 0:  # a padding sample (weight 0) is not a sample of the step
                    used += ids.tolist()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            log.append(sorted(sum(ddpkit.gather_object(used), [])))
    weights = {k: v.detach().cpu().float().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "steps": log, "micro_steps": loader.micro_steps}


def allreduces_per_micro_step():
    """The all-reduces (DDP) or reduce-scatters (fsdp) that each micro-step's forward and backward ran."""
    model = ddpkit.prepare_model(net(), shard=[nn.Linear])
    loader = ddpkit.data_loader(data(98), global_batch_size=48, micro_batch_size=8, seed=5)
    counts = []
    step = next(iter(loader))
    for x, y, _ids in step.micro_batches(model):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step.backward(nn.functional.cross_entropy(model(x), y))
        names = [e.name for e in prof.events()]
        counts.append(sum(("allreduce" in name or "reduce_scatter" in name) and name.startswith("c10d::")
                          for name in names))
    return counts


results = {
    "plain": train(micro_batch_size=8),
    "adamw_clip": train(adamw=True, clip=0.05, micro_batch_size=8),
    "bn": train(bn=True, accumulation_steps=2, drop_last=True),
    "bf16": train(bf16=True, micro_batch_size=8),
    "odd": train(n=101, micro_batch_size=5),
}
results["allreduces"] = allreduces_per_micro_step()
if state.is_main:
    torch.save(results, f"{out_dir}/world{tag}.pt")
