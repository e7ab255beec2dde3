"""Passes left early (fixed steps per epoch) and the script's own ``sampler.set_epoch``, on 2 processes (gloo):
every pass is the next epoch's order, ``loader.epoch`` follows, and a SIGKILL + resume is bitwise."""
import json

import pytest
import torch

from conftest import WORKERS, launch, ok
from ddpkit.data.samplers import ShardSampler

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


def test_a_checkpoint_on_an_epochs_last_step_resumes_with_the_per_epoch_code_run_once(tmp_path):
    """Resumed into the finished epoch, the pass is empty and the code after the inner loop (a per-epoch
    scheduler here) runs once for it, as in the uninterrupted run: bitwise the same weights. Reporting the
    next epoch instead (tried for issue 26) skipped that code: lr 0.1 where the run had 0.05."""
    import ddpkit

    ddpkit.init(cpu=True)
    data = torch.utils.data.TensorDataset(torch.randn(32, 3, generator=torch.Generator().manual_seed(0)),
                         torch.randn(32, 1, generator=torch.Generator().manual_seed(1)))

    def run(directory, kill_at=None):
        torch.manual_seed(0)
        model = ddpkit.prepare_model(torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        loader = ddpkit.data_loader(data, batch_size=8, seed=3)
        ckpt = ddpkit.Checkpointer(directory, resume=True)
        step, lrs = ckpt.restore(model=model, optimizer=opt, scheduler=sched, loader=loader), []
        for _ in range(loader.epoch, 3):
            for x, y in loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                step += 1
                lrs.append(opt.param_groups[0]["lr"])
                ckpt.save(step, model=model, optimizer=opt, scheduler=sched, loader=loader)
                if step == kill_at:
                    return None, lrs
            sched.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), lrs

    reference, reference_lrs = run(tmp_path / "a")
    for kill_at in (4, 5, 8):  # an epoch's last step (len(loader) == 4), the next epoch's first, the last again
        run(tmp_path / f"b{kill_at}", kill_at=kill_at)
        resumed, lrs = run(tmp_path / f"b{kill_at}")
        assert lrs == reference_lrs[kill_at:], kill_at
        assert torch.equal(resumed, reference), kill_at
