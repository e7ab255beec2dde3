"""What the sixteenth held-out set showed ``ddpkit convert`` owes public scripts (docs/convert.md): each a case
written in our own words after the pattern met."""
import os
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


BEST = '''import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
best_loss = float("inf")
for x, y in DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if {test}:
        best_loss = loss
        torch.save(model.state_dict(), "best_model.pth")
    loss.backward()
    opt.step()
'''


def test_a_save_chosen_by_the_ranks_own_loss_is_listed_and_one_by_the_mean_is_not():
    """Jack-Cherish's UNet lesson: ``if loss < best_loss: torch.save(...)`` each step; the save became rank 0's,
    chosen by rank 0's half-batch loss, and nothing said so."""
    p = plan(BEST.format(test="loss < best_loss"))
    chosen = [x for x in p.left if "this rank's loss" in x.what]  # (not the random data's line of the fixture)
    assert [x.line for x in chosen] == [10] and "ddpkit.reduce(loss.item(), op='mean')" in chosen[0].fix, p.left
    p = plan(BEST.format(test="ddpkit.reduce(loss.item(), op='mean') < best_loss"))
    assert not [x for x in p.left if "this rank's loss" in x.what], p.left


def test_a_load_in_a_function_called_after_the_training_function_waits_for_the_other_modules_save():
    """hazdzz/STGCN: ``train(...)`` then ``test(...)``, whose ``torch.load`` reads what script/earlystopping.py saved
    (rank 0 alone once converted): rank 1 read a half-written file (the barrier came only for a load below the
    training loop in its own function)."""
    from ddpkit.commands.convert.crossing import Crossing
    text = '''import torch
from torch.utils.data import DataLoader
from script import earlystopping


def train(model, opt, loader, es):
    for x in loader:
        model(x).sum().backward()
        opt.step()
    es(0.0, model)


def test(model):
    model.load_state_dict(torch.load("best.pt"))


def main():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(torch.randn(8, 2), batch_size=4, shuffle=True)
    train(model, opt, loader, earlystopping.EarlyStopping(path="best.pt"))
    test(model)


main()
'''
    done = plan(text, crossing=Crossing(own=frozenset({"script", "main"})))
    lines = done.text.splitlines()
    at = next(i for i, line in enumerate(lines) if "torch.load" in line)
    assert lines[at - 1].strip() == "ddpkit.barrier()", done.text
    stop = 'earlystopping.EarlyStopping(path="best.pt")'
    early = text.replace(f"    train(model, opt, loader, {stop})\n    test(model)",
                         f"    test(model)\n    train(model, opt, loader, {stop})")
    assert early != text
    assert "ddpkit.barrier()" not in plan(early, crossing=Crossing(own=frozenset({"script", "main"}))).text


