"""DataLoader defaults: workers from the cores for per-sample datasets, none for in-memory tensors; the
batches are the same as without workers."""
import sys

from conftest import ok, run_cmd

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
