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


# a tutorial's CNN ends in nn.LazyLinear and sizes it with one forward on a sample, below the build
LAZY = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ds = TensorDataset(torch.rand(64, 1, 8, 8), torch.randint(0, 3, (64,)))
model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(3)).to(device)
{dummy}
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for x, y in DataLoader(ds, batch_size=16, shuffle=True):
    x, y = x.to(device), y.to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def test_a_lazy_layer_sized_by_a_forward_below_the_build_is_prepared_below_that_forward_on_the_device():
    done = plan(LAZY.format(dummy="model(ds[0][0][None].to(device))"))
    lines = done.text.splitlines()
    at = lines.index("model = ddpkit.prepare_model(model)")
    assert lines[at - 1] == "model(ds[0][0][None].to(device))", done.text
    assert "nn.LazyLinear(3)).to(device)" in lines[at - 2], done.text  # (the sample is on the device)
    assert not [x for x in done.left if "Lazy" in x.what], done.left


def test_a_lazy_layer_no_forward_sizes_before_the_wrap_is_said():
    done = plan(LAZY.format(dummy=""))
    assert [x.line for x in done.left if "nn.LazyLinear sizes its weights" in x.what] == [7], done.left


# the loaders' class of a data module: a helper builds each DataLoader, a method binds one and returns it
LOADERS = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Loaders:
    def __init__(self, batch_size):
        self.batch_size = batch_size

    def _make(self, dataset, shuffle):
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle)

    def get(self):
        ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        train_loader = self._make(ds, shuffle=True)
        return train_loader
'''
LOADERS_MAIN = '''import torch
from data import Loaders

{bind}
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for x, y in train_loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


@pytest.mark.parametrize("bind", ["loaders = Loaders(32)\ntrain_loader = loaders.get()",
                                  "train_loader = Loaders(32).get()"])
def test_a_loader_a_helper_builds_and_a_method_returns_is_made_a_training_loader(bind):
    plans = _settled({"data.py": LOADERS, "main.py": LOADERS_MAIN.format(bind=bind)})
    assert not plans["data.py"].refused and not plans["main.py"].refused, (plans["data.py"].left, plans["main.py"].left)
    assert "return ddpkit.data_loader(dataset, global_batch_size=self.batch_size, shuffle=shuffle)" in \
        plans["data.py"].text, plans["data.py"].text


# a step of another module's class run in a loop over a data module's loader attribute
ALGO = '''class Algo:
    def optimize(self, model, opt, x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
'''
HELD = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Data:
    def __init__(self, m):
        self.dataloader = DataLoader(TensorDataset(torch.rand(256, 16), torch.zeros(256)), batch_size=m, shuffle=True)
'''
HELD_MAIN = '''import torch
from torch import nn
from data import Data
from algo import Algo

model = nn.Linear(16, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data, algo = Data(32), Algo()
for epoch in range(2):
    for x, _ in data.dataloader:
        loss = algo.optimize(model, opt, x)
'''


def test_a_step_of_another_module_run_over_a_loader_attribute_of_a_data_module_is_said_fed():
    plans = _settled({"algo.py": ALGO, "data.py": HELD, "main.py": HELD_MAIN})
    assert not any(p.refused for p in plans.values()), {r: p.left for r, p in plans.items()}
    assert any("each rank steps on its own shard" in k.why for k in plans["algo.py"].kept), plans["algo.py"].kept


# a mean-prediction baseline read over the training loader, in the function that trains, through a helper also
# called on the validation loader: sharded, each rank's baseline would be its half's
BASELINE_DATA = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def prepare_data(batch_size):
    train_ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 3))
    val_ds = TensorDataset(torch.randn(64, 8), torch.randn(64, 3))
    return DataLoader(train_ds, batch_size=batch_size, shuffle=True), DataLoader(val_ds, batch_size=batch_size)
'''
BASELINE_MAIN = '''import torch
from data import prepare_data


def train_and_evaluate(epochs):
    train_loader, val_loader = prepare_data(32)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def baseline(loader):
        total = 0.0
        for _, y in loader:
            total += y.pow(2).sum().item()
        return total / len(loader.dataset)

    print(baseline(train_loader), baseline(val_loader))
    for epoch in range(epochs):
        for x, y in train_loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    train_and_evaluate(2)
'''


def test_a_pass_over_an_imported_training_loader_in_the_function_that_trains_on_it_is_not_passed_over():
    plans = _settled({"data.py": BASELINE_DATA, "main.py": BASELINE_MAIN})
    assert any("is also evaluated here" in x.what for x in plans["main.py"].left), plans["main.py"].left


# a DCGAN project's trainer class is handed both models by keyword and builds their optimizers in __init__
TRAINER_CLASS = '''import torch
import torch.nn.functional as F


class Trainer:
    def __init__(self, net, device):
        self.net = net
        self.device = device
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def train(self, data, epochs):
        for epoch in range(epochs):
            for x, y in data:
                self.opt.zero_grad()
                F.mse_loss(self.net(x), y).backward()
                self.opt.step()
'''
TRAINER_MAIN = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer

loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True)
net = torch.nn.Linear(4, 1)
t = Trainer({args})
t.train(loader, epochs=1)
'''


@pytest.mark.parametrize("args", ["net=net, device='cpu'", "net, 'cpu'"])
def test_models_handed_to_a_trainer_classes_constructor_are_prepared_where_they_are_built(args):
    plans = _settled({"trainer.py": TRAINER_CLASS, "main.py": TRAINER_MAIN.format(args=args)})
    assert not plans["trainer.py"].refused, plans["trainer.py"].left
    assert "net = ddpkit.prepare_model(torch.nn.Linear(4, 1))" in plans["main.py"].text, plans["main.py"].text


# a WGAN-GP script's per-step losses, plotted and saved every few steps inside the training loop
CURVE = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16, shuffle=True)
model = nn.Linear(8, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i % 4 == 0:
            {read}
'''


