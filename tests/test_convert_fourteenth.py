"""What the fourteenth held-out set's scripts showed ``ddpkit convert`` owes public scripts (docs/convert.md):
each a case written in our own words after the pattern met."""
import sys

import pytest

from conftest import launch, run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

DEVICE_BUILT = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--device", type=int, default=0)
args = parser.parse_args()
device = {device}
model = nn.Linear(4, 2).to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8, shuffle=True)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("device", [
    'torch.device("cuda:" + str(args.device)) if torch.cuda.is_available() else torch.device("cpu")',
    'torch.device("cuda:%d" % args.device if torch.cuda.is_available() else "cpu")',
])
def test_a_device_string_built_from_the_gpu_index_is_read_as_the_accelerator(device):
    p = plan(DEVICE_BUILT.format(device=device))
    assert not p.left, p.left
    assert "state = ddpkit.init()\ndevice = state.device\n" in p.text, p.text
    assert "ddpkit.prepare_model(nn.Linear(4, 2))" in p.text


STEP_ENGINE = '''import torch


class Engine:
    def __init__(self, device):
        self.model = torch.nn.Linear(4, 1)
        self.model.to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def train(self, x, y):
        self.model.train()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()
'''

STEP_MAIN = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from engine import Engine


def main():
    device = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    {build}
    for epoch in range(2):
        for x, y in loader:
            loss = {call}(x.to(device), y.to(device))
        print("epoch", epoch, "loss", loss)


if __name__ == "__main__":
    main()
'''


def _project(build, call):
    from ddpkit.commands.convert.crossing import settle

    files = {"engine.py": STEP_ENGINE, "main.py": STEP_MAIN.format(build=build, call=call)}
    return settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))


@pytest.mark.parametrize("build, call", [("eng = Engine(device)", "eng.train"), ("pass", "Engine(device).train")])
def test_a_training_step_of_another_modules_object_called_in_a_loop_over_a_loader_converts_both(build, call):
    done = _project(build, call)
    assert not done["main.py"].left and not done["engine.py"].left, (done["main.py"].left, done["engine.py"].left)
    assert "loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in done["main.py"].text
    assert "self.model = ddpkit.prepare_model(self.model)" in done["engine.py"].text
    assert any("training step Engine.train" in k.what for k in done["engine.py"].kept), done["engine.py"].kept


def test_a_training_step_converted_alone_or_called_over_a_list_is_left_with_the_fix():
    from ddpkit.commands.convert.crossing import settle

    alone = plan(STEP_ENGINE)
    assert alone.left and "--imports" in alone.left[0].fix, alone.left
    listed = STEP_MAIN.format(build="eng = Engine(device)", call="eng.train").replace(
        "for x, y in loader:", "for x, y in [ds[i:i + 8] for i in range(0, 64, 8)]:")
    files = {"engine.py": STEP_ENGINE, "main.py": listed}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert done["engine.py"].left, "a step fed by hand in its caller is no step fed by a loader"


PAD_ZERO = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ids = torch.randint(1, 9, (16, 5))
ids[::2, 3:] = 0
loader = DataLoader(TensorDataset(ids, ids.roll(1, 1)), batch_size=4, shuffle=True)
model = nn.Sequential(nn.Embedding(9, 8), nn.Linear(8, 9), nn.LogSoftmax(-1))
opt = torch.optim.Adam(model.parameters())
{criterion}
for x, y in loader:
    loss = {loss}
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_loss_that_ignores_the_pad_id_zero_is_a_token_mean_counted_or_listed():
    inline = plan(PAD_ZERO.format(criterion="", loss="nn.functional.nll_loss(model(x).transpose(1, 2), y, "
                                  "ignore_index=0)"))
    assert "batch_count=lambda batch: (batch[1] != 0).sum()" in inline.text, (inline.text, inline.left)
    built = plan(PAD_ZERO.format(criterion="criterion = nn.NLLLoss(ignore_index=0)",
                                 loss="criterion(model(x).transpose(1, 2), y)"))
    assert any("a mean over the tokens it does not ignore" in x.what for x in built.left), built.left


def test_a_loader_bound_to_a_name_or_none_is_converted_for_its_role():
    source = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

train_set = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
test_set = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
train_loader = DataLoader(train_set, batch_size=8, shuffle=True)
test_loader = DataLoader(test_set, batch_size=8) if test_set is not None else None
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in train_loader:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
if test_loader is not None:
    correct = 0
    with torch.no_grad():
        for x, y in test_loader:
            correct += (model(x).argmax(1) == y).sum().item()
    print(correct / len(test_loader.dataset))
'''
    p = plan(source)
    assert not [x for x in p.left if x.blocks], p.left
    assert "test_loader = ddpkit.data_loader(test_set, batch_size=8, train=False) if test_set is not None else None" \
        in p.text, p.text
    assert "correct = ddpkit.reduce(correct)" in p.text or "ddpkit.reduce(correct)" in p.text, p.text


