"""Passes left early (fixed steps per epoch) and the script's own ``sampler.set_epoch``, on 2 processes (gloo):
every pass is the next epoch's order, ``loader.epoch`` follows, and a SIGKILL + resume is bitwise."""
import json

import pytest
import torch

from conftest import WORKERS, launch, ok
from ddpkit.data import ShardSampler

K = 3  # steps per epoch in tests/workers/epochs.py


def share(epoch, rank):
    """Rank ``rank``'s samples of ``epoch``: the documented order, randperm(seed + epoch), every 2nd from rank."""
    return torch.randperm(50, generator=torch.Generator().manual_seed(1 + epoch)).tolist()[rank::2]


@pytest.fixture(scope="module")
def order(tmp_path_factory):
    out = tmp_path_factory.mktemp("order")
    ok(launch(WORKERS / "epochs.py", out, "order"))
    return [json.loads((out / f"order-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pass_left_after_k_steps_is_followed_by_the_next_epoch(order, rank):
    got = order[rank]
    assert got["left_early"] == [share(epoch, rank)[:K * 4] for epoch in range(3)]
    assert got["epoch_after"] == [1, 2, 3]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_iterator_kept_unfinished_counts_as_its_epoch(order, rank):
    got = order[rank]
    assert got["after_held"] == share(4, rank)  # epoch 3 was the held pass
    assert got["epoch_after_held"] == 5


@pytest.mark.parametrize("rank", [0, 1])
def test_the_scripts_own_sampler_set_epoch_wins(order, rank):
    got = order[rank]
    assert got["set_epoch"] == [share(7, rank), share(7, rank), share(2, rank)]
    assert got["epoch_read"] == [7, 7, 2] and got["epoch_after_set"] == 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    ok(launch(WORKERS / "epochs.py", out, "train"))
    return torch.load(out / "final.pt")


@pytest.mark.parametrize("idiom, die_at, resumed_from", [
    ("plain", 5, 3),       # saved after epoch 0's loop was left: resumes at epoch 1
    ("set-epoch", 7, 6),   # saved on the step that leaves epoch 1: set_epoch(step // K) moves on to epoch 2
    ("set-epoch", 5, 4),   # saved mid-epoch 1: set_epoch(1) keeps the restored position
])
def test_sigkill_then_resume_with_fixed_steps_per_epoch_is_bitwise(tmp_path, reference, idiom, die_at, resumed_from):
    r = launch(WORKERS / "epochs.py", tmp_path, "train", "--idiom", idiom, "--die-at", die_at)
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    r = ok(launch(WORKERS / "epochs.py", tmp_path, "train", "--idiom", idiom, launcher_args=["--resume"]))
    assert f"ckpt-{resumed_from:010d}" in r.stderr
    b = torch.load(tmp_path / "final.pt")
    assert (b["step"], b["epoch"]) == (reference["step"], reference["epoch"]) == (3 * K, 3)
    assert all(torch.equal(reference["weights"][k], b["weights"][k]) for k in reference["weights"])


@pytest.mark.parametrize("epoch", ["1", 1.5, -1])
def test_set_epoch_refuses_what_is_not_an_epoch_number(epoch):
    with pytest.raises(ValueError, match=r"set_epoch\(.*\).*expected an epoch number"):
        ShardSampler(10, rank=0, world_size=1).set_epoch(epoch)


def test_an_older_iterator_does_not_count_into_the_current_pass():
    """A look at the training loader inside its own loop (one batch, then leave) is a pass of its own; the outer
    loop, carrying on, must not move the position of the pass after it."""
    import ddpkit

    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.arange(32)), batch_size=4, seed=1)
    for i, _ in enumerate(loader):
        if i == 1:
            for _ in loader:  # the look: a pass, of epoch 1, left at once
                break
    assert loader.state_dict() == {"epoch": 2, "position": 0}  # between passes: no position inside an epoch
    assert len(list(loader)) == 8 and loader.epoch == 3


def test_the_sampler_still_copies():
    import copy
    import pickle

    import ddpkit

    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.arange(8)), batch_size=2)
    loader.sampler.set_epoch(2)
    for clone in (copy.deepcopy(loader.sampler), pickle.loads(pickle.dumps(loader.sampler))):
        assert list(clone) == list(loader.sampler) and clone.on_set_epoch is None


@pytest.mark.parametrize("sampler", [None, "random"])
def test_set_epoch_after_iter_before_the_first_batch_applies_to_the_next_pass(sampler):
    """``it = iter(loader); loader.set_epoch(1)`` then the loop: the open pass is epoch 0 and keeps epoch 0's
    order (it read epoch 1's, counted as epoch 0, so the next pass repeated the same order)."""
    import ddpkit

    ddpkit.init(cpu=True)
    data = torch.utils.data.TensorDataset(torch.arange(20))

    def build():
        own = {} if sampler is None else {"sampler": torch.utils.data.RandomSampler(data)}
        return ddpkit.data_loader(data, batch_size=4, **own)

    ids = lambda batches: [i for (b,) in batches for i in b.tolist()]  # noqa: E731
    reference = build()
    epochs = [ids(reference), ids(reference)]
    loader = build()
    it = iter(loader)
    loader.set_epoch(1)
    assert ids(it) == epochs[0] and loader.epoch == 1
    assert ids(loader) == epochs[1] and loader.epoch == 2


def test_a_checkpoint_on_an_epochs_last_step_resumes_in_the_next_epoch():
    """``ckpt.save`` inside the loop on the step that ends epoch 0 (step-based saving): the resumed loop,
    ``range(loader.epoch, epochs)``, must start at epoch 1 with epoch 1's order, as after the loop; it re-entered
    epoch 0 with an empty pass, so the script's per-epoch code (evaluation, scheduler.step) ran twice for it."""
    import ddpkit

    ddpkit.init(cpu=True)
    data = torch.utils.data.TensorDataset(torch.arange(16))
    build = lambda: ddpkit.data_loader(data, batch_size=4, seed=1, generator=torch.Generator().manual_seed(5))  # noqa: E731
    loader, orders = build(), []
    for epoch in range(loader.epoch, 2):
        orders.append([])
        for i, (x,) in enumerate(loader):
            orders[-1] += x.tolist()
            if epoch == 0 and i == len(loader) - 1:
                saved, generator = loader.state_dict(), loader.generator_state()
    resumed = build()
    resumed.load_state_dict(saved)
    resumed.generator.set_state(generator)
    assert saved == {"epoch": 1, "position": 0} and list(range(resumed.epoch, 2)) == [1]
    assert [i for (x,) in resumed for i in x.tolist()] == orders[1]
    assert torch.equal(resumed.generator.get_state(), loader.generator.get_state())  # the same worker seeds drawn


def test_a_resumed_mid_epoch_pass_that_reaches_its_end_counts_as_finished():
    import ddpkit

    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(torch.utils.data.TensorDataset(torch.arange(16)), batch_size=4, seed=1)
    loader.load_state_dict({"epoch": 2, "position": 8})
    states = [loader.state_dict() for _ in loader]
    assert states == [{"epoch": 2, "position": 12}, {"epoch": 3, "position": 0}]
