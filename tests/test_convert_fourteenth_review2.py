"""Defects a second reviewer found in the fixes of the first review and the rules after them, each a case of its
own (its repro's source)."""
import pytest
from test_convert_twelfth import prints_as_one_process

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

S1 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    train_acc = 0.0
    train_loss = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = criterion(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_loss += loss.item()
        train_acc += (out.argmax(1) == y).float().mean().item()
    print(f"epoch {epoch} loss {train_loss / len(loader):.4f} acc {train_acc / len(loader):.4f}")
'''

S2 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    correct = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = criterion(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        correct += (out.argmax(1) == y).sum().item()
    print(f"epoch {epoch} correct per batch {correct / len(loader):.4f}")
'''

S3 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
n_batches = len(loader)
for epoch in range(2):
    train_acc = 0.0
    train_loss = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = criterion(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_loss += loss.item()
        train_acc += (out.argmax(1) == y).float().mean().item()
    print(f"epoch {epoch} loss {train_loss / n_batches:.4f} acc {train_acc / n_batches:.4f}")
'''

S4 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    correct = 0
    total = 0
    train_loss = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = criterion(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train_loss += loss.item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.size(0)
    print(f"epoch {epoch} loss {train_loss / len(loader):.4f} acc {correct / total:.4f}")
'''

C1 = '''import numpy as np
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
batch_size = 8
ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(ds, batch_size=batch_size)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
preds = np.zeros(len(ds))
for epoch in range(2):
    idx = 0
    for x, y in loader:
        out = model(x.to(device))
        loss = nn.functional.mse_loss(out, y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        preds[idx:idx + len(x)] = out.detach().cpu().numpy()[:, 0]
        idx += batch_size
    print(epoch, "train preds mean", preds.mean(), "filled", idx)
'''

G1 = '''import argparse, json, os
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--out', default='runs/a')
parser.add_argument('--no-cuda', action='store_true')
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, 'args.json'), 'w') as f:
    json.dump(vars(args), f)
torch.manual_seed(0)
device = torch.device("cpu" if args.no_cuda else "cuda")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
torch.save(model.state_dict(), os.path.join(args.out, 'm.pt'))
'''

G3 = '''import argparse, os, shutil
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--no-cuda', action='store_true')
parser.add_argument('--save', default='ckpt')
args = parser.parse_args()
if os.path.isdir(args.save):
    shutil.rmtree(args.save)
    os.makedirs(args.save)
else:
    os.makedirs(args.save)
torch.manual_seed(0)
device = torch.device("cpu" if args.no_cuda else "cuda")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
torch.save(model.state_dict(), os.path.join(args.save, 'm.pt'))
'''

G4 = '''import argparse, os, shutil
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--no-cuda', action='store_true')
parser.add_argument('--save', default='ckpt')
args = parser.parse_args()
if os.path.isdir(args.save):
    raise SystemExit("exists")
else:
    os.makedirs(args.save)
torch.manual_seed(0)
device = torch.device("cpu" if args.no_cuda else "cuda")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
torch.save(model.state_dict(), os.path.join(args.save, 'm.pt'))
'''

G7 = '''import argparse
from pprint import pprint
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--verbose', action='store_true')
parser.add_argument('--no-cuda', action='store_true')
args = parser.parse_args()
if args.verbose:
    pprint(vars(args))
torch.manual_seed(0)
device = torch.device("cpu" if args.no_cuda else "cuda")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
'''

A1 = '''import argparse, os
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
parser = argparse.ArgumentParser()
parser.add_argument('--save', default='ckpt')
args = parser.parse_args()
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if os.path.isdir(args.save):
    if input('resume? ') != 'y':
        raise SystemExit('exists')
    resume = True
else:
    os.makedirs(args.save)
    resume = False


def train():
    model = nn.Linear(4, 1).to(device)
    if resume:
        model.load_state_dict(torch.load(os.path.join(args.save, 'm.pt')))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    torch.save(model.state_dict(), os.path.join(args.save, 'm.pt'))


train()
'''

P3 = '''import numpy as np
import torch, torch.nn as nn
from scipy.io import wavfile
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    with torch.no_grad():
        audio = model(torch.randn(100, 4).to(device)).cpu().numpy()
    wavfile.write(f"sample_{epoch}.wav", 16000, audio)
    sr, back = wavfile.read(f"sample_{epoch}.wav")
    print(sr, back.shape)
'''

W1 = '''import os
import cv2
import numpy as np
import torch, torch.nn as nn
from scipy.io import wavfile
from torch.utils.data import DataLoader, TensorDataset
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
os.makedirs("out", exist_ok=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    img = (np.random.rand(8, 8) * 255).astype(np.uint8)
    ok = cv2.imwrite(f"out/e{epoch}.png", img)
    if not ok:
        raise RuntimeError("write failed")
    wavfile.write(f"out/e{epoch}.wav", 16000, np.zeros(100, dtype=np.int16))
    back = cv2.imread(f"out/e{epoch}.png")
    print(back.shape)
'''

W2 = '''import os
import cv2
import numpy as np
import torch, torch.nn as nn
from torch.utils.data import DataLoader, Dataset
torch.manual_seed(0)
np.random.seed(0)
os.makedirs("cache", exist_ok=True)
for i in range(32):
    cv2.imwrite(f"cache/{i}.png", (np.random.rand(4, 4) * 255).astype(np.uint8))


class Frames(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        img = cv2.imread(f"cache/{i}.png", cv2.IMREAD_GRAYSCALE)
        return torch.tensor(img, dtype=torch.float32).flatten() / 255, torch.tensor([float(i % 2)])


device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(16, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Frames(), batch_size=8, shuffle=True)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    opt.step()
print("done")
'''

M2 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
MODEL = nn.Linear(4, 1)


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
    model = MODEL.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(MODEL(x.to(device)), y.to(device)).backward()
        opt.step()
    print(MODEL.weight.sum().item())


main()
'''

F1 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)


def remember(history, key, value):
    history[key] = value


history = {}
for epoch in range(2):
    model.train()
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in test_loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction='sum')
            total += loss.item()
            remember(history, "last_batch_loss", loss.item())
    print(epoch, total / len(test_loader.dataset))
'''

F2 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)


def remember(history, key, value):
    history[key] = value


history = {}
for epoch in range(2):
    model.train()
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in train_loader:
            loss = nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction='sum')
            total += loss.item()
            remember(history, "last_batch_loss", loss.item())
    print(epoch, total / len(train_loader.dataset))