FIGURES = '''import imageio
import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
G = nn.Linear(4, 4)
opt = torch.optim.Adam(G.parameters())
hist = []


def show_result(epoch, path='result.png'):
    plt.plot([epoch])
    plt.savefig(path)


def show_train_hist(hist, save=False, path='Train_hist.png'):
    plt.plot(hist)
    if save:
        plt.savefig(path)


for epoch in range(2):
    for (x,) in loader:
        loss = G(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    hist.append(loss.item())
    show_result(epoch, path='results/Fixed_results/frame_' + str(epoch + 1) + '.png')
show_train_hist(hist, save=True, path={hist_path})
images = []
for e in range(2):
    img_name = 'results/Fixed_results/frame_' + str(e + 1) + '.png'
    images.append(imageio.imread(img_name))
'''


def test_a_figure_written_under_an_if_to_another_path_than_the_frames_read_back_needs_no_barrier():
    p = plan(FIGURES.format(hist_path="'results/train_hist.png'"))
    assert not p.left, p.left
    assert "ddpkit.barrier()" in p.text  # (the frames: written in the loop, read back below)
    same = plan(FIGURES.format(hist_path="f'results/Fixed_results/frame_{9}.png'"))
    assert any("a file is read at line" in x.what for x in same.left), same.left  # (it may be one of them)


def test_a_training_sum_of_batch_means_over_the_loaders_length_is_averaged_over_the_ranks(tmp_path):
    from test_convert_twelfth import prints_as_one_process

    source = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

criterion = nn.CrossEntropyLoss()


def train(model, train_loader, optimizer, epoch):
    model.train()
    total_iters = len(train_loader)
    loss_accum = 0
    for x, y in train_loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss = loss.detach().cpu().numpy()
        loss_accum += loss
    average_loss = loss_accum / total_iters
    print("loss training: %.5f" % (average_loss))
    return average_loss


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                    batch_size=8)
for epoch in range(2):
    train(model, loader, opt, epoch)
'''
    p = plan(source)
    assert "loss_accum = ddpkit.reduce(loss_accum, op='mean')" in p.text, p.text
    assert "ddpkit.reduce" in plan(source.replace("loss_accum / total_iters", "loss_accum / len(train_loader)")).text
    prints_as_one_process(tmp_path, source, p.text)


TWO_LINE_DEVICE = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def train(model, loader, device):
    for (x,) in loader:
        loss = model(x.to(device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


if __name__ == "__main__":
    MODEL = nn.Linear(4, 4)
    LOADER = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
    DEVICE = 'cpu'
    if torch.cuda.is_available():
        DEVICE = 'cuda'
    model = MODEL.to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = train(MODEL, LOADER, DEVICE)
    torch.save(model.state_dict(), "m.pt")
'''


def test_a_cpu_device_upgraded_under_an_if_and_a_model_moved_under_another_name_convert():
    """TextAugmentation-GPT2: ``DEVICE = 'cpu'`` then ``if torch.cuda.is_available(): DEVICE = 'cuda'``; and
    ``model = MODEL.to(DEVICE)``, the loop then handed ``MODEL`` (the same object, unprepared once converted)."""
    p = plan(TWO_LINE_DEVICE)
    assert not [x for x in p.left if x.blocks], p.left
    assert "    state = ddpkit.init()\n" in p.text and "    DEVICE = state.device.type\n" in p.text, p.text
    assert "is_available" not in p.text
    assert "model = MODEL = ddpkit.prepare_model(MODEL)" in p.text, p.text


