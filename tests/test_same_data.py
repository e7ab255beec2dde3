"""Every rank shards the same training dataset (``ddpkit/data/same.py``): a dataset drawn at random with no seed,
an unseeded ``random_split`` (the held-out LSTM's ``train_test_split`` in torch's form), or one drawn after
``ddpkit.init(seed=...)`` gave each rank parts of different data, and the job trained on neither with no word.
Now every rank stops where the training loader is built, with one line; the same data on every rank trains."""
import pytest

from conftest import WORKERS, launch, ok

WORKER = WORKERS / "same_data.py"


@pytest.mark.parametrize("case, what", [("unseeded", "the samples it holds"), ("split", "its split's indices"),
                                        ("init_seed", "the samples it holds")])
def test_ranks_holding_different_training_data_stop_where_the_loader_is_built(case, what):
    r = launch(WORKER, case, timeout=120)
    assert r.returncode == 1 and "trained" not in r.stdout, r.stdout + r.stderr[-3000:]
    line = f"ddpkit.data_loader: the training dataset differs between ranks (rank 1's from rank 0's: {what})"
    assert line in r.stderr and "torch.manual_seed(0)" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("case", ["seeded", "seeded_split", "concat"])
def test_the_same_data_on_every_rank_trains(case):
    ok(launch(WORKER, case, timeout=120))
