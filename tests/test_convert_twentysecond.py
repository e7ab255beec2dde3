"""What the twenty-second held-out set and its run-up showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402


def _settled(files):
    return settle(list(files), lambda rel, c: plan(files[rel], crossing=c))


# the training loop and its best-model save live in trainer.py; the entry trains through it, then reads the best
# model back: rank 0 alone writes it once converted, so another rank could read it half-written (an EOFError)
TRAINER = '''import torch
import torch.nn as nn


def train(model, loader, optimizer, save_path, epochs=1):
    best = float("inf")
    for epoch in range(epochs):
        total = 0.0
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
        if total < best:
            best = total
            torch.save(model.state_dict(), save_path)
'''
ENTRY = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import train

if __name__ == "__main__":
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 4)), batch_size=16, shuffle=True)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
{body}'''


def test_a_checkpoint_another_module_saves_while_training_is_waited_for_before_it_is_read():
    body = '    train(model, loader, optimizer, "best.pth")\n    model.load_state_dict(torch.load("best.pth"))\n'
    plans = _settled({"trainer.py": TRAINER, "main.py": ENTRY.format(body=body)})
    lines = plans["main.py"].text.splitlines()
    at = next(i for i, x in enumerate(lines) if "torch.load" in x)
    assert lines[at - 1].strip() == "ddpkit.barrier()", plans["main.py"].text
    assert lines[at - 2].strip().startswith("train("), plans["main.py"].text


def test_a_read_after_another_modules_training_inside_a_loop_is_said_not_waited_for():
    # (one run per seed: the barrier would do there, but a loop is not one every rank is known to pass alike)
    body = ('    for seed in [1, 2]:\n        train(model, loader, optimizer, f"best{seed}.pth")\n'
            '        model.load_state_dict(torch.load(f"best{seed}.pth"))\n')
    plans = _settled({"trainer.py": TRAINER, "main.py": ENTRY.format(body=body)})
    assert "ddpkit.barrier()" not in plans["main.py"].text
    assert any("another rank may read it before rank 0 has written it" in x.what and x.line == 13
               for x in plans["main.py"].left), plans["main.py"].left


def test_a_read_of_what_this_file_wrote_before_calling_another_modules_trainer_gets_no_barrier_of_its_own():
    # (the entry saves its own config first: rules.py's save-then-read, not a checkpoint of training)
    body = ('    torch.save({"lr": 1e-3}, "cfg.pt")\n    train(model, loader, optimizer, "best.pth")\n'
            '    cfg = torch.load("cfg.pt")\n')
    text = _settled({"trainer.py": TRAINER, "main.py": ENTRY.format(body=body)})["main.py"].text
    assert "ddpkit.barrier()\n    cfg = torch.load" not in text, text


# an LSTM notebook's two experiments: each builds its own model and hands it to one training function
TWO_CALLERS = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def train_model(model, train_loader, epochs=2):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        for xb, yb in train_loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    return model


def part(seed):
    torch.manual_seed(seed)
    loader = DataLoader(TensorDataset(torch.randn(64, 5), torch.randn(64, 1)), batch_size=16, shuffle=True)
    {first}
    train_model(model, loader)


def other():
    loader = DataLoader(TensorDataset(torch.randn(64, 5), torch.randn(64, 1)), batch_size=16, shuffle=True)
    net = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 1))
    train_model(net, loader)


if __name__ == "__main__":
    part(0)
    other()
'''


def test_a_model_two_callers_build_and_hand_to_one_training_function_is_prepared_where_each_builds_it():
    done = plan(TWO_CALLERS.format(first="model = nn.Linear(5, 1)"))
    assert not done.refused, done.left
    assert "    model = ddpkit.prepare_model(nn.Linear(5, 1))" in done.text, done.text
    assert "    net = ddpkit.prepare_model(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 1)))" in done.text, done.text
    assert "opt = torch.optim.Adam(model.parameters(), lr=1e-3)" in done.text


def test_a_caller_that_hands_in_what_it_did_not_build_is_still_refused():
    # (``model`` of part() is bound nowhere this file shows: no wrap is made up for it)
    done = plan(TWO_CALLERS.format(first="pass"))
    assert done.refused and any("where it is built was not found" in x.what for x in done.left), done.left


# early stopping on a validation list kept over the training loader: refused; the named fix (a DataLoader of its
# own) must then convert with every rank evaluating the whole set, so that every rank stops at the same epoch
EARLY = '''import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

train_ds = TensorDataset(torch.randn(64, 5), torch.randn(64, 1))
val_ds = TensorDataset(torch.randn(40, 5), torch.randn(40, 1))
loader = DataLoader(train_ds, batch_size=16, shuffle=True)
{val}
model = nn.Linear(5, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
best, wait = float("inf"), 0
for epoch in range(30):
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    va = []
    with torch.no_grad():
        for xb, yb in {over}:
            va.append(nn.functional.mse_loss(model(xb), yb).item())
    if np.mean(va) < best:
        best, wait = np.mean(va), 0
    else:
        wait += 1
        if wait >= 2:
            break
'''


def test_the_named_fix_for_an_evaluation_kept_over_the_training_loader_converts_with_the_whole_set_on_every_rank():
    done = plan(EARLY.format(val="", over="loader"))
    assert done.refused, done.text
    fix = next(x.fix for x in done.left if "each rank would evaluate only its shard" in x.what)
    assert "DataLoader(dataset, batch_size)" in fix and "train=False" not in fix, fix
    fixed = plan(EARLY.format(val="val_loader = DataLoader(val_ds, batch_size=16)", over="val_loader"))
    assert not fixed.refused, fixed.left
    assert "\nval_loader = DataLoader(val_ds, batch_size=16)\n" in fixed.text, fixed.text


# a GAN book's trainer: the discriminator's class is another module's (one of two, picked by a flag), and its
# criterion is an attribute (``self.adv_loss = nn.MSELoss()``) called on the outputs: no method to run as forward
GAN_LOSS = '''import torch
from torch.utils.data import DataLoader
from models import pick

netD = pick(args.model)
opt = torch.optim.Adam(netD.parameters(), lr=2e-4)
for data, target in DataLoader(ds, batch_size=8, shuffle=True):
    opt.zero_grad()
    y_real = netD(data)
    real = torch.full((data.size(0), 1), 1.0)
    loss = netD.adv_loss(y_real, real) + netD.{other}
    loss.backward()
    opt.step()
'''


def test_a_criterion_called_on_the_models_own_outputs_is_no_forward_method():
    text = plan(GAN_LOSS.format(other="class_loss(y_real, target)")).text
    assert "netD = ddpkit.prepare_model(pick(args.model))\n" in text, text


def test_a_method_fed_the_batch_itself_is_still_run_as_the_forward():
    # (pytorch-flows' ``log_probs(x)``: the layers run inside it, so it must be DDP's forward)
    text = plan(GAN_LOSS.format(other="log_probs(data).mean()")).text
    assert "netD = ddpkit.prepare_model(pick(args.model), forward_methods=('log_probs',))\n" in text, text


# a GAN book's project: the Model class trains on the loader handed to its constructor and saves / loads in two
# methods; main.py builds it with the loader to train (then saves), or with None to evaluate (after a load)
BUILD = '''import torch
import torch.nn as nn


class Model(object):
    def __init__(self, data_loader):
        self.data_loader = data_loader
        self.net = nn.Linear(4, 1)
        self.optim = torch.optim.Adam(self.net.parameters(), lr=1e-3)

    def train(self, epochs):
        for epoch in range(epochs):
            for x, y in self.data_loader:
                self.optim.zero_grad()
                nn.functional.mse_loss(self.net(x), y).backward()
                self.optim.step()

    def save_to(self, path):
        torch.save(self.net.state_dict(), path)

    def load_from(self, path):
        self.net.load_state_dict(torch.load(path))
'''
MAIN = '''import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from build_gan import Model


def main(train):
    if train:
        loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
        model = Model(loader)
        model.train(2)
        model.save_to("m.pt")
    else:
        model = Model(None)
        model.load_from("m.pt")
{more}

if __name__ == "__main__":
    main(sys.argv[1:] == [])
'''


def test_a_loader_handed_in_by_one_caller_and_none_by_another_is_said_converted():
    plans = _settled({"build_gan.py": BUILD, "main.py": MAIN.format(more="")})
    trainer = plans["build_gan.py"]
    assert not [x for x in trainer.left if "not made a training ddpkit.data_loader" in x.what], trainer.left
    assert "ddpkit.data_loader(" in plans["main.py"].text


def test_methods_that_save_and_load_run_apart_by_their_callers_owe_no_barrier():
    plans = _settled({"build_gan.py": BUILD, "main.py": MAIN.format(more="")})
    assert not [x for x in plans["build_gan.py"].left if "read at line" in x.what], plans["build_gan.py"].left


def test_methods_that_save_then_load_one_after_the_other_still_owe_one():
    more = '    model.save_to("m.pt")\n    Model(None).load_from("m.pt")\n'
    plans = _settled({"build_gan.py": BUILD, "main.py": MAIN.format(more=more)})
    told = plans["build_gan.py"].left + [x for x in plans["build_gan.py"].kept if "barrier" in x.why]
    assert any("read at line" in x.what for x in told), told