def test_an_indexed_device_string_keeps_its_index_and_its_cpu_fallback_stays():
    """AGCRN: ``DEVICE = 'cuda:0'`` (argparse's default), ``torch.cuda.set_device(int(args.device[5]))`` when
    there is a GPU, ``else: args.device = 'cpu'``: converted to two inits hoisted to the top, the second
    ``init(cpu=True)``, and a device string without its index."""
    source = '''import argparse
import os
print(os.getcwd())
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

DEVICE = 'cuda:0'
parser = argparse.ArgumentParser()
parser.add_argument('--device', default=DEVICE, type=str)
args = parser.parse_args()
if torch.cuda.is_available():
    torch.cuda.set_device(int(args.device[5]))
else:
    args.device = 'cpu'
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
model = nn.Linear(4, 1).to(args.device)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
for x, y in loader:
    loss = nn.functional.l1_loss(model(x.to(args.device)), y.to(args.device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
    p = plan(source)
    assert not [x for x in p.left if x.blocks], p.left
    assert p.text.count("ddpkit.init(") == 1 and "DEVICE = str(state.device)" in p.text, p.text
    assert "    args.device = 'cpu'\n" in p.text, p.text


def test_a_read_of_a_name_the_write_may_become_still_waits():
    """np.save('out/w') writes out/w.npy: file names are not compared, only folders."""
    source = '''import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in loader:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
np.save('out/w', model.weight.detach().numpy())
w = np.load('out/w.npy')
'''
    p = plan(source)
    assert "np.save('out/w', model.weight.detach().numpy())\nddpkit.barrier()\n" in p.text.replace(
        "if state.is_main:\n    ", ""), p.text


TRAINER_TEST = '''import copy
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, loader, test_loader, best_path):
        self.model, self.loader, self.test_loader, self.best_path = model, loader, test_loader, best_path
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def train(self):
        for epoch in range(2):
            for x, y in self.loader:
                loss = nn.functional.mse_loss(self.model(x), y)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
            best = copy.deepcopy(self.model.state_dict())
            if epoch % 2 == 0:
                torch.save(best, self.best_path)
        self.test(self.model, self.test_loader{given})

    @staticmethod
    def test(model, data_loader, path=None):
        if path is not None:
            model.load_state_dict(torch.load(path))
        model.eval()
        total = 0.0
        with torch.no_grad():
            for x, y in data_loader:
                total += nn.functional.mse_loss(model(x), y, reduction="sum").item()
        print(total / len(data_loader.dataset))


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
trainer = Trainer(nn.Linear(4, 1), DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=8),
                  "best.pth")
trainer.train()
'''


def test_a_load_under_a_path_parameter_no_call_passes_owes_no_barrier():
    """AGCRN's ``Trainer.test(..., path=None)``: the checkpoint is read only when a test-only run passes a path."""
    p = plan(TRAINER_TEST.format(given=""))
    assert not any("a file is read at line" in x.what for x in p.left), p.left
    passed = plan(TRAINER_TEST.format(given=", path=self.best_path"))
    assert any("a file is read at line" in x.what for x in passed.left) or "ddpkit.barrier()" in passed.text, \
        (passed.left, passed.text)


def test_a_folder_checked_then_asked_about_or_made_is_rank_0s_then_a_barrier():
    """cs-kd's ``set_logging_defaults``: ``if os.path.isdir(logdir): input('Overwrite?')`` ``else:
    os.makedirs(logdir)``: rank 1 came after rank 0 made it, and asked (EOFError at launch)."""
    source = '''import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def set_logging_defaults(logdir):
    if os.path.isdir(logdir):
        res = input('"{}" exists. Overwrite [Y/n]? '.format(logdir))
        if res != 'Y':
            raise Exception('"{}" exists.'.format(logdir))
    else:
        os.makedirs(logdir)


set_logging_defaults("results/run")
loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in loader:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
    p = plan(source)
    assert not p.left, p.left
    assert "    if ddpkit.init().is_main:\n        if os.path.isdir(logdir):" in p.text or \
        "    if state.is_main:\n        if os.path.isdir(logdir):" in p.text, p.text
    assert "            os.makedirs(logdir, exist_ok=True)\n    ddpkit.barrier()\n" in p.text, p.text


