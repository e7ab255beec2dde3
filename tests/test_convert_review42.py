"""Review 42 (a reviewer on the twenty-seventh set's fixes, /work/review42_out): each defect it reproduced, in our
own words, failing on the tree it reviewed (bb926c4)."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

LOOP = '''loader = DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=16, shuffle=True)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
'''
HEAD = "import torch, torch.nn as nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
EVALUATE = ("import torch, torch.nn as nn\n\n\ndef evaluate(path):\n"
            "    nn.Linear(8, 1).load_state_dict(torch.load(path))\n")


def _project(files):
    return settle(list(files), lambda rel, c: plan(files[rel], crossing=c))


def test_a_save_helper_a_caller_runs_under_its_ranks_test_gets_no_barrier():
    """D01: ``save_checkpoint`` of utils.py, called by main.py under ``if loss.item() < best:`` (each rank its own
    loss), got a barrier inside it: rank 0 waited there while rank 1 went on to its next all-reduce (a hang)."""
    files = {"utils.py": "import torch\n\n\ndef save_checkpoint(model, path):\n"
                         "    torch.save(model.state_dict(), path)\n",
             "evaluate.py": EVALUATE,
             "main.py": HEAD + "from utils import save_checkpoint\nfrom evaluate import evaluate\n" + LOOP +
             "best = 1e9\nfor epoch in range(3):\n    for x, y in loader:\n        opt.zero_grad()\n"
             "        loss = nn.functional.mse_loss(model(x), y)\n        loss.backward()\n        opt.step()\n"
             "    if loss.item() < best:\n        best = loss.item()\n        save_checkpoint(model, 'best.pt')\n"
             "evaluate('best.pt')\n"}
    assert "barrier" not in _project(files)["utils.py"].text


def test_a_save_a_continue_on_the_ranks_loss_routes_around_gets_no_barrier():
    """D02: the save in the epoch loop below ``if loss.item() > best: continue`` got a barrier a rank may skip."""
    train = (HEAD + "\n\ndef train():\n" +
             "".join("    " + line + "\n" for line in LOOP.splitlines()) +
             "    best = 1e9\n    for epoch in range(3):\n        for x, y in loader:\n            opt.zero_grad()\n"
             "            loss = nn.functional.mse_loss(model(x), y)\n            loss.backward()\n"
             "            opt.step()\n        if loss.item() > best:\n            continue\n"
             "        best = loss.item()\n        torch.save(model.state_dict(), 'model.pt')\n")
    files = {"main.py": "import train_part\nimport evaluate\n\ntrain_part.train()\nevaluate.evaluate('model.pt')\n",
             "evaluate.py": EVALUATE, "train_part.py": train}
    assert "barrier" not in _project(files)["train_part.py"].text


MKDIR = '''import os, sys
import torch
from torch.utils.data import DataLoader, TensorDataset

log_dir = "runs/a"
{made}
''' + LOOP.replace("model", "net").replace("256, 8), torch.randn(256, 1)",
                                         "32, 8), torch.randn(32, 1)") + '''for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
'''


def test_a_try_made_folder_under_the_scripts_own_exists_test_is_not_made_rank_0s():
    """D03: under ``if not os.path.exists(d):`` a rank that tests after rank 0 made the folder skips the block, and
    the barrier the conversion put in it (a hang)."""
    made = ("if not os.path.exists(log_dir):\n    try:\n        os.mkdir(log_dir)\n    except FileExistsError:\n"
            "        sys.exit(1)")
    text = plan(MKDIR.format(made=made).replace("nn.Linear", "torch.nn.Linear")).text
    assert "barrier" not in text and "exist_ok=True" in text, text


def test_a_try_whose_handler_sets_a_name_is_listed_not_made_rank_0s():
    """D04: ``except FileExistsError: resume = True`` ran on rank 0 alone: rank 0 resumed at epoch 2, rank 1 began
    at 0 (the second launch failed)."""
    made = "resume = False\ntry:\n    os.mkdir(log_dir)\nexcept FileExistsError:\n    resume = True\nprint(resume)"
    p = plan(MKDIR.format(made=made).replace("nn.Linear", "torch.nn.Linear"))
    assert "barrier" not in p.text and any("handler sets names" in x.what for x in p.left), [x.what for x in p.left]


def test_a_converted_try_made_folder_converts_to_itself():
    """D08: converting the output again guarded the guarded try a second time, its barrier inside rank 0's block."""
    made = "try:\n    os.mkdir(log_dir)\nexcept FileExistsError:\n    sys.exit(1)"
    once = plan(MKDIR.format(made=made).replace("nn.Linear", "torch.nn.Linear")).text
    assert plan(once).text == once


SUBCLASSED = {"mod.py": '''import torch, torch.nn as nn, torch.nn.functional as F


class OldNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.1)

    def forward(self, x):
        return self.fc(x)

    def train_(self, x, y):
        self.optimizer.zero_grad()
        F.cross_entropy(self(x), y).backward()
        self.optimizer.step()


class Net(OldNet):
    pass
''', "main.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset
from mod import Net

loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), batch_size=16, shuffle=True)
model = Net()
for x, y in loader:
    model.train_(x, y)
'''}


def test_a_self_training_class_a_subclass_of_which_is_built_still_refuses():
    """D07: ``class Net(OldNet)`` built by main.py runs OldNet's optimizer and step: kept as "nothing runs it", each
    rank trained its own copy."""
    assert any(x.blocks for x in _project(SUBCLASSED)["mod.py"].left)


WIDE = LOOP.replace("nn.Linear(8, 1)", "nn.Linear(8, 8)").replace("torch.randn(256, 1)", "torch.randn(256, 8)")
MEANS = HEAD + WIDE + '''for epoch in range(2):
    train_loss, num_iter = 0.0, 0
    for x, y in loader:
        num_iter += 1
        opt.zero_grad()
        out = model(x)
        loss = {loss}
        loss.backward()
        opt.step()
        train_loss += loss.item()
    print(train_loss / num_iter)
