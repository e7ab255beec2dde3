"""A user's sampler split across ranks, for tests/test_samplers.py.

``samplers.py OUT``: every rank writes OUT/samplers-<rank>.json with the sample ids it took per step from
``data_loader(sampler=...)``: ``infinite`` (``RandomSampler(replacement=True, num_samples=10**10)``, as minGPT
builds it: 6 steps, the loop bounds them), ``weighted`` (``WeightedRandomSampler`` of 29 draws: 2 epochs, padded
to an even count), ``resumed`` (``weighted`` again, restored into a fresh loader after 2 steps of epoch 1), and
the steps each pass took, ``global`` (a sampler drawing from torch's global RNG, seeded per rank) and
``short`` (the error for a sampler of 1 index at 2 processes). Batch 4 per rank.
"""
import json
import os
import sys

import torch
from torch.utils.data import RandomSampler, Sampler, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=3)  # seed + rank: the global RNGs differ per rank, the sampler's order must not
data = TensorDataset(torch.arange(50))
weights = torch.linspace(0.1, 1.0, 50)


def steps(loader, count=None):
    out = []
    for (ids,) in loader:
        out.append(ids.tolist())
        if len(out) == count:
            break
    return out


infinite = ddpkit.data_loader(data, batch_size=4, seed=5,
                              sampler=RandomSampler(data, replacement=True, num_samples=10**10))
weighted = ddpkit.data_loader(data, batch_size=4, seed=5, sampler=WeightedRandomSampler(weights, 29))
out = {"infinite": steps(infinite, 6), "infinite_epoch": infinite.epoch,
       "weighted": [steps(weighted) for _ in range(2)]}
weighted.set_epoch(1)
for i, _batch in enumerate(weighted):
    if i == 1:
        saved = weighted.state_dict()  # inside the loop, as a checkpoint after the step is
        break
fresh = ddpkit.data_loader(data, batch_size=4, seed=5, sampler=WeightedRandomSampler(weights, 29))
fresh.load_state_dict(saved)
out["resumed"], out["resumed_len"] = steps(fresh), len(fresh)


class GlobalRNG(Sampler):  # a hand-written sampler drawing from the global RNG, which differs per rank
    def __iter__(self):
        return iter(torch.randperm(50).tolist())

    def __len__(self):
        return 50


out["global"] = steps(ddpkit.data_loader(data, batch_size=4, sampler=GlobalRNG()))
try:
    ddpkit.data_loader(data, batch_size=4, uneven="drop", sampler=SubsetRandomSampler([5]))
    out["short"] = "built"
except ValueError as error:
    out["short"] = f"ValueError: {error}"
with open(os.path.join(sys.argv[1], f"samplers-{state.rank}.json"), "w") as f:
    json.dump(out, f)