def test_a_handed_loader_rewrapped_in_a_progress_bar_is_still_the_callers_loader():
    """DialoGPT's ``train_one_epoch``: ``data_loader = tqdm(data_loader, file=sys.stdout)`` before its loop."""
    from ddpkit.commands.convert.crossing import settle

    files = {"utils.py": '''import sys
import torch
from tqdm import tqdm


def train_one_epoch(model, device, data_loader, optimizer):
    model.train()
    data_loader = tqdm(data_loader, file=sys.stdout)
    for step, (x, y) in enumerate(data_loader):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()
''', "train.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset
from utils import train_one_epoch

device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
model = torch.nn.Linear(4, 1).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for epoch in range(2):
    train_one_epoch(model, device, loader, opt)
'''}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert not done["utils.py"].left and not done["train.py"].left, (done["utils.py"].left, done["train.py"].left)
    assert "ddpkit.data_loader(" in done["train.py"].text


def test_a_pretty_print_is_rank_0s():
    p = plan("from pprint import pprint\nimport pprint as pp\nimport argparse\nargs = argparse.Namespace(lr=1)\n"
             "pprint(args.__dict__)\npp.pprint(vars(args))\n")
    assert p.text.count("if ddpkit.init().is_main:\n    p") == 2 or p.text.count("is_main:\n    p") == 2, p.text


def test_an_optimizer_built_on_the_model_itself_is_listed():
    """KFAC-Pytorch: ``KFACOptimizer(net, ...)`` hooks the layers and preconditions with this rank's statistics:
    the replicas' updates part (the replica check stopped it, naming an init as the cause)."""
    source = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from optimizers import KFACOptimizer

parser = argparse.ArgumentParser()
parser.add_argument("--optimizer", default="kfac")
args = parser.parse_args()
net = nn.Linear(4, 2)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
if args.optimizer == "sgd":
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
else:
    optimizer = KFACOptimizer(net, lr=0.1, damping=1e-3)
for x, y in loader:
    loss = nn.functional.cross_entropy(net(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
    p = plan(source)
    assert any("an optimizer built on the model itself" in x.what and x.line == 15 for x in p.left), p.left
    assert not any("built on the model" in x.what for x in plan(source.replace("KFACOptimizer(net,", "KFACOptimizer("
                                                                                "net.parameters(),")).left)


def test_another_modules_evaluation_step_run_over_a_loader_makes_it_an_evaluation_loader():
    """Graph-WaveNet: ``engine.eval(x, y)`` (``self.model.eval()``, no backward) over the validation loader (here
    under a name that says nothing of its role)."""
    from ddpkit.commands.convert.crossing import settle

    engine = STEP_ENGINE + '''
    def eval(self, x, y):
        self.model.eval()
        return torch.nn.functional.mse_loss(self.model(x), y).item()
'''
    main = STEP_MAIN.format(build="eng = Engine(device)", call="eng.train").replace(
        '        print("epoch", epoch, "loss", loss)\n', '''        total = 0.0
        for x, y in second:
            total += eng.eval(x, y) * x.size(0)
        print("epoch", epoch, "loss", loss, total / len(second.dataset))
''')
    built = "    loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
    main = main.replace(built, built + "    second = DataLoader(ds, batch_size=8)\n")
    files = {"engine.py": engine, "main.py": main}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert not done["main.py"].left and not done["engine.py"].left, (done["main.py"].left, done["engine.py"].left)
    assert "second = ddpkit.data_loader(ds, batch_size=8, train=False)" in done["main.py"].text, \
        done["main.py"].text
    assert "total = ddpkit.reduce(total)" in done["main.py"].text


def test_the_mean_of_a_list_the_training_loop_appends_to_is_averaged_over_the_ranks(tmp_path):
    """Graph-WaveNet: ``train_loss.append(loss.item())`` each step, ``mtrain_loss = np.mean(train_loss)`` printed."""
    from test_convert_twelfth import prints_as_one_process

    source = '''import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                    batch_size=8)
for epoch in range(2):
    train_loss = []
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_loss.append(loss.item())
    mtrain_loss = np.mean(train_loss)
    print("epoch %d loss %.5f" % (epoch, mtrain_loss))