def test_a_curve_read_inside_the_loop_averages_each_value_as_it_is_appended():
    text = plan(CURVE.format(read='torch.save({"losses": losses}, "ckpt.pt")')).text
    averaged = "losses.append(ddpkit.reduce(torch.tensor(loss.item(), dtype=torch.float64), op='mean').item())"
    assert averaged in text, text


def test_a_curve_read_inside_the_loop_only_through_a_mean_is_not_averaged_there():
    # (``np.mean(losses)`` is one number: :mod:`.reductions`' to say, not a curve)
    text = plan(CURVE.format(read="print(sum(losses) / len(losses))")).text
    assert "losses.append(loss.item())" in text, text


def test_a_device_flag_picked_when_a_gpu_is_there_else_the_cpu_is_a_device_set_up():
    # (an InfoGAN project's ``torch.device(args.device) if torch.cuda.is_available() else torch.device("cpu")``)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\n"
                "device = torch.device(args.device) if torch.cuda.is_available() else torch.device('cpu')\n"
                "model = torch.nn.Linear(4, 1).to(device)\nopt = torch.optim.Adam(model.parameters())\n"
                "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n"
                "    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()\n    opt.step()\n")
    assert not done.refused, done.left
    assert "device = state.device\n" in done.text, done.text


def test_a_sample_count_written_in_the_print_itself_is_said():
    # (pytorch/examples' ``'[{}/{}]'.format(batch_idx * len(data), len(train_loader.dataset))``: rank 0's share)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 1)\n"
                "opt = torch.optim.Adam(model.parameters())\n"
                "for batch_idx, (data, target) in enumerate(DataLoader(ds, batch_size=16, shuffle=True)):\n"
                "    loss = torch.nn.functional.mse_loss(model(data), target)\n    loss.backward()\n    opt.step()\n"
                "    print('[{}/{}]'.format(batch_idx * len(data), len(ds)))\n")
    assert [k.line for k in done.kept if "batch_idx * len(data), a count of this rank's samples" in k.what] == [9], \
        done.kept


# a CIFAR recipe's data class: its loaders are attributes one method sets, another returns
DATASET = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class DATASET:
    def __init__(self, bs):
        self.bs = bs
        self.train_dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        self.val_dataset = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        self.data_loaders()

    def data_loaders(self):
        self.train_loader = DataLoader(self.train_dataset, batch_size=self.bs, shuffle=True)
        self.val_loader = DataLoader(self.val_dataset, batch_size=self.bs, shuffle=False)

    def load(self):
        return {returned}
'''
DATASET_MAIN = '''import torch
import torch.nn.functional as F
from data import DATASET


def train_epoch(model, train_loader, opt):
    total = 0
    for x, y in train_loader:
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += y.size(0)
    print(f"trained on {{total}} samples")