'''


def test_a_sum_of_mean_losses_is_no_summed_loss():
    """D05: ``torch.stack([mse, l1]).sum()`` was taken for a loss summed over the batch: its running total summed
    across ranks printed twice the original's."""
    p = plan(MEANS.format(loss="torch.stack([nn.functional.mse_loss(out, y), nn.functional.l1_loss(out, y)]).sum()"))
    assert "train_loss = ddpkit.reduce(train_loss, op='mean')" in p.text and not p.left, [x.what for x in p.left]


def test_an_elementwise_sum_stepped_by_sgd_is_listed_as_a_summed_loss():
    """Beside D05: ``loss = ((out - y) ** 2).sum()`` under SGD (steps N times smaller) was not listed."""
    p = plan(MEANS.format(loss="((out - y) ** 2).sum()"))
    assert any("a sum over the batch" in x.what for x in p.left), [x.what for x in p.left]


def test_a_library_import_in_a_function_does_not_override_the_files_own_class():
    """D06: ``from torch.utils.data import DataLoader`` in a function made the file's own ``class DataLoader``
    torch's: ``DataLoader(X, Y, 32)`` became ``ddpkit.data_loader(X, global_batch_size=Y, shuffle=32)``."""
    src = HEAD.replace("from torch.utils.data import DataLoader, TensorDataset\n", "") + '''

class DataLoader:
    def __init__(self, x, y, batch_size):
        self.x, self.y, self.bs = x, y, batch_size

    def __iter__(self):
        for i in range(0, len(self.x), self.bs):
            yield self.x[i:i + self.bs], self.y[i:i + self.bs]


def evaluate(model, ds):
    from torch.utils.data import DataLoader
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(x), y).item() for x, y in DataLoader(ds, batch_size=16))


X, Y = torch.randn(256, 8), torch.randn(256, 1)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(X, Y, 32):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
'''
    assert "data_loader(X" not in plan(src).text


def test_a_pathlib_file_kept_open_for_writing_is_listed_not_given_devnull_as_its_mode():
    """D10: ``self.f = self.path.open("a")`` got ``os.devnull`` as its first argument, pathlib's mode (rank 1
    crashed: invalid mode)."""
    src = HEAD + '''from pathlib import Path


class History:
    def __init__(self, path):
        self.f = Path(path).open("a")


''' + LOOP + '''hist = History("history.csv")
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    hist.f.write("step\\n")
'''
    p = plan(src)
    assert "devnull" not in p.text and any("path.open" in x.what for x in p.left), [x.what for x in p.left]


def test_a_token_criterion_handed_to_the_training_function_is_listed():
    """D11: ``criterion`` handed to ``train_epoch(net, loader, criterion, opt)`` and called by name only in
    ``validate()`` was taken for an evaluation's alone: the token-mean line dropped."""
    src = HEAD + '''x = torch.randint(1, 20, (64, 6))
y = torch.randint(0, 20, (64, 6))
train_loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
val_loader = DataLoader(TensorDataset(x, y), batch_size=16)
net = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss(ignore_index=2)


def train_epoch(model, loader, loss_fn, optimizer):
    for src, tgt in loader:
        optimizer.zero_grad()
        loss_fn(model(src).view(-1, 20), tgt.view(-1)).backward()
        optimizer.step()


def validate():
    with torch.no_grad():
        return sum(criterion(net(s).view(-1, 20), t.view(-1)).item() for s, t in val_loader)


train_epoch(net, train_loader, criterion, opt)
print(validate())
'''
    assert any("tokens it does not ignore" in x.what for x in plan(src).left)


def test_a_mean_loss_beside_a_summed_one_is_said_a_mean():
    """D09: once a loss of the file was summed, a second model's mean loss ``aux`` shown was said "a sum over its
    1/N ... op='sum'" (following it would print N times its value)."""
    src = HEAD + '''loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 2)), batch_size=16)
model, head = nn.Linear(8, 2), nn.Linear(2, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
opt2 = torch.optim.Adam(head.parameters(), lr=1e-3)
for epoch in range(2):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y, reduction="sum")
        opt.zero_grad()
        loss.backward()
        opt.step()
        aux = nn.functional.mse_loss(head(model(x).detach()), y[:, :1])
        opt2.zero_grad()
        aux.backward()
        opt2.step()
    print(epoch, aux.item())
'''
    why = [k.why for k in plan(src).kept if "aux" in k.what]
    assert why and "a mean over its 1/N" in why[0], why


def test_a_token_count_told_in_a_helper_the_builder_hands_off_to_is_seen():
    """D12: ``get_dataloader`` returns ``_loader(...)``, whose ``ddpkit.data_loader`` is told ``batch_count=``:
    the token-mean line stayed listed after its own fix."""
    files = {"data.py": '''import torch, ddpkit
from torch.utils.data import TensorDataset


def _loader(ds, batch_size):
    return ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True, batch_count=lambda b: 1)


def get_dataloader(batch_size):
    src = torch.randint(1, 50, (256, 10))
    return _loader(TensorDataset(src, src.clone()), batch_size)
''', "main.py": '''import torch, torch.nn as nn
from data import get_dataloader

loader = get_dataloader(32)
model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
criterion = nn.CrossEntropyLoss(ignore_index=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for src, tgt in loader:
    loss = criterion(model(src[:, :-1]).reshape(-1, 50), tgt[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''}
    assert not any("tokens it does not ignore" in x.what for x in _project(files)["main.py"].left)