'''
    p = plan(source)
    assert "mtrain_loss = ddpkit.reduce(mtrain_loss, op='mean')" in p.text, p.text
    prints_as_one_process(tmp_path, source, p.text)


def test_an_evaluation_drawn_with_next_in_a_while_loop_keeps_its_loader_whole(tmp_path):
    """DANN's test.py: ``while i < len_dataloader: next(data_target_iter)``, sums never reduced once sharded: the
    accuracy was over rank 0's half."""
    from test_convert_twelfth import prints_as_one_process

    source = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def test(model):
    g = torch.Generator().manual_seed(2)
    loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)),
                        batch_size=8, shuffle=False)
    model.eval()
    it = iter(loader)
    i = n_total = n_correct = 0
    while i < len(loader):
        x, y = next(it)
        with torch.no_grad():
            pred = model(x).argmax(1)
        n_correct += (pred == y).sum().item()
        n_total += len(y)
        i += 1
    print('accuracy %.4f over %d samples' % (n_correct / n_total, n_total))


torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
for x, y in train:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
test(model)
'''
    p = plan(source)
    assert "    loader = DataLoader(" in p.text and not [x for x in p.left if x.blocks], (p.text, p.left)
    prints_as_one_process(tmp_path, source, p.text)


def test_a_save_each_epoch_followed_by_another_modules_function_waits_for_rank_0():
    """DANN: ``torch.save(my_net, path)`` each epoch, then ``test(name, epoch)`` of test.py loads that file: rank 1
    read it before rank 0 wrote it (FileNotFoundError)."""
    from ddpkit.commands.convert.crossing import settle

    files = {"test.py": '''import torch


def test(epoch):
    net = torch.load('models/epoch_' + str(epoch) + '.pth', weights_only=False)
    net.eval()
''', "main.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset
from test import test

net = torch.nn.Linear(4, 2)
opt = torch.optim.Adam(net.parameters())
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    torch.save(net, 'models/epoch_' + str(epoch) + '.pth')
    test(epoch)
'''}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    text = done["main.py"].text
    assert "'models/epoch_' + str(epoch) + '.pth')\n    ddpkit.barrier()\n    test(epoch)" in text, text
    alone = plan(files["main.py"].replace("    test(epoch)\n", "    print(epoch)\n"))
    assert "ddpkit.barrier()" not in alone.text


def test_a_typed_tensor_resized_to_each_batch_sizes_nothing():
    """conditional-DCGAN: ``label = torch.FloatTensor(args.batch_size)``, then ``label.resize_(batch_size)`` each
    step: listed as sized by the batch, and the global batch doubled on that false premise."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nbatch_size = 8\n"
              "model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Sigmoid())\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "loader = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=batch_size, shuffle=True)\n"
              "label = torch.FloatTensor(batch_size)\n"
              "for (x,) in loader:\n    label.resize_(x.size(0)).fill_(1)\n"
              "    loss = torch.nn.functional.binary_cross_entropy(model(x).view(-1), label)\n    loss.backward()\n"
              "    opt.step()\n")
    p = plan(source)
    assert not p.left and "global_batch_size=batch_size" in p.text, (p.left, p.text)


@pytest.mark.parametrize("criterion, loss", [
    ("criterion = nn.NLLLoss(weight)", "criterion(F.log_softmax(model(xb), 1), yb)"),
    ("criterion = nn.CrossEntropyLoss(weight=weight)", "criterion(model(xb), yb)"),
    ("", "F.cross_entropy(model(xb), yb, weight)"),
])
def test_a_loss_weighed_by_class_is_listed(criterion, loss):
    """piwise: ``NLLLoss2d(weight)`` with the background weighed 0: a mean divided by each rank's own sum of the
    batch's weights (verify FAILs it); a class weight of None is a plain mean."""
    source = f'''import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(8, 3, 4, 4), torch.randint(0, 4, (8, 4, 4))), batch_size=4)
model = nn.Conv2d(3, 4, 3, padding=1)
weight = torch.ones(4)
weight[0] = 0
{criterion}
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
for xb, yb in loader:
    loss = {loss}
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''
    assert any("a mean weighed by class" in x.what for x in plan(source).left), plan(source).left
    assert not any("weighed by class" in x.what for x in plan(source.replace("weight)", "None)").replace(
        "weight=weight", "weight=None")).left)


def test_a_batch_size_that_only_counts_steps_sizes_nothing():
    """DA-RNN: ``idx += batch_size`` each step and ``losses[epoch * iters + idx / batch_size]``: a step counter,
    read as sizing the batch, so the per-process batch was kept (the global batch doubled) and exit 1."""
    source = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