def main():
    {bind}
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_epoch(model, train_loader, opt)


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("returned, bind", [
    ("self.train_loader, self.val_loader", "train_loader, val_loader = DATASET(16).load()"),
    ("self.train_loader", "dataset = DATASET(16)\n    train_loader = dataset.load()"),
])
def test_a_loader_attribute_one_method_sets_and_another_returns_is_made_a_training_loader(returned, bind):
    plans = _settled({"data.py": DATASET.format(returned=returned), "main.py": DATASET_MAIN.format(bind=bind)})
    assert not plans["main.py"].left and not plans["main.py"].refused, plans["main.py"].left
    assert "self.train_loader = ddpkit.data_loader(" in plans["data.py"].text, plans["data.py"].text
    assert "total = ddpkit.reduce(total)" in plans["main.py"].text, plans["main.py"].text


# a weather model's helper returns the device's name, picked by what is available; the entry moves its model there
DEVICE_HELPER = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def get_device():
    {body}


if __name__ == "__main__":
    device = get_device()
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16, shuffle=True)
    model = torch.nn.Linear(8, 1)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
'''


def test_a_helper_returning_the_device_by_availability_returns_ddpkits():
    body = "if torch.cuda.is_available():\n        return 'cuda'\n    return 'cpu'"
    done = plan(DEVICE_HELPER.format(body=body))
    assert not done.refused, done.left
    assert done.text.count("return ddpkit.init().device.type") == 2, done.text
    assert "model = ddpkit.prepare_model(model)" in done.text, done.text


def test_a_helper_returning_the_device_by_a_flag_of_its_own_is_still_refused():
    # (``if args.cpu: return 'cpu'``: a switch init() does not know, not ddpkit's choice)
    body = "if args.cpu:\n        return 'cpu'\n    return 'cuda'"
    done = plan(DEVICE_HELPER.format(body=body))
    assert done.refused and "return 'cpu'" in done.text, done.left


def test_a_peek_at_a_training_loader_another_module_builds_is_said_rank_0s_part():
    # (an InfoGAN's "Training Images" picture: ``next(iter(loader))`` of ``loader = get_data(16)``)
    data = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef get_data(batch_size):\n"
            "    return DataLoader(TensorDataset(torch.rand(64, 4)), batch_size=batch_size, shuffle=True)\n")
    main = ("import torch\nfrom data import get_data\n\nloader = get_data(16)\nsample = next(iter(loader))\n"
            "model = torch.nn.Linear(4, 1)\nopt = torch.optim.Adam(model.parameters())\nfor (x,) in loader:\n"
            "    model(x).pow(2).mean().backward()\n    opt.step()\n")
    plans = _settled({"data.py": data, "main.py": main})
    assert [k.line for k in plans["main.py"].kept if "next(iter(...)) takes one batch" in k.what] == [5], \
        plans["main.py"].kept


# a course's training loop counts the samples shown with the batch-size constant and prints a loss over it
BATCH_CONST = '''import torch
from torch.utils.data import DataLoader

B = 16
loader = DataLoader(ds, batch_size=B, shuffle=True)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
training_loss, num_batches, num_display = 0.0, 0, 0
for inputs, labels in loader:
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    opt.step()
    training_loss = training_loss + loss.item()
    num_batches = num_batches + 1
    num_display = num_display + {counted}
    if num_display > 32:
        num_display = 0
        print('avg loss = {{0:8.6f}}'.format((training_loss / num_batches) / B))
