"""A script's worker_init_fn that seeds numpy alike on every rank (``np.random.seed(42 + worker_id)``) made both
ranks' workers draw the same numbers: a dataset that samples at random instead of reading its index trained
every rank on the same samples (the seventh held-out set's brain-segmentation script). Real 2-process launches."""
from conftest import launch, ok

DRAWS = """
import numpy as np, torch, torch.distributed as dist, ddpkit
from torch.utils.data import Dataset

class Random(Dataset):  # the sample is drawn, not read at its index
    def __len__(self):
        return 16
    def __getitem__(self, index):
        return torch.tensor(np.random.randint(10**9))

def worker_init(worker_id):
    np.random.seed(42 + worker_id)

state = ddpkit.init()
loader = ddpkit.data_loader(Random(), batch_size=4, num_workers=1, worker_init_fn=worker_init)
mine = torch.cat(list(loader))
both = [torch.empty_like(mine) for _ in range(2)]
dist.all_gather(both, mine)
if state.rank == 0:
    np.random.seed(42)  # what the script's own seed gives rank 0's worker
    print("shared", len(set(both[0].tolist()) & set(both[1].tolist())), "rank0-kept",
          both[0].tolist() == [np.random.randint(10**9) for _ in range(len(mine))])
ddpkit.shutdown()
"""


def test_ranks_workers_seeded_alike_by_the_script_draw_differently_and_rank_0_keeps_its_seeds(tmp_path):
    script = tmp_path / "draws.py"
    script.write_text(DRAWS)
    res = ok(launch(script))
    assert "shared 0 rank0-kept True" in res.stdout, res.stdout
    assert res.stderr.count("worker_init_fn seeds the workers alike on every rank") == 1, res.stderr