X, Y = torch.randn(64, 4), torch.randn(64, 1)
batch_size = 16
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters())
loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=batch_size, shuffle=True)
iters = int(np.ceil(64 / batch_size))
losses = np.zeros(2 * iters)
for epoch in range(2):
    idx = 0
    for (ind,) in loader:
        loss = torch.nn.functional.mse_loss(model(X[ind]), Y[ind])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[int(epoch * iters + idx / batch_size)] = loss.item()
        idx += batch_size
'''
    p = plan(source)
    assert not p.left and "global_batch_size=batch_size" in p.text, p.left
    sized = source.replace("        idx += batch_size\n", "        idx += batch_size\n        w = loss / batch_size\n")
    assert plan(sized).left  # (a loss divided by the batch size sizes by it: still said)


def test_an_evaluation_whose_helper_fills_a_container_by_index_keeps_its_loader_whole(tmp_path):
    """dlwpt's ``computeBatchLoss(batch_ndx, batch, batch_size, metrics_g)`` writing ``metrics_g[0, start:end]``:
    sharded, each rank filled half of the tensor and counted the other half as zeros."""
    from test_convert_twelfth import prints_as_one_process

    source = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def compute(model, batch_ndx, batch, batch_size, metrics):
    xb, yb = batch
    start = batch_ndx * batch_size
    metrics[0, start:start + yb.size(0)] = yb.float()
    metrics[1, start:start + yb.size(0)] = model(xb).softmax(1)[:, 1]


torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 4, generator=g), (torch.arange(16) % 3 == 0).long()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_dl = DataLoader(TensorDataset(x, y), batch_size=4)
val_dl = DataLoader(TensorDataset(x, y), batch_size=4)
for epoch in range(2):
    model.train()
    for xb, yb in train_dl:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        model.eval()
        metrics = torch.zeros(2, len(val_dl.dataset))
        for batch_ndx, batch in enumerate(val_dl):
            compute(model, batch_ndx, batch, val_dl.batch_size, metrics)
    print('epoch', epoch, 'positives', int((metrics[0] > 0.5).sum()), 'of', metrics.shape[1])
'''
    p = plan(source)
    assert "val_dl = DataLoader(" in p.text and not [x for x in p.left if x.blocks], (p.text, p.left)
    prints_as_one_process(tmp_path, source, p.text)


def test_a_wav_or_an_image_written_by_scipy_or_opencv_is_rank_0s():
    """melgan's ``save_sample`` (``scipy.io.wavfile.write``): every rank wrote the samples."""
    source = '''import cv2
import scipy.io.wavfile
import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 4)
opt = torch.optim.Adam(model.parameters())
for (x,) in DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
scipy.io.wavfile.write("sample.wav", 22050, x.numpy())
cv2.imwrite("sample.png", x.numpy())
'''
    text = plan(source).text
    assert text.count("is_main:") == 2, text


def test_a_training_loop_whose_helper_fills_a_container_by_index_is_listed():
    """dlwpt's ``computeBatchLoss(batch_ndx, batch, batch_size, trnMetrics_g)`` over the sharded training loader:
    each rank filled half the slots and reported the rest as zeros (negatives)."""
    source = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def compute(model, batch_ndx, batch, batch_size, metrics):
    xb, yb = batch
    loss = torch.nn.functional.cross_entropy(model(xb), yb, reduction='none')
    start = batch_ndx * batch_size
    metrics[0, start:start + yb.size(0)] = loss.detach()
    return loss.mean()


model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_dl = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
metrics = torch.zeros(1, len(train_dl.dataset))
for batch_ndx, batch in enumerate(train_dl):
    opt.zero_grad()
    compute(model, batch_ndx, batch, train_dl.batch_size, metrics).backward()
    opt.step()
print(metrics.mean())
'''
    assert any("per-sample results in metrics" in x.what for x in plan(source).left), plan(source).left


FLAGGED_TRAINER = '''import torch
from torch import nn