STARS = {
    "train.py": '''import torch
from helpers import *
from layers import *

train_loader, valid_loader, mean = load_data(16)
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.01)


def train(epoch):
    for batch_idx, (x, y) in enumerate(train_loader):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()


for epoch in range(2):
    train(epoch)
''',
    "layers.py": "import torch\n\n\ndef helper(x):\n    return x * 2\n",
    "helpers.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset


def load_data(batch_size):
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    train = DataLoader(TensorDataset(x[:48], y[:48]), batch_size=batch_size, shuffle=True)
    valid = DataLoader(TensorDataset(x[48:], y[48:]), batch_size=batch_size)
    return train, valid, x.mean()
''',
}


def test_a_loader_function_from_one_of_two_star_imports_is_followed():
    """NRI: ``from utils import *`` beside ``from modules import *``, ``train_loader, ... = load_data(...)``: with
    two star imports no name was taken from either, and the training was refused as "fed by hand"."""
    from ddpkit.commands.convert.crossing import settle
    done = settle(list(STARS), lambda rel, crossing: plan(STARS[rel], crossing=crossing))
    assert not done["train.py"].left, done["train.py"].left
    assert "train = ddpkit.data_loader(" in done["helpers.py"].text, done["helpers.py"].text


def test_a_run_folder_named_by_the_clock_is_rank_0s_on_every_rank(tmp_path):
    """NRI: ``timestamp = now.isoformat()`` names ``exp<timestamp>/`` under ``if args.save_folder:``: each rank
    read its own clock, named its own folder, and rank 1 later loaded an encoder from a folder no one wrote to."""
    source = '''import argparse
import datetime
import os
import time
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--save-folder", default="logs")
args = parser.parse_args()
if args.save_folder:
    now = datetime.datetime.now()
    timestamp = now.isoformat()
    save_folder = "{}/exp{}/".format(args.save_folder, timestamp)
    os.makedirs(save_folder)
    time.sleep(0.01 * int(os.environ.get("RANK", "0")))
stamp = time.strftime("%H%M%S")
print(sorted(os.listdir(args.save_folder)))
'''
    p = plan(source)
    assert "timestamp = ddpkit.broadcast(now.isoformat())" in p.text, p.text
    assert 'stamp = ddpkit.broadcast(time.strftime("%H%M%S"))' in p.text, p.text
    (tmp_path / "train.py").write_text(p.text)
    r = ok(launch(tmp_path / "train.py", timeout=120, cwd=tmp_path))
    assert len(os.listdir(tmp_path / "logs")) == 1, (os.listdir(tmp_path / "logs"), r.stdout)


def test_a_writer_imported_in_a_try_and_a_summed_loss_over_the_kept_tokens_are_seen():
    """GPT2-NewsTitle: ``try: from torch.utils.tensorboard import SummaryWriter / except ImportError: from
    tensorboardX import ...`` (two event files: the import in a try was not read), and ``CrossEntropyLoss(
    ignore_index=0, reduction="sum")`` divided by ``labels.ne(0).long().sum().item()`` (a token mean, said nowhere)."""
    p = plan('''import torch
try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:
    from tensorboardX import SummaryWriter

writer = SummaryWriter()
''')
    assert "writer = ddpkit.summary_writer()" in p.text and "\nimport ddpkit\n" in p.text, p.text  # (not in the try)
    p = plan('''import torch
from torch import nn


class Head(nn.Module):
    def forward(self, logits, labels):
        loss_fct = nn.CrossEntropyLoss(ignore_index=0, reduction="sum")
        loss = loss_fct(logits.view(-1, logits.size(-1)), labels.view(-1))
        num = labels.ne(0).long().sum().item()
        return loss / num
''')
    assert [x.line for x in p.left] == [7] and "a mean over the tokens" in p.left[0].what, p.left


def test_a_load_after_a_training_loop_fed_from_another_module_waits():
    """FEDformer's exp_main.py: ``train()`` loops over a loader data_provider builds (a ddpkit.data_loader there),
    then loads the checkpoint utils/tools.py's EarlyStopping saved: no barrier, because no loader of this file
    was converted for training."""
    from ddpkit.commands.convert.crossing import Crossing
    text = '''import torch
from data_provider.data_factory import data_provider
from utils.tools import EarlyStopping


class Exp:
    def train(self, model, opt):
        train_loader = data_provider("train")
        stop = EarlyStopping()
        for epoch in range(2):
            for x, y in train_loader:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            stop(0.0, model, "best.pth")
        model.load_state_dict(torch.load("best.pth"))
        return model
'''
    lines = plan(text, crossing=Crossing(own=frozenset({"data_provider", "utils", "exp"}))).text.splitlines()
    at = next(i for i, line in enumerate(lines) if "torch.load" in line)
    assert lines[at - 1].strip() == "ddpkit.barrier()", lines


def test_a_file_written_with_open_is_not_waited_for_by_a_read_of_another_name():
    """The SSD tutorial's create_data_lists(): ``TRAIN_images.json`` written with ``open(..., 'w')``, then
    ``ImageSets/Main/test.txt`` read: three false "left to you" lines (file names were never compared)."""
    text = '''import json
import os


def create_data_lists(voc07_path, output_folder):
    images = []
    with open(os.path.join(voc07_path, 'ImageSets/Main/trainval.txt')) as f:
        images = f.read().splitlines()
    with open(os.path.join(output_folder, 'TRAIN_images.json'), 'w') as j:
        json.dump(images, j)
    with open(os.path.join(voc07_path, 'ImageSets/Main/test.txt')) as f:
        ids = f.read().splitlines()
    return ids
'''
    assert not plan(text).left, plan(text).left
    same = text.replace("'ImageSets/Main/test.txt'", "'TRAIN_images.json'").replace("voc07_path, 'TRAIN",
                                                                                      "output_folder, 'TRAIN")
    assert plan(same).left or "ddpkit.barrier()" in plan(same).text, plan(same).text


def test_an_evaluation_that_saves_a_picture_of_its_first_batch_keeps_its_loader_whole():
    """unnir/cVAE: ``if i == 0: save_image(comparison, ...)`` in the test loop; sharded, rank 0's first batch held
    samples 0, 2, 4, ... and the reconstruction picture showed other digits than one process's."""
    text = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision.utils import save_image

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)
for (x,) in train_loader:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
test_loss = 0
with torch.no_grad():
    for i, (x,) in enumerate(test_loader):
        test_loss += model(x).pow(2).sum().item()
        if i == 0:
            save_image(model(x).view(-1, 1, 2, 2), "reconstruction.png")
print(test_loss / len(test_loader.dataset))
'''
    p = plan(text)
    assert "test_loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)" in p.text, p.text
    assert any("save_image()" in k.what for k in p.kept), p.kept


def test_a_device_chosen_as_text_then_made_a_device_converts():
    """hkproj/pytorch-transformer: ``device = "cuda" if ... else "mps" if ... else "cpu"``, printed, then ``device =
    torch.device(device)``: refused as "chosen over several lines", though the choice is one line."""
    p = plan('''import torch

device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
print("Using device:", device)
device = torch.device(device)
model = torch.nn.Linear(2, 1).to(device)
''')
    assert not p.left, p.left
    lines = p.text.splitlines()
    assert "device = state.device.type" in lines and "device = state.device" in lines, p.text


STEP = '''import shutil
import time
import numpy as np
import torch
from sklearn.metrics import accuracy_score
from torch.utils.data import DataLoader, TensorDataset

m = torch.nn.Linear(2, 3)
o = torch.optim.SGD(m.parameters(), lr=0.1)
ds = TensorDataset(torch.randn(16, 2), torch.randint(0, 3, (16,)))
losses = []
for x, y in DataLoader(ds, batch_size=4):
    out = m(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    o.zero_grad()
    loss.backward()
    o.step()
    {step}
{after}
'''


@pytest.mark.parametrize("step, after", [
    ("losses.append(loss.detach())", "print(torch.stack(losses))"),  # tensors the script stacks
    ("if loss.item() > 3.0:\n        continue\n    losses.append(loss.item())", "print(losses)"),  # lengths differ
    ("losses.append(accuracy_score(y.numpy(), out.argmax(1).numpy(), normalize=False))", "print(losses)"),  # counts
])
def test_no_curve_averaged_that_is_no_list_of_batch_means_of_every_step(step, after):
    """Review of the curves: a curve of tensors became floats (``torch.stack`` raised), a ``continue`` before the
    append made the ranks' lists differ in length (the reduce failed), ``normalize=False`` counts were halved."""
    assert "ddpkit.reduce(torch.tensor(losses" not in plan(STEP.format(step=step, after=after)).text


def test_a_mean_in_a_copy_the_converter_guards_is_listed_not_reduced():
    """Review: ``shutil.copy(p, 'model_%.4f.pt' % np.mean(losses))`` became rank 0's with a collective inside."""
    p = plan(STEP.format(step="losses.append(loss.item())", after="torch.save(m.state_dict(), 'm.pt')\n"
                         "shutil.copy('m.pt', 'm_%.4f.pt' % np.mean(losses))"))
    assert "reduce(np.mean" not in p.text and any("a write rank 0 alone makes" in x.what for x in p.left), p.left


def test_a_clock_name_outside_the_main_block_or_above_the_init_is_listed():
    """Review: a top-level ``stamp = ddpkit.broadcast(...)`` ran again in each spawned loader worker (killed), and
    one above the script's own ``ddpkit.init(cpu=...)`` started ddpkit with the defaults first."""
    outside = "import time\nstamp = time.strftime('%H%M%S')\n\n\ndef main():\n    print(stamp)\n\n\n" \
              "if __name__ == '__main__':\n    main()\n"
    p = plan(outside)
    assert "broadcast" not in p.text and [x.line for x in p.left] == [2], p.left
    above = "import time\nimport torch\nstamp = time.strftime('%H%M%S')\n" \
            "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\nprint(stamp, device)\n"
    p = plan(above)
    assert "broadcast" not in p.text and [x.line for x in p.left] == [3], (p.left, p.text)


def test_an_epoch_mean_named_loss_and_a_summed_masked_loss_give_no_false_line():
    """Review: ``loss = total / len(loader)`` after the step loop, tested against the best (averaged across ranks
    already) was listed as a rank's own loss; ``CrossEntropyLoss(reduction='sum')`` over ``torch.where`` labels was
    listed as a token mean beside the converter's own "a sum over the batch" line."""
    epoch = BEST.replace("    if {test}:", "    pass\n    if {test}:").format(test="loss < best_loss")
    epoch = epoch.replace("for x, y in DataLoader(", "total = 0.0\nfor x, y in DataLoader(").replace(
        "    pass\n    if loss < best_loss:", "    total += loss.item()\nloss = total / 4\nif loss < best_loss:")
    epoch = epoch.replace("        best_loss = loss\n        torch.save", "    best_loss = loss\n    torch.save")
    p = plan(epoch)
    assert not [x for x in p.left if "this rank's loss" in x.what], (p.left, epoch)
    summed = MASKED_LABELS.replace("crit = nn.CrossEntropyLoss()", "crit = nn.CrossEntropyLoss(reduction='sum')")
    assert not [x for x in plan(summed).left if "a mean over the tokens" in x.what]


def test_third_review_of_the_sixteenth_fixes():
    """Review 3: a ``self.device`` re-wrap became ``state.device`` with no ``state`` (NameError: refused again, as
    before); ``reduction="mean"`` read as a sum (a token mean unsaid); a summed loss over the kept tokens also got
    the "a sum over the batch" line (whose fix would scale each step by N); an epoch loop's test of the last step's
    loss (rank 0's) no longer listed; a ``continue`` of an inner loop turned the curve off."""
    rewrap = '''import torch


class Trainer:
    def __init__(self):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.device)
        self.model = torch.nn.Linear(2, 1).to(self.device)
'''
    assert "state.device" not in plan(rewrap).text.replace("ddp_state", "")
    mean = MASKED_LABELS.replace("crit = nn.CrossEntropyLoss()", 'crit = nn.CrossEntropyLoss(reduction="mean")')
    assert [x.line for x in plan(mean).left] == [10], plan(mean).left
    over = STEP.format(step="losses.append(loss.item())", after="").replace(
        "loss = torch.nn.functional.cross_entropy(out, y)",
        "loss = torch.nn.CrossEntropyLoss(ignore_index=0, reduction='sum')(out, y)\n"
        "    loss = loss / y.ne(0).long().sum().item()")
    assert not [x for x in plan(over).left if "a sum over the batch" in x.what], plan(over).left
    last = """import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
best_loss = float("inf")
for epoch in range(2):
    for x, y in DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    if {test}:
        best_loss = loss.item()
        torch.save(model.state_dict(), "best_model.pth")
"""
    p = plan(last.format(test="loss.item() < best_loss"))
    assert [x for x in p.left if "this rank's loss" in x.what], (p.left, last)
    inner = STEP.format(step="for q in m.parameters():\n        if q.grad is None:\n            continue\n"
                             "    losses.append(loss.item())", after="print(losses)")
    assert "losses = ddpkit.reduce(torch.tensor(losses" in plan(inner).text


def test_a_mean_by_np_from_a_star_import_is_averaged_once_said():
    """NRI (after-fix re-run): ``from utils import *`` gives ``np``; ``print(..., np.mean(nll_train), ...)`` after
    the training loop and a validation loop printed rank 0's batches' mean, with no line."""
    from test_convert_fifteenth import LIST_MEAN
    p = plan(LIST_MEAN.format(end="print('a', np.mean(losses), 'b', np.mean(losses))", call="train_epoch()")
             .replace("import numpy as np\n", "from utils import *\n"))
    assert "print('a', ddpkit.reduce(np.mean(losses), op='mean'), 'b', ddpkit.reduce(np.mean(losses), op='mean'))" \
        in p.text, p.text
    assert len([e for e in p.edits if e.what.startswith("a mean of the training loop's list")]) == 1, p.edits
