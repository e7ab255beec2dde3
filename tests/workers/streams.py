"""Worker for the streaming tests: ``ddpkit launch --nproc-per-node N streams.py OUT`` (0, 1 and 2 loader workers
in turn, in one launch).

Checks, on every rank, then rank 0 writes OUT/streams<N>x<WORKERS>.json for each worker count:
- eval over a generator stream (round robin) and a sharded stream over files: every id once across ranks and
  workers (gathered);
- train with uneven="drop" (the default): equal steps on every rank, no id twice, ids reshuffled per epoch;
- a sharded stream with 2 shards, fewer than the slots (and, at 3 processes, than the ranks): every rank still
  trains (equal steps, each id at most once) and evaluation still reads every id once;
- a stream where rank 0 has 3 batches and rank 1 has 7 (2 processes, no workers): done in 3 equal steps; with
  uneven="join" it refuses to run outside ``ddpkit.join`` and runs 3 and 7 steps inside it;
- how far ahead of the loop a rank reads (no workers, 2 processes): one batch before the first step, also while
  rank 1 takes 0.6 s a batch, then a window growing to 16; and batches of 8 MiB of bytes after two small ones
  held to at most 64 MiB.
"""
import json
import os
import sys
import time

import torch
from torch.utils.data import IterableDataset

import ddpkit

out = sys.argv[1]
torch.set_num_threads(1)
state = ddpkit.init(seed=0)
N, B = 103, 4


class Counter(IterableDataset):
    """A generator: ids 0..n-1, unaware of ranks and workers."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([i])


class Files(IterableDataset):
    """One file of ids per shard; exposes n_shards / shard(num_shards=, index=) so whole files go to slots."""

    def __init__(self, folder, sizes):
        self.paths, start = [], 0
        for k, size in enumerate(sizes):
            path = os.path.join(folder, f"part-{k}.txt")
            if state.is_main and not os.path.exists(path):
                with open(path + ".tmp", "w") as f:
                    f.write("\n".join(str(i) for i in range(start, start + size)))
                os.replace(path + ".tmp", path)
            self.paths.append(path)
            start += size
        ddpkit.barrier()
        self.n_shards = len(sizes)

    def shard(self, num_shards, index):
        assert num_shards == self.n_shards
        with open(self.paths[index]) as f:
            return [torch.tensor([int(line)]) for line in f]

    def __iter__(self):
        for k in range(self.n_shards):
            yield from self.shard(self.n_shards, k)


def ids(loader):
    seen, steps = [], 0
    for batch in loader:
        seen += batch.flatten().tolist()
        steps += 1
    return seen, steps


def everyone(values):
    return [v for part in ddpkit.gather_object(values) for v in part]


def streams(workers):
    result = {}
    for name, stream in (("generator", Counter(N)), ("files", files)):
        seen, _ = ids(ddpkit.data_loader(stream, batch_size=B, train=False, num_workers=workers))
        result[f"{name}_eval"] = sorted(everyone(seen))
        loader = ddpkit.data_loader(stream, batch_size=B, num_workers=workers, seed=1, shuffle_buffer=8)
        epochs = []
        for _ in range(2):
            seen, steps = ids(loader)
            epochs.append({"ids": everyone(seen), "steps": ddpkit.gather_object(steps)})
        result[f"{name}_train"] = epochs
    seen, steps = ids(ddpkit.data_loader(few, batch_size=2, num_workers=workers, shuffle=False))
    result["few_train"] = {"ids": everyone(seen), "steps": ddpkit.gather_object(steps)}
    seen, _ = ids(ddpkit.data_loader(few, batch_size=2, train=False, num_workers=workers))
    result["few_eval"] = sorted(everyone(seen))
    if hf is not None:
        seen = [int(i) for batch in ddpkit.data_loader(hf, batch_size=B, train=False, num_workers=workers)
                for i in batch["id"]]
        result["hf_eval"] = sorted(everyone(seen))
        steps = sum(1 for _ in ddpkit.data_loader(hf, batch_size=B, num_workers=workers, seed=1))
        result["hf_train_steps"] = ddpkit.gather_object(steps)
    return result


def uneven_steps():
    """Rank 0 has 3 batches, rank 1 has 7: "drop" ends both after 3; "join" only inside ddpkit.join."""
    os.makedirs(os.path.join(out, "uneven"), exist_ok=True)
    uneven = Files(os.path.join(out, "uneven"), [3 * B, 7 * B])  # slot 0: 3 batches, slot 1: 7 batches
    start = time.monotonic()
    _, steps = ids(ddpkit.data_loader(uneven, batch_size=B, shuffle=False))
    result = {"steps": ddpkit.gather_object(steps), "seconds": time.monotonic() - start}
    joined = ddpkit.data_loader(uneven, batch_size=B, shuffle=False, uneven="join")
    try:
        ids(joined)
    except RuntimeError as exc:
        result["join_outside"] = str(exc)
    model = ddpkit.prepare_model(torch.nn.Linear(1, 1))
    steps = 0
    with ddpkit.join(model):
        for batch in joined:
            model(batch.float()).sum().backward()
            steps += 1
    result["join_steps"] = ddpkit.gather_object(steps)
    return result


class Counted(IterableDataset):
    """One shard per rank, counting the samples this process read; the last rank's first ``slow`` take 0.6 s."""

    read = 0

    def __init__(self, n, make, slow=0):
        self.n, self.make, self.slow, self.n_shards = n, make, slow, state.world_size

    def shard(self, num_shards, index):
        for i in range(self.n):
            if i < self.slow and state.rank == state.world_size - 1:
                time.sleep(0.6)
            Counted.read += 1
            yield self.make(i)

    def __iter__(self):
        return self.shard(self.n_shards, 0)


