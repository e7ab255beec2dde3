"""Stream positions at every step, for tests/test_streams.py: ``stream_turns.py OUT`` (2, then 3 workers).

Two streams: a generator (round robin, shuffled through a buffer) and a sharded stream where worker 0 of each
rank runs dry first. For each: the batches of one whole epoch; then, for every step k of it, the batches after
a ``state_dict()`` taken at step k (in the loop body, as ``Checkpointer.save`` does) loaded into a new loader
(what a resume does), and the batches of iterating the first loader again after leaving its loop at step k.
Each rank checks its own batches against the whole epoch; rank 0 writes OUT/turns<WORKERS>.json per worker count.
"""
import json
import os
import sys

import torch
from torch.utils.data import IterableDataset

import ddpkit

out = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0)


class Counter(IterableDataset):
    def __iter__(self):
        for i in range(90):
            yield torch.tensor([i])


class Uneven(IterableDataset):
    """One shard per (rank, worker) slot; worker 0's shard is the short one (1 or 2 batches, the others 4).

    Shard i goes to rank i % world_size, worker i // world_size (ranks first)."""

    def __init__(self, slots):
        world = state.world_size
        self.n_shards, self.sizes = slots, [4 + 2 * (i % world) if i // world == 0 else 14 for i in range(slots)]

    def shard(self, num_shards, index):
        start = sum(self.sizes[:index])
        return [torch.tensor([i]) for i in range(start, start + self.sizes[index])]

    def __iter__(self):
        for k in range(self.n_shards):
            yield from self.shard(self.n_shards, k)


def loader(stream, shuffle):
    return ddpkit.data_loader(stream, batch_size=4, num_workers=workers, seed=1, shuffle=shuffle, shuffle_buffer=10)


def ids(batch):
    return batch.flatten().tolist()


def check(stream, shuffle):
    whole = [ids(b) for b in loader(stream, shuffle)]
    wrong = []
    for k in range(1, len(whole)):
        first, taken = loader(stream, shuffle), []
        for batch in first:
            taken.append(ids(batch))
            if len(taken) == k:
                saved = first.state_dict()  # collective: every rank is at its step k
                break
        resumed = loader(stream, shuffle)
        resumed.load_state_dict(saved)
        if taken + [ids(b) for b in resumed] != whole:
            wrong.append(f"resumed at step {k}")
        if taken + [ids(b) for b in first] != whole:
            wrong.append(f"iterated again after leaving at step {k}")
    return {"steps": len(whole), "wrong": wrong}


for workers in (2, 3):
    result = {"generator": check(Counter(), True), "uneven": check(Uneven(state.world_size * workers), False)}
    everyone = ddpkit.gather_object(result)
    if state.is_main:
        with open(os.path.join(out, f"turns{workers}.json"), "w") as f:
            json.dump(everyone, f)
