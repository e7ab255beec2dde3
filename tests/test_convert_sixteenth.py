"""What the sixteenth held-out set showed ``ddpkit convert`` owes public scripts (docs/convert.md): each a case
written in our own words after the pattern met."""
import sys

import pytest

from conftest import launch, ok, run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

# a token tagger's loss in the model's file: labels set to the criterion's ignore_index where the mask is 0
MASKED_LABELS = '''import torch
from torch import nn


def tag_loss(logits, target, mask, classes):
    crit = nn.CrossEntropyLoss()
    keep = mask.view(-1) == 1
    flat = logits.view(-1, classes)
    labels = torch.where(keep, target.view(-1), torch.tensor(crit.ignore_index).type_as(target))
    return crit(flat, labels)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 5)

    def forward(self, ids, mask, target):
        logits = self.out(self.emb(ids))
        return logits, tag_loss(logits, target, mask, 5)
'''


def test_labels_a_mask_sets_to_the_ignored_index_make_a_token_mean_loss_listed():
    """bert-entity-extraction: ``torch.where(active, target, torch.tensor(lfn.ignore_index))`` before
    ``lfn(logits, labels)``: each rank's mean is over its own kept tokens (verify FAILed, convert said nothing)."""
    p = plan(MASKED_LABELS)
    assert [x.line for x in p.left] == [10], p.left
    assert "a mean over the tokens it does not ignore" in p.left[0].what, p.left


def test_a_joblib_dump_to_a_path_is_written_by_rank_0():
    """bert-entity-extraction's ``joblib.dump(meta_data, "meta.bin")`` beside a guarded torch.save: both ranks
    wrote it."""
    p = plan('''import joblib
import torch
from torch.utils.data import DataLoader, TensorDataset

meta = {"classes": [0, 1]}
joblib.dump(meta, "meta.bin")
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
torch.save(model.state_dict(), "model.bin")
''')
    lines = p.text.splitlines()
    at = lines.index('    joblib.dump(meta, "meta.bin")')
    assert lines[at - 1].strip().startswith("if ") and "is_main" in lines[at - 1], p.text


# kuangliu-style CIFAR recipe in a class: the criterion an attribute moved to the device, ``nn`` from a star
# import, the running sums shown by a progress function each step and the loss sum returned whole
RECIPE = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from models import *  # (``nn`` through it)
import torch.nn as tnn


def progress_bar(i, n, text):
    print(text)


class Solver:
    def __init__(self):
        self.device = torch.device("cpu")
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g))
        self.train_loader = DataLoader(data, batch_size=16, shuffle=False)
        torch.manual_seed(0)
        self.model = tnn.Linear(4, 3).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.criterion = nn.CrossEntropyLoss().to(self.device)

    def train(self):
        train_loss = 0
        train_correct = 0
        total = 0
        for batch_num, (data, target) in enumerate(self.train_loader):
            self.optimizer.zero_grad()
            output = self.model(data)
            loss = self.criterion(output, target)
            loss.backward()
            self.optimizer.step()
            train_loss += loss.item()
            total += target.size(0)
            train_correct += np.sum(output.argmax(1).numpy() == target.numpy())
            progress_bar(batch_num, len(self.train_loader), 'Acc: %d/%d' % (train_correct, total))
        return train_loss, train_correct / total


solver = Solver()
for epoch in range(2):
    print("result %.6f %.6f" % solver.train())
'''


def test_a_recipes_returned_loss_sum_is_averaged_and_its_running_sums_are_said(tmp_path):
    """soapisnotfat/pytorch-cifar10: ``return train_loss, train_correct / total`` printed rank 0's loss sum (the
    criterion, ``nn.CrossEntropyLoss().to(self.device)`` with ``nn`` from ``from models import *``, was not seen
    as a mean), and the progress bar's running counts (rank 0's share) were said nowhere."""
    p = plan(RECIPE)
    assert "train_loss = ddpkit.reduce(train_loss, op='mean')" in p.text, p.text
    kept = [k for k in p.kept if k.what.startswith("progress_bar(...) in the loop shows")]
    assert [k.line for k in kept] == [36] and "total, train_correct" in kept[0].what, p.kept
    (tmp_path / "one.py").write_text(RECIPE)
    (tmp_path / "two.py").write_text(p.text)
    (tmp_path / "models.py").write_text("from torch import nn\n")
    one = ok(run_cmd([sys.executable, tmp_path / "one.py"], timeout=60))
    two = ok(launch(tmp_path / "two.py", timeout=120))
    results = [[line for line in r.stdout.splitlines() if line.startswith("result")] for r in (one, two)]
    assert results[0] == results[1] and len(results[0]) == 2, (one.stdout, two.stdout)


CURVE = '''import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score
from torch.utils.data import DataLoader, TensorDataset


def train(model, loader, optimizer):
    losses = []
    scores = []
    for x, y in loader:
        optimizer.zero_grad()
        output = model(x)
        loss = F.cross_entropy(output, y)
        losses.append(loss.item())
        step_score = accuracy_score(y.numpy(), output.argmax(1).numpy())
        scores.append(step_score)
        loss.backward()
        optimizer.step()
    return losses, scores


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)),
                    batch_size=16)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
curve = []
for epoch in range(2):
    losses, scores = train(model, loader, opt)
    curve.append(losses)
    print("scores", ["%.4f" % s for s in scores])
np.save("curve.npy", np.array(curve))
'''


def test_a_training_curve_kept_whole_is_averaged_step_by_step(tmp_path):
    """video-classification returns its training loop's lists of per-step losses and accuracy scores and saves
    them (``np.save``): the files held rank 0's part of each batch."""
    p = plan(CURVE)
    assert "losses = ddpkit.reduce(torch.tensor(losses, dtype=torch.float64), op='mean').tolist()" in p.text, p.text
    assert "scores = ddpkit.reduce(torch.tensor(scores, dtype=torch.float64), op='mean').tolist()" in p.text, p.text
    for name, source in (("one", CURVE), ("two", p.text)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(source)
    one = ok(run_cmd([sys.executable, "train.py"], timeout=60, cwd=tmp_path / "one"))
    two = ok(launch(tmp_path / "two" / "train.py", timeout=120, cwd=tmp_path / "two"))
    shown = [[line for line in r.stdout.splitlines() if line.startswith("scores")] for r in (one, two)]
    assert shown[0] == shown[1] and len(shown[0]) == 2, (one.stdout, two.stdout)
    import numpy as np
    a, b = (np.load(tmp_path / name / "curve.npy") for name in ("one", "two"))
    assert a.shape == b.shape == (2, 4) and np.allclose(a, b, atol=1e-6), (a, b)


def test_a_curve_appended_under_a_test_or_read_through_its_mean_only_is_not_averaged_whole():
    """Appended only when a rank's own value passes a test, the ranks' lists differ in length (a collective over
    them would fail); read only through np.mean, the one number is averaged instead."""
    under = CURVE.replace("        losses.append(loss.item())", "        if loss.item() < 9:\n"
                                                                  "            losses.append(loss.item())")
    assert "losses = ddpkit.reduce(torch.tensor(losses" not in plan(under).text
    mean_only = CURVE.replace("    return losses, scores", "    return np.mean(losses), scores").replace(
        "curve.append(losses)", "curve.append([losses])")
    text = plan(mean_only).text
    assert "losses = ddpkit.reduce(torch.tensor(losses" not in text and "ddpkit.reduce(np.mean(losses)" in text, text