def read_ahead(stream, steps):
    """Batches (of one sample) this rank had read beyond the one in hand, at each step."""
    Counted.read, ahead = 0, []
    for step, _ in enumerate(ddpkit.data_loader(stream, batch_size=1, shuffle=False, num_workers=0)):
        ahead.append(Counted.read - (step + 1))
        if step + 1 == steps:
            break
    return ahead


def windows():
    return {"slow": read_ahead(Counted(64, lambda i: torch.tensor([i]), slow=3), 60),
            "bytes": read_ahead(Counted(24, lambda i: b"\0" * (1 if i < 2 else 8 << 20)), 20),
            "huge": huge_batch_steps()}


def huge_batch_steps():
    """Steps over 40 one-sample batches where the 20th weighs 65 MiB: while it waits among the agreed batches,
    the hand is past 64 MiB, and a rank must still read (and offer) one more, or the pass would end there."""
    return sum(1 for _ in ddpkit.data_loader(Counted(40, lambda i: b"\0" * ((65 << 20) if i == 19 else 1)),
                                             batch_size=1, shuffle=False, num_workers=0))


folder = os.path.join(out, "files")
os.makedirs(folder, exist_ok=True)
files = Files(folder, [11, 17, 5, 23, 13, 9, 25])  # 103 ids in 7 files of uneven sizes
os.makedirs(os.path.join(out, "few"), exist_ok=True)
few = Files(os.path.join(out, "few"), [10, 14])  # 2 shards: fewer than the slots (and than 3 ranks)
try:  # Hugging Face datasets, streaming from local JSON-lines files (nothing downloaded)
    from datasets import load_dataset
except ImportError:
    load_dataset = None
hf = None
if load_dataset is not None:
    parts = []
    for k, size in enumerate([11, 17, 5, 23, 13, 9, 25]):
        path, first = os.path.join(folder, f"part-{k}.jsonl"), sum([11, 17, 5, 23, 13, 9, 25][:k])
        if state.is_main and not os.path.exists(path):
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps({"id": i}) + "\n" for i in range(first, first + size))
            os.replace(path + ".tmp", path)
        parts.append(path)
    ddpkit.barrier()
    hf = load_dataset("json", data_files=parts, split="train", streaming=True)
for workers in (0, 1, 2):
    result = streams(workers)
    if state.world_size == 2 and workers == 0:
        result["uneven"] = uneven_steps()
        result["windows"] = windows()
    if state.is_main:
        with open(os.path.join(out, f"streams{state.world_size}x{workers}.json"), "w") as f:
            json.dump(result, f)
