"""Defects a reviewer found in the fourteenth set's changes, each a case of its own (its repro's source)."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

T_NEVER1 = '''import os
import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
def train():
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    np.save('results/weights.npy', model.weight.detach().cpu().numpy())
def test(path=None):
    if path is not None:
        w = np.load(path)
    else:
        w = np.load('results/weights.npy')
    print(w.sum())
os.makedirs('results', exist_ok=True)
train()
test()
'''

T_NEVER2 = '''import os
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, 1)), batch_size=8)
def train():
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    torch.save(model.state_dict(), 'best.pt')
def test(path=None):
    path = path or 'best.pt'
    if path is not None:
        model.load_state_dict(torch.load(path))
    print(model.weight.sum().item())
train()
test()
'''

T_NEVER3 = '''import os
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, 1)), batch_size=8)
def train():
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    torch.save(model.state_dict(), 'best.pt')
def test(path=None):
    if path is not None:
        model.load_state_dict(torch.load(path))
    print(model.weight.sum().item())
train()
cfg = {'path': 'best.pt'}
test(**cfg)
'''

T_PATHS1 = '''import os
import torch
import torch.nn as nn
import matplotlib.pyplot as plt
import imageio
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
save_dir = 'results/'
os.makedirs(save_dir, exist_ok=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    plt.plot([1, 2])
    plt.savefig(os.path.join(save_dir, 'hist.png'))
img = imageio.imread('results/hist.png')
print(img.shape)
'''

T_PATHS2 = '''import os
import torch
import torch.nn as nn
import matplotlib.pyplot as plt
import imageio
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
save_dir = 'results/'
os.makedirs(save_dir, exist_ok=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    plt.plot([1, 2])
    plt.savefig(os.path.join('.', 'results', 'hist.png'))
img = imageio.imread('results/hist.png')
print(img.shape)
'''

T_PATHS4 = '''import os
import torch
import torch.nn as nn
import matplotlib.pyplot as plt
import imageio
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
save_dir = 'results/'
def show(path='figs/loss.png'):
    plt.plot([1, 2])
    plt.savefig(path)
cfg = {'path': 'results/hist.png'}
os.makedirs(save_dir, exist_ok=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    show(**cfg)
img = imageio.imread('results/hist.png')
print(img.shape)
'''

T_PATHS5 = '''import os
import torch
import torch.nn as nn
import matplotlib.pyplot as plt
import imageio
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
import sys
save_dir = 'results/'
if '--debug' in sys.argv:
    save_dir = 'debug/'
os.makedirs(save_dir, exist_ok=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    plt.plot([1, 2])
    plt.savefig(save_dir + 'hist.png')
img = imageio.imread('results/hist.png')
print(img.shape)
'''

T_SUMS = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, dtype=torch.long)), batch_size=8)
for epoch in range(2):
    correct = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        correct += (out.argmax(1) == y).sum().item()
    print('correct per batch', correct / len(loader))
'''

T_PPRINT = '''import argparse
from pprint import pprint
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--lr', type=float, default=0.1)
args = parser.parse_args()
pprint(args.__dict__)
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
'''

T_ALIAS5 = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
MODEL = None
def build():
    global MODEL
    MODEL = nn.Linear(4, 1)
def main():
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    build()
    model = MODEL.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    print(MODEL.weight)
main()
'''

T_DEV1 = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
DEVICE = 'cpu'
if torch.cuda.is_available():
    DEVICE = 'cuda'; torch.cuda.manual_seed_all(0); torch.backends.cudnn.benchmark = True
model = nn.Linear(4, 1).to(DEVICE)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE)).backward()
    opt.step()
'''

T_TOK = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Conv2d(3, 21, 1).to(device)
criterion = nn.CrossEntropyLoss(ignore_index=255)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.ones(16, 3, 8, 8), torch.zeros(16, 8, 8, dtype=torch.long)),
                    batch_size=4, shuffle=True)
for epoch in range(2):
    for img, mask in loader:
        img, mask = img.to(device), mask.to(device)
        loss = criterion(model(img), mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''

T_ASKED2 = '''import os
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
save_dir = 'ckpt'
if os.path.isdir(save_dir):
    raise SystemExit(save_dir + ' exists')
else:
    os.makedirs(save_dir)
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
torch.save(model.state_dict(), os.path.join(save_dir, 'm.pt'))
'''

T_ASKED3 = '''import os
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
def main():
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    save_dir = 'ckpt'
    if os.path.isdir(save_dir):
        if input('resume? [y/n] ') != 'y':
            raise SystemExit('refusing to overwrite')
        start_epoch = 2
    else:
        os.makedirs(save_dir)
        start_epoch = 0
    model = nn.Linear(4, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.ones(64, 4), torch.zeros(64, 1)), batch_size=8)
    for epoch in range(start_epoch, 3):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
main()
'''

ENGINE4_ENGINE = '''import torch
import torch.nn as nn
class trainer:
    def __init__(self, model, lr):
        self.model = model
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.loss = nn.MSELoss()
    def train(self, x, y):
        self.model.train()
        self.optimizer.zero_grad()
        loss = self.loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()
    def finetune(self, x, y):
        self.optimizer.zero_grad()
        loss = self.loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()
    def eval(self, x, y):
        self.model.eval()
        with torch.no_grad():
            return self.loss(self.model(x), y).item()
'''

ENGINE4_MAIN = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from engine import trainer
device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
ds = TensorDataset(torch.ones(64, 4), torch.zeros(64, 1))
train_loader = DataLoader(ds, batch_size=8, shuffle=True)
val_loader = DataLoader(ds, batch_size=8)
model = nn.Linear(4, 1).to(device)
engine = trainer(model, 0.01)
xs, ys = torch.ones(64, 4), torch.zeros(64, 1)
for i in range(0, 64, 8):
    engine.finetune(xs[i:i + 8].to(device), ys[i:i + 8].to(device))
for epoch in range(3):
    train_loss = 0
    for x, y in train_loader:
        train_loss += engine.train(x.to(device), y.to(device))
    train_loss = train_loss / len(train_loader)
    val_loss = []
    for x, y in val_loader:
        val_loss.append(engine.eval(x.to(device), y.to(device)))
    print(epoch, train_loss, sum(val_loss) / len(val_loss))
    torch.save(engine.model.state_dict(), 'epoch_' + str(epoch) + '.pth')
'''


def _waits(p):
    """A barrier placed, or the read listed: the ranks cannot read before rank 0 has written."""
    return "ddpkit.barrier()" in p.text or any("a file is read" in x.what for x in p.left)


@pytest.mark.parametrize("source", [T_NEVER1, T_NEVER2, T_NEVER3], ids=["else", "rebound", "starred"])
def test_a_load_that_may_run_is_still_waited_for(source):
    """``else:`` of ``if path is not None:``; ``path = path or 'best.pt'`` before the test; ``test(**cfg)``."""
    assert _waits(plan(source))


@pytest.mark.parametrize("source", [T_PATHS1, T_PATHS2, T_PATHS4, T_PATHS5],
                         ids=["join-slash", "join-dot", "starred", "rebound-in-if"])
def test_a_write_whose_path_may_be_the_read_one_is_still_waited_for(source):
    """``os.path.join('results/', 'hist.png')``, ``os.path.join('.', 'results', ...)``, ``show(**cfg)``, a folder
    rebound under an ``if``: each may name the file read below."""
    assert _waits(plan(source))


def test_a_training_sum_of_batch_sums_over_the_loaders_length_is_summed():
    """``correct += (...).sum().item()`` then ``/ len(loader)``: per batch of the global batch, N times a rank's."""
    text = plan(T_SUMS).text
    assert "correct = ddpkit.reduce(correct)" in text, text