'''

F4 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        x[torch.isnan(x)] = 0.0
        return self.fc(x)


def predict(model, feats):
    feats[:, 0] = 0.0  # drop the id column
    return model(feats)


torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = Net().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
for epoch in range(2):
    model.train()
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in test_loader:
            inputs = x.to(device)
            total += nn.functional.mse_loss(predict(model, inputs), y.to(device), reduction='sum').item()
    print(epoch, total / len(test_loader.dataset))
'''

T1 = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
train_loader = DataLoader(ds, batch_size=8, shuffle=True)
val_loader = DataLoader(ds, batch_size=8)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = nn.Linear(4, 3).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
weights = torch.tensor([1.0, 2.0, 3.0])
train_criterion = nn.CrossEntropyLoss()
val_criterion = nn.CrossEntropyLoss(weight=weights.to(device))
for epoch in range(2):
    for x, y in train_loader:
        opt.zero_grad()
        train_criterion(model(x.to(device)), y.to(device)).backward()
        opt.step()
    with torch.no_grad():
        v = 0.0
        for x, y in val_loader:
            v += val_criterion(model(x.to(device)), y.to(device)).item()
    print(v / len(val_loader))
'''


@pytest.mark.parametrize("source", [S1, S2, S3, S4], ids=["loss-and-acc-means", "batch-sums", "n-batches", "beside"])
def test_training_sums_over_the_loaders_length_print_as_one_process(tmp_path, source):
    """A loss over ``len(loader)`` beside a summed ``correct / total`` came out 1/N (``len(loader)`` reduced); a
    sum of batch sums over it, 1/N; a mean of batch accuracies over ``n_batches``, N times."""
    source = source.replace("shuffle=True", "shuffle=False")
    prints_as_one_process(tmp_path, source, plan(source).text)


def test_a_counter_that_also_indexes_a_buffer_still_sizes_by_the_batch():
    """``idx += batch_size`` with ``preds[idx:idx + len(x)] = ...``: a position, not a step count."""
    assert plan(C1).left


@pytest.mark.parametrize("source", [G1, G3, G4, G7, W2], ids=["json-dump", "rmtree", "folder", "pprint-if", "cv2"])
def test_a_guard_above_the_device_set_up_never_reads_state_before_it_is_bound(source):
    p = plan(source)
    text, at = p.text, p.text.find("state = ddpkit.init")
    assert at < 0 or "state.is_main" not in text[:at], text
    if "no_cuda" in source:  # (the set-up says cpu=: ddpkit started above it would ignore it)
        assert any("before the device set-up" in x.what for x in p.left), p.left


def test_a_folder_check_binding_a_name_a_function_reads_is_not_guarded():
    p = plan(A1)
    assert "is_main:\n    if os.path" not in p.text and p.left, (p.text, p.left)


@pytest.mark.parametrize("source", [P3, W1], ids=["wavfile-read", "kept-result"])
def test_a_sound_read_back_and_a_write_whose_result_is_kept_are_said(source):
    p = plan(source)
    assert "ddpkit.barrier()" in p.text or p.left, p.text


def test_a_global_model_used_under_its_own_name_after_an_alias_is_listed():
    assert any("stays unprepared" in x.what for x in plan(M2).left)


@pytest.mark.parametrize("source", [F1, F2, F4], ids=["setting", "history", "inputs"])
def test_a_helper_that_writes_into_what_is_no_results_container_keeps_the_loaders_roles(source):
    p = plan(source)
    assert not [x for x in p.left if x.blocks] and not any("filled by" in k.what for k in p.kept), (p.left, p.kept)


def test_a_class_weight_used_only_to_validate_is_no_training_difference():
    assert not any("weighed by class" in x.what for x in plan(T1).left)