'''


def test_a_sample_counter_of_the_batch_size_constant_keeps_the_global_batch():
    done = plan(BATCH_CONST.format(counted="B"))
    assert "ddpkit.data_loader(ds, global_batch_size=B, shuffle=True)" in done.text, (done.text, done.left)
    assert not done.left, done.left


def test_a_mean_loss_shown_over_the_batch_size_is_no_rate_of_a_count():
    done = plan(BATCH_CONST.format(counted="inputs.size(0)"))
    assert not [x for x in done.left if "a rate shown over B" in x.what], done.left


@pytest.mark.parametrize("fed", ["torch.unsqueeze(inputs, dim=0)", "inputs[None]", "inputs.unsqueeze(0)"])
def test_a_batch_fed_as_one_sequence_is_listed(fed):
    # (an LSTM forecaster: the whole batch's rows are the time axis of one sequence; sharded, each rank's is shorter)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.LSTM(8, 2, batch_first=True)\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for inputs, target in DataLoader(ds, batch_size=32):\n    inputs = inputs.to(device)\n"
                f"    out, _ = model({fed})\n    torch.nn.functional.mse_loss(out[0], target).backward()\n"
                "    opt.step()\n")
    assert [x.line for x in done.left if "reads the whole batch as one sample" in x.what] == [7], done.left


def test_a_sample_made_one_batch_of_its_own_inside_the_step_is_not_listed():
    # (``x[0].unsqueeze(0)``: one sample of the batch given its own batch axis, not the batch made a sequence)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(8, 2)\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for inputs, target in DataLoader(ds, batch_size=32):\n"
                "    model(inputs[0].unsqueeze(0)).sum().backward()\n    opt.step()\n")
    assert not [x for x in done.left if "one sample" in x.what], done.left


def test_a_device_chosen_over_several_lines_is_refused_with_a_fix_that_keeps_the_scripts_switch():
    # (an autoencoder's ``--use-cuda``, default off: the one-line fix must not turn its GPU on)
    done = plan("import torch\ndevice = 'cpu'\nif args.use_cuda:\n    if torch.cuda.is_available():\n"
                "        device = 'cuda'\nmodel = torch.nn.Linear(2, 2).to(device)\n")
    fix = next(x.fix for x in done.left if "chosen over several lines" in x.what)
    assert "'cuda' if args.use_cuda and torch.cuda.is_available() else 'cpu'" in fix, fix


# review 33 of the changes above, each a case that broke them


def test_a_loss_method_fed_the_batch_itself_stays_a_forward_method_beside_a_no_grad_output():
    # (self-distillation: ``target = model(x.flip(1))`` under no_grad, then ``model.consistency_loss(target, x)``,
    # which runs the layers on x: outside DDP's forward each rank would train its own copy)
    no_grad = "    with torch.no_grad():\n        y_real = netD(data)\n"
    source = GAN_LOSS.replace("    y_real = netD(data)\n", no_grad)
    text = plan(source.format(other="consistency_loss(y_real, data)")).text
    assert "forward_methods=('consistency_loss',)" in text, text


def test_a_curve_shown_inside_the_loop_and_read_whole_after_it_is_averaged_as_it_grows():
    text = plan(CURVE.format(read='print("last", losses[-1])') + 'print("final", losses)\n').text
    assert "losses.append(ddpkit.reduce(torch.tensor(loss.item(), dtype=torch.float64), op='mean').item())" in text
    assert "losses = ddpkit.reduce(torch.tensor(losses" not in text, text  # (averaged once, as it grew)


def test_a_device_helper_beside_a_cpu_switch_of_the_script_is_left_to_the_switch():
    # (``device = get_device()`` then ``if args.no_cuda: device = "cpu"``: the switch's init(cpu=True) must be the
    # first init; a helper calling ddpkit.init() first would keep the GPU)
    body = "if torch.cuda.is_available():\n        return 'cuda'\n    return 'cpu'"
    source = DEVICE_HELPER.format(body=body).replace(
        "    device = get_device()\n", "    device = get_device()\n    if args.no_cuda:\n        device = 'cpu'\n")
    text = plan(source + "    torch.save(model.state_dict(), 'm.pt')\n").text
    assert "return 'cuda'" in text and "state = ddpkit.init(cpu=True)" in text, text
    assert "if ddpkit.init().is_main:" in text and "state.is_main" not in text, text  # (state bound under the if)


def test_a_device_flag_picked_when_a_gpu_is_there_is_said_not_read():
    # (its cpu= would make a print above it, the seed banner, a false stop: held-out set 22's re-run)
    done = plan("import torch\nprint('seed', 1)\nargs = parse()\ndevice = torch.device(args.device) if "
                "torch.cuda.is_available() else torch.device('cpu')\nmodel = torch.nn.Linear(4, 1).to(device)\n"
                "opt = torch.optim.Adam(model.parameters())\n")
    assert not done.refused, done.left
    assert [k.line for k in done.kept if "torch.device(args.device) is not read" in k.what] == [4], done.kept


def test_a_batch_unsqueezed_for_a_sequence_first_rnn_is_no_whole_batch():
    # (``nn.LSTM(8, 2)`` reads dim 0 as time: ``x.unsqueeze(0)`` is a length-1 sequence of each sample)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.LSTM(8, 2)\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in DataLoader(ds, batch_size=32):\n"
                "    out, _ = model(x.unsqueeze(0))\n    torch.nn.functional.mse_loss(out[0], y).backward()\n"
                "    opt.step()\n")
    assert not [x for x in done.left if "one sample" in x.what], done.left


def test_a_lazy_layer_the_model_sizes_in_its_own_init_is_not_listed():
    done = plan("import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader\n\n\n"
                "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.fc = nn.LazyLinear(3)\n"
                "        with torch.no_grad():\n            self(torch.zeros(1, 5))\n\n"
                "    def forward(self, x):\n        return self.fc(x)\n\n\nnet = Net()\n"
                "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nfor x, y in DataLoader(ds, batch_size=8):\n"
                "    net(x).sum().backward()\n    opt.step()\n")
    assert not [x for x in done.left if "Lazy" in x.what], done.left


def test_a_curve_appended_under_no_grad_and_read_inside_the_loop_is_averaged():
    # (WGAN-GP.py's ``with torch.no_grad(): list_loss_D.append(loss_D.item())``, plotted every few steps)
    source = CURVE.replace("        losses.append(loss.item())\n",
                           "        with torch.no_grad():\n            losses.append(loss.item())\n")
    text = plan(source.format(read='torch.save({"losses": losses}, "ckpt.pt")')).text
    assert "losses.append(ddpkit.reduce(torch.tensor(loss.item(), dtype=torch.float64), op='mean').item())" in text


def test_a_loop_module_star_imported_by_the_entry_is_fed_its_training_loader():
    # (a CIFAR project's ``from src.trainer import *``: train() was said fed by no ddpkit loader, and the test
    # loader was sharded as a training one)
    data = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef create():\n"
            "    ds = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))\n"
            "    return DataLoader(ds, batch_size=10, shuffle=True), DataLoader(ds, batch_size=5)\n")
    trainer = ("def train(net, loader, opt):\n    for x, y in loader:\n        opt.zero_grad()\n"
               "        net(x).sum().backward()\n        opt.step()\n\n\ndef test(net, loader):\n    total = 0\n"
               "    for x, y in loader:\n        total += (net(x).argmax(1) == y).sum().item()\n    print(total)\n")
    main = ("import torch\nfrom data import create\nfrom trainer import *\n\ntrain_loader, test_loader = create()\n"
            "net = torch.nn.Linear(8, 4)\nopt = torch.optim.Adam(net.parameters())\ntrain(net, train_loader, opt)\n"
            "test(net, test_loader)\n")
    plans = _settled({"data.py": data, "trainer.py": trainer, "main.py": main})
    assert not plans["trainer.py"].left, plans["trainer.py"].left
    assert "ddpkit.data_loader(ds, global_batch_size=10, shuffle=True), DataLoader(ds, batch_size=5)" in \
        plans["data.py"].text, plans["data.py"].text


def test_loaders_in_a_dict_by_split_read_through_a_name_in_the_loop_over_the_splits_convert():
    # (a language model's ``data_loader = data_loaders[split]`` then ``for x, y in data_loader:``)
    done = plan("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(8, 4)\n"
                "opt = torch.optim.Adam(model.parameters())\n"
                "data_loaders = {'train': DataLoader(tr, batch_size=8, shuffle=True), 'valid': DataLoader(va, "
                "batch_size=8)}\nfor epoch in range(2):\n    for split in ['train', 'valid']:\n"
                "        data_loader = data_loaders[split]\n        for x, y in data_loader:\n"
                "            loss = torch.nn.functional.cross_entropy(model(x), y)\n            if split == 'train':\n"
                "                opt.zero_grad()\n                loss.backward()\n                opt.step()\n")
    assert not done.refused, done.left
    assert "'train': ddpkit.data_loader(tr, global_batch_size=8, shuffle=True), 'valid': DataLoader(va" in done.text


@pytest.mark.parametrize("body", [
    "return torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
    "if torch.cuda.is_available():\n        return 'cuda'\n    elif torch.has_mps:\n        return 'mps'\n"
    "    else:\n        return 'cpu'",
])
def test_a_helper_returning_the_one_line_device_or_asking_has_mps_returns_ddpkits(body):
    # (an LSTM project's ``return torch.device('cuda' if ...)``; WeatherProphet's ``elif torch.has_mps:``)
    done = plan(DEVICE_HELPER.format(body=body))
    assert not done.refused, done.left
    assert "return ddpkit.init().device" in done.text, done.text


def test_a_batch_handed_to_another_modules_image_saver_in_the_training_loop_is_said_rank_0s_part():
    # (a DCGAN project's ``save_images(x, 'real')`` in Trainer.train, whose helper module saves it: B/N images)
    saver = ("import torchvision.utils as vutils\n\n\ndef save_images(data, name):\n"
             "    vutils.save_image(data, name + '.png')\n")
    trainer = ("import torch\nfrom saver import save_images\n\n\nclass Trainer:\n    def __init__(self, net):\n"
               "        self.net = net\n        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)\n\n"
               "    def train(self, data):\n        for i, (x, y) in enumerate(data):\n"
               "            self.net(x).sum().backward()\n            self.opt.step()\n"
               "            save_images(x, 'real')\n")
    main = ("import torch\nfrom torch.utils.data import DataLoader\nfrom trainer import Trainer\n\n"
            "loader = DataLoader(ds, batch_size=16, shuffle=True)\nnet = torch.nn.Linear(4, 1)\n"
            "Trainer(net=net).train(loader)\n")
    plans = _settled({"saver.py": saver, "trainer.py": trainer, "main.py": main})
    assert [k.line for k in plans["trainer.py"].kept if "gets this rank's part of the batch" in k.what] == [14], \
        plans["trainer.py"].kept


# review 34 of the changes above


def test_a_one_line_with_in_a_loop_filling_a_list_converts():
    # (``with torch.no_grad(): norm = ...`` on one line once made the step's unwrapping loop forever)
    one_line = "        opt.step()\n        with torch.no_grad(): norm = loss.item()\n"
    source = CURVE.replace("        opt.step()\n", one_line)
    text = plan(source.format(read='torch.save({"losses": losses}, "ckpt.pt")')).text
    assert "losses.append(ddpkit.reduce(" in text, text


def test_a_lazy_layer_of_the_trained_model_is_listed_beside_another_class_that_sizes_itself():
    done = plan("import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader\n\n\n"
                "class Encoder(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.proj = nn.LazyLinear(16)\n        self(torch.zeros(1, 12))\n\n"
                "    def forward(self, x):\n        return self.proj(x)\n\n\nclass Head(nn.Module):\n"
                "    def __init__(self):\n        super().__init__()\n        self.fc = nn.LazyLinear(1)\n\n"
                "    def forward(self, h):\n        return self.fc(h)\n\n\nencoder, model = Encoder(), Head()\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in DataLoader(ds, batch_size=8):\n"
                "    model(encoder(x)).sum().backward()\n    opt.step()\n")
    assert [x.line for x in done.left if "nn.LazyLinear sizes its weights" in x.what] == [19], done.left


def test_a_batch_transformed_by_another_modules_helper_named_like_an_image_is_not_said_shown():
    # (``x = normalize_images(x)``: a step of the batch's own, bound back, not a picture)
    utils = "def normalize_images(x):\n    return x / 255\n"
    main = ("import torch\nfrom torch.utils.data import DataLoader\nfrom utils import normalize_images\n\n"
            "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n    x = normalize_images(x)\n"
            "    model(x).sum().backward()\n    opt.step()\n")
    plans = _settled({"utils.py": utils, "main.py": main})
    assert not [k for k in plans["main.py"].kept if "this rank's part of the batch" in k.what], plans["main.py"].kept


def test_a_device_flag_inside_the_device_call_is_said_not_read_too():
    done = plan("import torch\ndevice = torch.device(args.device if torch.cuda.is_available() else 'cpu')\n"
                "model = torch.nn.Linear(4, 1).to(device)\nopt = torch.optim.Adam(model.parameters())\n")
    assert [k.line for k in done.kept if "args.device is not read" in k.what] == [2], done.kept


def test_a_print_at_import_above_a_functions_device_switch_is_listed():
    # (``print(torch.__version__)`` at the top: converted, it starts ddpkit before main()'s init(cpu=not args.cuda))
    done = plan("import torch\nprint(torch.__version__)\n\n\ndef main(args):\n"
                "    device = torch.device('cuda' if args.cuda else 'cpu')\n"
                "    model = torch.nn.Linear(4, 1).to(device)\n"
                "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    assert [x.line for x in done.left if "starts ddpkit at import" in x.what] == [2], done.left
    plain = plan("import torch\nprint(torch.__version__)\n\n\ndef main():\n"
                 "    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
                 "    model = torch.nn.Linear(4, 1).to(device)\n"
                 "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    assert not plain.left, plain.left  # (no switch to lose: init() picks the same)