def test_a_pretty_print_above_the_device_set_up_does_not_read_state_before_it_is_bound():
    text = plan(T_PPRINT).text
    guard = text.index("pprint(args.__dict__)")
    assert "state.is_main" not in text[:guard] or text.index("state = ddpkit.init") < guard, text


def test_a_model_alias_bound_in_another_scope_is_not_rebound_here():
    """``model = MODEL.to(device)`` in ``main()``, ``MODEL`` a module global: ``MODEL = ...`` there would make it
    local (UnboundLocalError)."""
    assert "MODEL = ddpkit.prepare_model" not in plan(T_ALIAS5).text


def test_a_folder_check_above_the_device_set_up_or_binding_names_is_guarded_safely():
    text = plan(T_ASKED2).text
    check = text.index("if os.path.isdir(save_dir)")
    assert "state.is_main" not in text[:check] or text.index("state = ddpkit.init") < check, text
    kept = plan(T_ASKED3).text  # (``start_epoch`` bound in both branches, read below: every rank needs it)
    assert "is_main:\n        if os.path.isdir" not in kept, kept


def test_a_device_upgrade_keeps_the_other_statements_of_its_line():
    text = plan(T_DEV1).text
    assert "torch.cuda.manual_seed_all(0)" in text and "torch.backends.cudnn.benchmark = True" in text, text


def test_a_second_step_fed_by_hand_is_still_refused():
    files = {"engine.py": ENGINE4_ENGINE, "main.py": ENGINE4_MAIN}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert any(x.blocks for x in done["engine.py"].left + done["main.py"].left), done["engine.py"].left


def test_a_literal_ignore_index_is_counted_or_listed_with_its_own_value():
    p = plan(T_TOK)
    said = p.text + " ".join(x.fix for x in p.left)
    assert "255" in said.replace("ignore_index=255", ""), (p.text, p.left)
