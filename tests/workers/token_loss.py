"""Worker for tests/test_token_loss.py: an SFT-style loop (a small causal LM, labels -100 on the prompt and the
padding, a different length per sample) with ``data_loader(..., count=...)`` at any world size.

``python token_loss.py OUT`` (one process) or ``ddpkit launch --nproc-per-node N [--mode fsdp|hsdp] token_loss.py
OUT``; rank 0 writes OUT/world<N>[-<mode>].pt: per case the final weights, the micro-steps and each step's global count.
"""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

out_dir = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
tag = f"{state.world_size}" + (f"-{state.mode}" if state.mode in ("fsdp", "hsdp") else "")
VOCAB, LENGTH = 23, 10


def data(n=70):
    """Token ids and their labels: the prompt (1-3 tokens) and the padding are -100; one sample in four is
    all prompt and padding (nothing to learn from), so micro-batches of one sample can count nothing."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
    labels = ids.roll(-1, dims=1)
    for i in range(n):
        prompt, end = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(4, LENGTH, (), generator=g))
        labels[i, :prompt] = -100
        labels[i, end:] = -100
        if i % 4 == 3:
            labels[i] = -100
    return TensorDataset(ids, labels)


def lm():
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB))


def tokens(batch):
    return (batch[1] != -100).sum()


def train(counted=True, adamw=False, **loader_kwargs):
    torch.manual_seed(0)  # the script seeds before its build: every case starts from the same weights
    model = ddpkit.prepare_model(lm(), shard=[nn.Linear], shard_size=2)  # shard_size: hsdp's groups of 2
    opt = torch.optim.AdamW(model.parameters(), lr=0.01) if adamw else \
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loader = ddpkit.data_loader(data(), global_batch_size=24, seed=3, count=tokens if counted else None,
                                **loader_kwargs)
    counts = []
    for _epoch in range(2):
        for step in loader:
            for ids, labels in step.micro_batches(model):
                logits = model(ids)
                step.backward(nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
            opt.step()
            opt.zero_grad()
            counts.append(step.global_count)
    weights = {k: v.detach().cpu().float().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "micro_steps": loader.micro_steps, "counts": counts}


results = {
    "whole": train(accumulation_steps=1),  # one micro-step: at one process, the plain token mean of the step
    "counted": train(micro_batch_size=4),
    "counted_adamw": train(adamw=True, micro_batch_size=4),
    "one_sample": train(micro_batch_size=1),  # micro-batches with no token to count
    "uncounted": train(counted=False, micro_batch_size=4),  # the sample-weighted mean: not one process's loss
}
if state.is_main:
    torch.save(results, f"{out_dir}/world{tag}.pt")
