"""DataLoader defaults: workers from the cores for per-sample datasets, none for in-memory tensors; the
batches are the same as without workers."""
import sys

import torch

from conftest import launch, ok, run_cmd
from ddpkit.data.settings import loader_defaults

SCRIPT = """
import os, torch, ddpkit
from torch.utils.data import TensorDataset
class Squares(torch.utils.data.Dataset):  # work per sample: the kind that gets workers
    def __len__(self): return 40
    def __getitem__(self, i): return torch.tensor([float(i * i)])
ddpkit.init(mode="single")
auto = ddpkit.data_loader(Squares(), batch_size=8, seed=5)
plain = ddpkit.data_loader(Squares(), batch_size=8, seed=5, num_workers=0)
tensors = ddpkit.data_loader(TensorDataset(torch.zeros(40, 1)), batch_size=8)
cores = len(os.sched_getaffinity(0))
assert auto.num_workers == min(4, cores - 1) and tensors.num_workers == 0 and plain.num_workers == 0
assert auto.persistent_workers == (auto.num_workers > 0)
for epoch in range(2):  # same order as without workers, epoch after epoch
    assert [b.tolist() for b in auto] == [b.tolist() for b in plain]
print("workers", auto.num_workers)
"""


def test_per_sample_datasets_get_workers_and_the_same_batches(tmp_path):
    script = tmp_path / "loader.py"
    script.write_text(SCRIPT)
    r = ok(run_cmd([sys.executable, str(script)], timeout=120))
    assert r.stdout.startswith("workers ")


class Drawing(torch.utils.data.Dataset):
    """Draws from the global RNG and counts its reads, as an augmenting (or lazily opening) dataset does."""

    def __init__(self):
        self.reads = 0

    def __len__(self):
        return 10

    def __getitem__(self, i):
        self.reads += 1
        return torch.rand(2), i


def test_the_cuda_pin_decision_reads_no_sample():
    """Deciding pin_memory on CUDA once read dataset[0] in the main process: a GPU run drew from the global RNG
    (a CPU run did not) and opened lazily opened files before the workers forked."""
    data = Drawing()
    before = torch.get_rng_state()
    with_workers = loader_defaults(data, "cuda", 8)
    in_process = loader_defaults(data, "cuda", 8, num_workers=0)
    assert data.reads == 0 and torch.equal(before, torch.get_rng_state())
    assert with_workers["pin_memory"] is True  # batches from worker processes are in CPU memory
    assert "pin_memory" not in in_process  # in-process samples may be CUDA tensors: not known without one
    assert loader_defaults(data, "cpu", 8) == {k: v for k, v in with_workers.items() if k != "pin_memory"}


def test_data_loader_on_the_cuda_path_reads_no_sample(monkeypatch):
    """data_loader's own construction, with the process's device taken for cuda (the decision reads only its
    type): the dataset is not indexed and the global RNG is where it was."""
    import dataclasses

    import ddpkit
    from ddpkit.core import process
    state = ddpkit.init(cpu=True)
    monkeypatch.setattr(process.current(), "state", dataclasses.replace(state, device=torch.device("cuda", 0)))
    data = Drawing()
    before = torch.get_rng_state()
    for workers in (0, 2):
        loader = ddpkit.data_loader(data, batch_size=4, num_workers=workers)
        assert loader.pin_memory == (workers > 0)
    assert data.reads == 0 and torch.equal(before, torch.get_rng_state())


def test_a_subset_of_cpu_tensors_pins_like_the_tensors():
    """random_split returns Subsets: a Subset (of a Subset) of a CPU TensorDataset read in the training process
    has batches in CPU memory, so it pins as the TensorDataset does; no sample is read to decide."""
    from torch.utils.data import Subset, TensorDataset

    from ddpkit.data.settings import pinnable

    tensors = TensorDataset(torch.zeros(8, 2))
    train, _ = torch.utils.data.random_split(tensors, [6, 2], generator=torch.Generator().manual_seed(0))
    assert pinnable(train, 0) and pinnable(Subset(train, [0, 1]), 0)
    assert loader_defaults(Subset(train, [0, 1]), "cuda", 8) == {"pin_memory": True}  # in memory: no workers
    assert not pinnable(Subset(Drawing(), [0, 1]), 0)  # samples of unknown kind: not pinned, not read


DROPPED = """
import torch, ddpkit
from torch.utils.data import TensorDataset
ddpkit.init()
for n in (175, 176, 190):
    loader = ddpkit.data_loader(TensorDataset(torch.arange(n)), global_batch_size=16, drop_last=True)
    steps = [len(b[0]) for b in loader]
    print(n, len(loader), len(steps), set(steps))
"""


def test_drop_last_with_a_global_batch_takes_as_many_steps_as_one_process(tmp_path):
    """PatchTST's training loader (``drop_last=True``, 175 windows, batch 16): 10 steps at one process, but 11 at
    two, the shards padded to 88 each before the per-process batches of 8 dropped nothing. Unsaid: a longer epoch."""
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    r = ok(launch(script, nproc=2, timeout=120))
    assert [line.split()[:3] for line in r.stdout.splitlines() if line[:1].isdigit()] == \
        [[str(n), str(n // 16), str(n // 16)] for n in (175, 176, 190)], r.stdout
    assert "{8}" in r.stdout
