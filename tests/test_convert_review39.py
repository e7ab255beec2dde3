"""Review 39 (a reviewer who wrote none of it, on d320c97..the last fixes of set 25): each defect it showed, as a
case in our own words."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

DATA = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
        "def get_loader(x, y, bs, train=True):\n"
        "    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=train)\n")
MAIN = '''import torch
import data

xs, ys, vx, vy = torch.randn(64, 4), torch.randn(64, 1), torch.randn(16, 4), torch.randn(16, 1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = data.get_loader(xs, ys, 16{flag})
for x, y in train_loader:
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
with torch.no_grad():
{evaluation}
'''


@pytest.mark.parametrize("flag, evaluation", [
    ("", "    val = sum(((model(x) - y) ** 2).mean().item() for x, y in data.get_loader(vx, vy, 8))"),
    (", train=True", "    val = sum(((model(x) - y) ** 2).mean().item()\n"
                     "              for x, y in data.get_loader(vx, vy, 8, train=False))"),
    (", train=True", "    val = 0.0\n    for x, y in data.get_loader(vx, vy, 8, train=False):\n        val += 1.0"),
    ("", "    val = evaluate(model, data.get_loader(vx, vy, 8))"),
])
def test_an_evaluation_iterating_the_training_loader_function_in_place_is_refused(flag, evaluation):
    """D02 / D03 / D09: the training loader bound from ``data.get_loader(...)``, an evaluation iterating (or handed)
    another call of it in place, with or without ``train=False``: that call's loader is the same DataLoader line,
    made a training one (each rank evaluated its half, nothing said)."""
    files = {"data.py": DATA, "main.py": MAIN.format(flag=flag, evaluation=evaluation)}
    plans = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))
    assert plans["main.py"].refused and "also builds the training loader" in plans["main.py"].left[0].what, \
        plans["main.py"].left


def test_a_random_id_object_is_not_broadcast_as_text():
    """D04: ``run_id = uuid.uuid4()`` (an object) became ``ddpkit.broadcast(uuid.uuid4())``: not JSON, every rank
    raised. Only a text made of it is broadcast."""
    src = ("import uuid\nimport torch\nfrom torch.utils.data import DataLoader\nrun_id = uuid.uuid4()\n"
           "name = f'run-{run_id.hex[:6]}'\nloader = DataLoader(ds, batch_size=8, shuffle=True)\n"
           "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n"
           "    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n")
    text = plan(src).text
    assert "run_id = uuid.uuid4()\n" in text and "ddpkit.broadcast(uuid" not in text, text


def test_a_script_that_splits_its_data_by_rank_itself_is_left_to_it():
    """D05: the data split by ``state.rank`` by hand (as the "fed by hand" refusal advises), ``ddpkit.init()`` and
    a backward: once an ``import ddpkit`` alone stopped counting, this was refused with its own advice."""
    src = ("import torch\nimport ddpkit\nstate = ddpkit.init()\ndata = torch.randn(256, 4)\n"
           "mine = data[state.rank::state.world_size]\nmodel = torch.nn.Linear(4, 1)\n"
           "opt = torch.optim.SGD(model.parameters(), lr=0.05)\nfor i in range(0, len(mine), 16):\n"
           "    x = mine[i:i + 16]\n    opt.zero_grad()\n    model(x).pow(2).mean().backward()\n    opt.step()\n")
    assert not plan(src).refused, plan(src).left


def test_a_count_scaled_by_the_world_size_does_not_hide_a_summed_loss():
    """D07: ``seen += x.size(0) * state.world_size`` in the loop hid the summed-loss line (steps 1/N with SGD)."""
    src = ("import torch\nimport ddpkit\nfrom torch.utils.data import DataLoader\nstate = ddpkit.init()\n"
           "loader = DataLoader(ds, batch_size=16)\nmodel = torch.nn.Linear(4, 1)\n"
           "opt = torch.optim.SGD(model.parameters(), lr=0.01)\nseen = 0\nfor x, y in loader:\n    opt.zero_grad()\n"
           "    loss = torch.nn.functional.mse_loss(model(x), y, reduction='sum')\n    loss.backward()\n"
           "    opt.step()\n    seen += x.size(0) * state.world_size\n")
    assert any("a sum over the batch" in x.what for x in plan(src).left), plan(src).left


def test_batches_wrapped_by_another_modules_function_around_its_loader_are_followed():
    """D08: ``train_dl, _ = utils.get_data(...)`` then ``for x, y in utils.on_device(train_dl, device):``: refused
    as iterated in place, though the loader handed in is utils.py's own (converted there before)."""
    utils = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef get_data(bs):\n"
             "    ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
             "    return DataLoader(ds, batch_size=bs, shuffle=True), None\n\n\ndef on_device(dl, device):\n"
             "    for x, y in dl:\n        yield x.to(device), y.to(device)\n")
    main = ("import torch\nimport utils\ndevice = 'cpu'\ntrain_dl, _ = utils.get_data(16)\n"
            "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for x, y in utils.on_device(train_dl, device):\n    opt.zero_grad()\n"
            "    ((model(x) - y) ** 2).mean().backward()\n    opt.step()\n")
    files = {"utils.py": utils, "main.py": main}
    plans = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))
    assert not plans["main.py"].refused, plans["main.py"].left
