"""Augmentation drawn in ``__getitem__`` across a SIGKILL + resume mid-epoch, 2 processes (gloo), as
docs/performance.md states it: read in the training process, every batch replays bit for bit; read by loader
workers (``persistent_workers=False``), the rest of the restored epoch gets fresh worker streams, and the epochs
after it replay bit for bit."""
import json

import pytest

from conftest import WORKERS, launch, ok

DIE_AT = 3  # mid-epoch 0 (5 steps an epoch): steps 4-5 finish epoch 0, 6-10 are epoch 1
REST_OF_EPOCH, NEXT_EPOCH = ["4", "5"], [str(s) for s in range(6, 11)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = tmp_path_factory.mktemp("resumed")
    r = launch(WORKERS / "worker_rng.py", res, "--die-at", DIE_AT)
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    r = ok(launch(WORKERS / "worker_rng.py", res, launcher_args=["--resume"]))
    assert f"ckpt-{DIE_AT:010d}" in r.stderr
    return [json.loads((res / f"aug-{rank}.json").read_text()) for rank in (0, 1)]


def same(reference, resumed, steps):
    return [resumed[s] == reference[s] for s in steps]


@pytest.mark.parametrize("rank", [0, 1])
def test_augmentation_in_the_training_process_replays_mid_epoch(runs, rank):
    reference, resumed = (runs[rank][run]["in_process"] for run in ("reference", "resumed"))
    assert sorted(resumed, key=int) == REST_OF_EPOCH + NEXT_EPOCH
    assert all(same(reference, resumed, REST_OF_EPOCH + NEXT_EPOCH))


@pytest.mark.parametrize("rank", [0, 1])
def test_worker_augmentation_replays_from_the_next_epoch_on(runs, rank):
    """The resumed pass starts its workers afresh at the restored position: each worker's stream starts over
    and the batches go to workers anew, so the rest of that epoch differs (the documented limit); the next
    epoch's workers take the same seeds as in the uninterrupted run."""
    reference, resumed = (runs[rank][run]["workers"] for run in ("reference", "resumed"))
    assert sorted(resumed, key=int) == REST_OF_EPOCH + NEXT_EPOCH
    assert not any(same(reference, resumed, REST_OF_EPOCH))
    assert all(same(reference, resumed, NEXT_EPOCH))