class Trainer:
    def __init__(self, model, train_dataloader, test_dataloader=None):
        self.model = model
        self.train_data, self.test_data = train_dataloader, test_dataloader
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self, epoch):
        self.iteration(epoch, self.train_data)

    def test(self, epoch):
        self.iteration(epoch, self.test_data, train=False)

    def iteration(self, epoch, data_loader, train=True):
        correct = total = 0
        for x, y in data_loader:
            out = self.model(x)
            loss = nn.functional.cross_entropy(out, y)
            if train:
                self.optim.zero_grad()
                loss.backward()
                self.optim.step()
            correct += (out.argmax(1) == y).sum().item()
            total += y.size(0)
        print("EP%d %s acc %.4f" % (epoch, "train" if train else "test", correct / total))
'''

FLAGGED_MAIN = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
train_set = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
test_set = TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
train_loader = DataLoader(train_set, batch_size=8)
test_loader = DataLoader(test_set, batch_size=8) if test_set is not None else None
trainer = Trainer(torch.nn.Linear(4, 2), train_dataloader=train_loader, test_dataloader=test_loader)
for epoch in range(2):
    trainer.train(epoch)
    trainer.test(epoch)
'''


def test_a_trainers_one_loop_fed_the_train_and_the_test_loader_through_its_methods_converts(tmp_path):
    """BERT-pytorch's ``iteration(epoch, data_loader, train=True)``, called by ``train()`` with ``self.train_data``
    and by ``test()`` with ``self.test_data``: the loop's parameter was asked of the callers as such (nobody passes
    ``iteration``'s argument), so the trainer was left; now each of ``__init__``'s loaders is asked."""
    from ddpkit.commands.convert.crossing import settle

    files = {"trainer.py": FLAGGED_TRAINER.replace("            correct += (out.argmax(1) == y).sum().item()\n"
                                                  "            total += y.size(0)\n", "")
             .replace("correct / total", "0.0").replace("correct = total = 0", "pass"), "main.py": FLAGGED_MAIN}
    # (fifteenth set: the evaluating call's loader is kept whole; a loop that sums across ranks is left to the user,
    # test_convert_fifteenth.py; this one prints per-loop values only)
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert not done["trainer.py"].left and not done["main.py"].left, (done["trainer.py"].left, done["main.py"].left)
    out = tmp_path / "out"
    out.mkdir()
    for rel, p in done.items():
        (out / rel).write_text(p.text)
    (tmp_path / "orig").mkdir()
    for rel, text in files.items():
        (tmp_path / "orig" / rel).write_text(text)  # (the same files: both runs print the same lines)
    one = run_cmd([sys.executable, "main.py"], timeout=60, cwd=str(tmp_path / "orig"))
    two = launch(out / "main.py", nproc=2, timeout=120, cwd=str(out))
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.split() == one.stdout.split(), (one.stdout, two.stdout)


def test_a_mean_over_the_loaders_length_is_averaged_when_the_loop_runs_over_a_bar_around_it():
    """powerful-gnns: ``pbar = tqdm(train_loader)``, ``for ... in pbar``, ``loss_accum / total_iters``."""
    source = '''import torch
from tqdm import tqdm
from torch.utils.data import DataLoader, TensorDataset


def train(model, train_loader, optimizer):
    total_iters = len(train_loader)
    loss_accum = 0
    pbar = tqdm(train_loader, unit='batch')
    for x, y in pbar:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_accum += loss.item()
    print("loss training: %f" % (loss_accum / total_iters))


model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
train(model, loader, opt)
'''
    assert "loss_accum = ddpkit.reduce(loss_accum, op='mean')" in plan(source).text, plan(source).text


def test_an_optimizer_built_on_the_model_is_listed_when_the_loader_is_another_modules():
    """KFAC-Pytorch converted with --imports: its loaders come from utils/, so this file shards nothing itself."""
    from ddpkit.commands.convert.crossing import settle

    files = {"data_utils.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset


def get_dataloader(batch_size):
    ds = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    return DataLoader(ds, batch_size=batch_size, shuffle=True), DataLoader(ds, batch_size=batch_size)
''', "main.py": '''import torch
from torch import nn
from optimizers import KFACOptimizer
from data_utils import get_dataloader

net = nn.Linear(4, 2)
if torch.cuda.is_available():
    net = net.cuda()
optimizer = KFACOptimizer(net, lr=0.1) if net else torch.optim.SGD(net.parameters(), lr=0.1)
trainloader, testloader = get_dataloader(16)
for x, y in trainloader:
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
'''}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert any("an optimizer built on the model itself" in x.what for x in done["main.py"].left), done["main.py"].left
