"""What the fourteenth set's leftovers and the fifteenth held-out set showed ``ddpkit convert`` owes public
scripts (docs/convert.md): each a case written in our own words after the pattern met."""
import sys

import pytest

from conftest import launch, ok, run_cmd, settled

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

# a package run as ``python -m pkg`` (BERT-pytorch's layout): the entry imports its trainer relatively, through
# the trainer package's ``__init__.py``, and the trainer's one loop trains or evaluates by a flag
PACKAGE = {
    "run.py": "from pkg.__main__ import main\n\nif __name__ == '__main__':\n    main()\n",
    "pkg/__init__.py": "",
    "pkg/__main__.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset

from .trainer import Trainer
from .model import make_model


def main():
    g = torch.Generator().manual_seed(0)
    train_set = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    test_set = TensorDataset(torch.randn(10, 4, generator=g), torch.randn(10, 1, generator=g))
    train_loader = DataLoader(train_set, batch_size=4)
    test_loader = DataLoader(test_set, batch_size=4) if test_set is not None else None
    trainer = Trainer(make_model(), train_loader=train_loader, test_loader=test_loader)
    for epoch in range(2):
        trainer.train(epoch)
        trainer.test(epoch)


if __name__ == "__main__":
    main()
''',
    "pkg/model.py": "import torch\n\n\ndef make_model():\n    return torch.nn.Linear(4, 1)\n",
    "pkg/trainer/__init__.py": "from .loop import Trainer\n",
    "pkg/trainer/loop.py": '''import torch


class Trainer:
    def __init__(self, model, train_loader, test_loader=None):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device)
        self.train_data, self.test_data = train_loader, test_loader
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self, epoch):
        self.iteration(epoch, self.train_data)

    def test(self, epoch):
        self.iteration(epoch, self.test_data, train=False)

    def iteration(self, epoch, data_loader, train=True):
        seen = 0
        for x, y in data_loader:
            loss = torch.nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
            if train:
                self.optim.zero_grad()
                loss.backward()
                self.optim.step()
            seen += len(x)
            print("step", "train" if train else "test", epoch, len(x), flush=True)
''',
}


def test_a_package_trainer_imported_relatively_through_its_init_is_fed_by_its_callers_loader():
    done = settled(PACKAGE)
    main, loop = done["pkg/__main__.py"], done["pkg/trainer/loop.py"]
    assert not main.left and not loop.left, (main.left, loop.left)
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=4" in main.text, main.text
    assert "test_loader = DataLoader(test_set" in main.text, main.text
    assert any("test_loader" in k.what for k in main.kept), main.kept
    assert any("train_loader" in k.what and "ddpkit.data_loader" in k.why for k in loop.kept), loop.kept
    assert "self.model = ddpkit.prepare_model(model)" in loop.text or "ddpkit.prepare_model(" in loop.text, loop.text


def test_a_trainers_evaluation_call_through_its_training_loop_asks_no_training_loader():
    """``iteration(epoch, self.test_data, train=False)``: every backward is under ``if train:``; before, the test
    loader handed in was asked as a training loader, a false "left to you" on a right conversion."""
    files = {rel: text.replace("from .trainer import Trainer", "from pkg.trainer.loop import Trainer")
             for rel, text in PACKAGE.items()}
    done = settled(files)
    assert not done["pkg/trainer/loop.py"].left, done["pkg/trainer/loop.py"].left
    assert "test_loader = DataLoader(test_set" in done["pkg/__main__.py"].text, "the evaluation set was sharded"


@pytest.mark.parametrize("call", ["self.iteration(epoch, self.test_data, train=True)",
                                  "self.iteration(epoch, self.test_data)"])
def test_a_second_call_that_trains_still_asks_for_both_loaders(call):
    """The test loader trained on too (``train=True``, or the default): it is asked, and sharded, as a training
    loader."""
    files = dict(PACKAGE)
    files["pkg/trainer/loop.py"] = files["pkg/trainer/loop.py"].replace(
        "self.iteration(epoch, self.test_data, train=False)", call)
    done = settled(files)
    assert "test_loader = ddpkit.data_loader(test_set" in done["pkg/__main__.py"].text, done["pkg/__main__.py"].text
    assert any("test_loader" in k.what for k in done["pkg/trainer/loop.py"].kept), done["pkg/trainer/loop.py"].kept


def test_a_package_converted_with_imports_launches_one_shard_per_rank(tmp_path):
    for rel, text in PACKAGE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    out = tmp_path / "out"
    said = ok(run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", out, tmp_path / "run.py"]))
    assert "left to you" not in said.stdout + said.stderr, said.stdout + said.stderr
    r = ok(launch(out / "run.py", timeout=180, cwd=out))
    steps = [line.split() for line in r.stdout.splitlines() if line.startswith("step ")]
    trained = sum(int(s[3]) for s in steps if s[1] == "train" and s[2] == "0")
    tested = sum(int(s[3]) for s in steps if s[1] == "test" and s[2] == "0")
    # printed by rank 0 (ddpkit.print): its half of the 24 training samples, and the whole test set
    assert (trained, tested) == (12, 10), r.stdout


VOCAB = '''import pickle
from collections import Counter


class Vocab:
    def __init__(self, words):
        self.itos = sorted(Counter(words))

    def save_vocab(self, vocab_path):
        with open(vocab_path, "wb") as f:
            pickle.dump(self.itos, f)

    @staticmethod
    def load_vocab(vocab_path):
        with open(vocab_path, "rb") as f:
            return pickle.load(f)


def build(corpus_path, output_path):
    with open(corpus_path) as f:
        vocab = Vocab(f.read().split())
    vocab.save_vocab(output_path)
'''


def test_a_save_and_load_pair_of_methods_no_function_runs_both_is_kept_not_left():
    """BERT-pytorch's vocab.py: ``save_vocab(path)`` and ``load_vocab(path)``, each given its path; the build tool
    reads its corpus, then saves: no race in this file, said as kept with what a caller owes."""
    p = plan(VOCAB)
    assert not p.left, p.left
    assert any("load_vocab" in k.what and "barrier" in k.why for k in p.kept), p.kept


@pytest.mark.parametrize("caller", ["\n\ndef refresh(path):\n    Vocab(['a']).save_vocab(path)\n"
                                    "    return Vocab.load_vocab(path)\n",
                                    "\n\nVocab(['a']).save_vocab('v.pkl')\nprint(Vocab.load_vocab('v.pkl'))\n"])
def test_a_function_of_the_file_that_saves_then_loads_still_owes_the_barrier(caller):
    p = plan(VOCAB + caller)
    assert p.left and "barrier" in p.left[0].fix, (p.left, p.kept)


SHARED_CRITERION = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ids = torch.randint(0, 9, (16, 5))
is_next = torch.randint(0, 2, (16,))
loader = DataLoader(TensorDataset(ids, is_next), batch_size=4, shuffle=True)
emb, head, nsp = nn.Embedding(9, 8), nn.Linear(8, 9), nn.Linear(8, 2)
model = nn.ModuleList([emb, head, nsp])
criterion = nn.NLLLoss(ignore_index=0)
opt = torch.optim.Adam(model.parameters())
for x, nxt in loader:
    h = emb(x)
    mask_loss = criterion(head(h).log_softmax(-1).transpose(1, 2), x)
    next_loss = criterion(nsp(h.mean(1)).log_softmax(-1), nxt)
    loss = mask_loss + next_loss
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_one_token_mean_criterion_serving_two_losses_is_listed_with_both_lines():
    p = plan(SHARED_CRITERION)
    said = [e for e in p.left if "NLLLoss" in e.what]
    assert said and "serves 2 losses of one step (lines 14, 15)" in said[0].what, p.left
    single = plan(SHARED_CRITERION.replace("next_loss = criterion(", "next_loss = nn.functional.nll_loss("))
    assert all("serves" not in e.what for e in single.left), single.left
    # (review: two calls on one line are two losses; one call in each of two loops is one loss each)
    one_line = plan(SHARED_CRITERION.replace("    next_loss = criterion(nsp(h.mean(1)).log_softmax(-1), nxt)\n", "")
                    .replace("mask_loss = criterion(", "loss = criterion(nsp(h.mean(1)).log_softmax(-1), nxt) + "
                             "criterion(").replace("    loss = mask_loss + next_loss\n", ""))
    assert any("serves 2 losses of one step (line 14)" in e.what for e in one_line.left), one_line.left
    first = SHARED_CRITERION.replace("    next_loss = criterion(nsp(h.mean(1)).log_softmax(-1), nxt)\n", "") \
        .replace("loss = mask_loss + next_loss", "loss = mask_loss")
    two_loops = plan(first + first[first.index("for x, nxt"):])
    assert all("serves" not in e.what for e in two_loops.left), two_loops.left


ON_PATH_RUN = '''import os
import sys
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from lib.data import get_loader
from lib.inits import init_optim

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
seen = 0
loader = get_loader()
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen += len(x)
print("seen", seen, "weight", round(float(model.weight.sum()), 6))
'''

ON_PATH_DATA = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def get_loader():
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return DataLoader(ds, batch_size=4)
'''

ON_PATH_INITS = '''import torch


def init_optim(model, lr):
    return torch.optim.Adam(model.parameters(), lr=lr)
'''


def test_a_script_that_puts_its_repository_on_sys_path_is_converted_with_the_modules_it_imports_there(tmp_path):
    """AGCRN's ``model/Run.py`` appends the repository to ``sys.path`` and imports ``lib.dataloader``: --imports read
    only the script's folder, so the loader stayed unsharded (every rank trained on every batch); an optimizer helper
    no file calls was refused."""
    (tmp_path / "model").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "model" / "run.py").write_text(ON_PATH_RUN)
    (tmp_path / "lib" / "data.py").write_text(ON_PATH_DATA)
    (tmp_path / "lib" / "inits.py").write_text(ON_PATH_INITS)
    out = tmp_path / "out"
    said = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", out, tmp_path / "model" / "run.py"])
    assert said.returncode == 0, said.stderr
    assert "ddpkit.data_loader(" in (out / "lib" / "data.py").read_text(), said.stderr
    assert "init_optim(), which no file of the project calls" in said.stderr, said.stderr
    one = ok(run_cmd([sys.executable, tmp_path / "model" / "run.py"], timeout=60, cwd=tmp_path))
    two = ok(launch(out / "model" / "run.py", timeout=120, cwd=out))
    # (the samples seen printed alone: every rank's since the seventeenth set, as one process printed them)
    assert one.stdout.split()[:2] == ["seen", "32"] and two.stdout.split()[:2] == ["seen", "32"], (one.stdout,
                                                                                                two.stdout)


# the first review of this change (c8492f1): each case failed there


def _with_loop(iteration, test_call):
    files = dict(PACKAGE)
    loop = files["pkg/trainer/loop.py"]
    head = loop[:loop.index("    def iteration(")]
    files["pkg/trainer/loop.py"] = head.replace("self.iteration(epoch, self.test_data, train=False)", test_call) + \
        iteration
    return settled(files)


ELSE_FLAG = '''    def iteration(self, epoch, data_loader, evaluate=False):
        for x, y in data_loader:
            loss = torch.nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
            if evaluate:
                pass
            else:
                self.optim.zero_grad()
                loss.backward()
                self.optim.step()
'''

AMP_FLAG = '''    def iteration(self, epoch, data_loader, amp=False):
        for x, y in data_loader:
            loss = torch.nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
            self.optim.zero_grad()
            if amp:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            self.optim.step()
'''


@pytest.mark.parametrize("iteration, test_call, test_sharded", [
    (ELSE_FLAG, "self.iteration(epoch, self.test_data, evaluate=True)", False),  # the backward in the else
    (AMP_FLAG, "self.iteration(epoch, self.test_data)", True),  # a backward in each branch: both calls train
])
def test_a_flag_whose_backward_is_in_the_else_or_in_both_branches_is_read_right(iteration, test_call, test_sharded):
    """Review D1: the backward in the ``else`` of ``if evaluate:`` was read as switched off when the flag is
    False: the training call taken for an evaluation, its loader kept whole (each rank trained on all of it)."""
    main = _with_loop(iteration, test_call)["pkg/__main__.py"]
    assert "train_loader = ddpkit.data_loader(train_set" in main.text, main.text
    assert ("test_loader = ddpkit.data_loader(test_set" in main.text) == test_sharded, main.text


SUMMED_FLAG = '''    def iteration(self, epoch, data_loader, train=True):
        total_loss, total = 0.0, 0
        for x, y in data_loader:
            loss = torch.nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device), reduction="sum")
            if train:
                self.optim.zero_grad()
                (loss / len(x)).backward()
                self.optim.step()
            total_loss += loss.item()
            total += len(x)
        print("EP", epoch, "train" if train else "test", total_loss / total, total)
'''


MIXED_FLAG = SUMMED_FLAG.replace("            total += len(x)\n", "            total += len(x)\n"
                                 "            hits += int((y > 0).sum())\n            seen += y.nelement()\n") \
    .replace("total_loss, total = 0.0, 0", "total_loss, total, hits, seen = 0.0, 0, 0, 0") \
    .replace("total_loss / total, total)", "total_loss / total, total, hits / seen)")


@pytest.mark.parametrize("iteration, sharded, said", [
    (SUMMED_FLAG, False, True),  # summed across ranks: kept whole it counts N times, sharded its shards pad
    (SUMMED_FLAG.replace("total_loss / total, total", "total"), False, False),  # no sum read: kept whole
    (MIXED_FLAG, False, True),
])
def test_an_evaluation_call_of_a_training_loop_with_sums_keeps_or_says(iteration, sharded, said):
    """Review D3: the test loader was sharded as a training loader while the loop kept sums rank 0's (the test
    accuracy of half the set); kept whole, a sum reduced across ranks would count it N times; sharded as the
    training set is (second review), 11 test samples padded to 12 were counted."""
    done = _with_loop(iteration, "self.iteration(epoch, self.test_data, train=False)")
    text = done["pkg/__main__.py"].text
    assert ("test_loader = ddpkit.data_loader(test_set" in text) == sharded, text
    left = [x for x in done["pkg/trainer/loop.py"].left if "as an evaluation" in x.what]
    assert bool(left) == said, (done["pkg/trainer/loop.py"].left, done["pkg/trainer/loop.py"].text)


SAVED_THROUGH = '''import json


def save_history(path, hist):
    with open(path, "w") as f:
        json.dump(hist, f)


def load_history(path):
    with open(path) as f:
        return json.load(f)


def {writer}(path):
    for epoch in range(2):
        if epoch == 1:  # (saved in an if: a barrier there would not be passed by every rank)
            save_history(path, {{"loss": [1.0]}})


def {reader}(path):
    {body}


def main():
    {calls}


main()
'''


@pytest.mark.parametrize("writer, reader, body, calls", [
    ("train", "report", "print(load_history(path))", "train('h.json')\n    report('h.json')"),  # through callees
    ("train", "step", "print(load_history(path))\n    train(path)",  # the reader runs the writer, in a loop
     "for epoch in range(3):\n        step('h.json')"),
])
def test_a_write_and_a_read_some_function_runs_both_still_owe_a_barrier(writer, reader, body, calls):
    """Review D2 / D6: only the direct callers were compared, and a function that reads and then calls the writer
    was taken for a read before the write: rank 1 read before (or a round after) rank 0 wrote."""
    p = plan(SAVED_THROUGH.format(writer=writer, reader=reader, body=body, calls=calls))
    assert any("barrier" in x.fix for x in p.left), (p.left, p.kept)


STAR_INIT = {"pkg/trainer/__init__.py": "from .loop import *\n"}
MODULE_IMPORTED = {"pkg/__main__.py": PACKAGE["pkg/__main__.py"].replace(
    "from .trainer import Trainer", "from . import trainer as tr").replace("Trainer(make_model()",
                                                                          "tr.Trainer(make_model()")}


@pytest.mark.parametrize("changed", [STAR_INIT, MODULE_IMPORTED], ids=["star", "module"])
def test_a_star_re_export_and_a_module_imported_from_its_package_are_followed(changed):
    """Review D8 / D5: ``from .loop import *`` in the package's init, and ``from . import trainer as tr`` then
    ``tr.Trainer``: the trainer's module was not found, the training loader kept whole."""
    done = settled({**PACKAGE, **changed})
    assert "train_loader = ddpkit.data_loader(train_set" in done["pkg/__main__.py"].text, done["pkg/__main__.py"].text
    assert not done["pkg/trainer/loop.py"].left, done["pkg/trainer/loop.py"].left


def test_a_loop_over_a_local_function_that_may_return_an_empty_list_converts(tmp_path):
    """Bert-Chinese-Text-Classification's vendored tokenizer: ``return []`` in a function whose result a loop reads
    crashed convert --imports (IndexError in imported.py)."""
    (tmp_path / "tok.py").write_text("def split(text):\n    text = text.strip()\n    if not text:\n        return []\n"
                                     "    return text.split()\n\n\ndef tokenize(text):\n    out = []\n"
                                     "    toks = split(text)\n    for token in toks:\n"
                                     "        out.append(token.lower())\n"
                                     "    return out\n")
    (tmp_path / "train.py").write_text(SHARED_CRITERION.replace("import torch\n", "import torch\nfrom tok import "
                                                                "tokenize\nprint(tokenize('a B'))\n", 1))
    said = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", tmp_path / "out",
                    tmp_path / "train.py"])
    assert "Traceback" not in said.stderr and said.returncode in (0, 1), said.stderr
    assert "ddpkit.data_loader(" in (tmp_path / "out" / "train.py").read_text()


SKIPS_BY_SIZE = '''import argparse
import torch
from torch import nn
import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--batch_size", type=int, default=8)
args = p.parse_args()
torch.manual_seed(0)
ds = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
loader = ddpkit.data_loader(ds, batch_size=args.batch_size, shuffle=True)
model = ddpkit.prepare_model(nn.Linear(4, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for x, y in loader:
        if x.size(0) != args.batch_size:
            continue
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_verify_cannot_compare_runs_that_took_different_numbers_of_steps(tmp_path):
    """SN-GAN skips a batch whose size is not its --batch_size: the one-process run, on the N x B batch of a kept
    per-process batch, skipped every batch and never stepped; verify said FAIL, "rank-dependent code"."""
    from ddpkit.commands.verify.command import CANNOT_COMPARE

    script = tmp_path / "skips.py"
    script.write_text(SKIPS_BY_SIZE)
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", script], timeout=300)
    assert r.returncode == CANNOT_COMPARE, r.stdout + r.stderr[-2000:]
    assert "different numbers of optimizer steps: 0 at 1 process" in r.stderr, r.stderr[-2000:]


def test_an_animation_saved_in_a_sampling_loop_is_written_by_rank_0():
    """Conditional_Diffusion_MNIST saves a gif per guidance weight inside its epoch loop: every rank wrote it."""
    p = plan('''import matplotlib.pyplot as plt
from matplotlib.animation import FuncAnimation, PillowWriter
import torch

model = torch.nn.Linear(2, 2)
opt = torch.optim.Adam(model.parameters())
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
for ep in range(2):
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    for w in (0.0, 0.5):
        fig, ax = plt.subplots()
        ani = FuncAnimation(fig, lambda i: None, frames=3)
        ani.save(f"gif_ep{ep}_w{w}.gif", dpi=100, writer=PillowWriter(fps=5))
''')
    assert "is_main:\n            ani.save(" in p.text, p.text


REBUILT_LOADER = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ds = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))


def sample_data(dataset, batch_size):
    loader = DataLoader(dataset, shuffle=True, batch_size=batch_size)
    loader = iter(loader)
    while True:
        try:
            yield next(loader)
        except StopIteration:
            loader = DataLoader(dataset, shuffle=True, batch_size=batch_size)
            loader = iter(loader)
            yield next(loader)


model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = sample_data(ds, 8)
for i in range(8):
    x, y = next(data)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_loader_rebuilt_when_it_runs_dry_is_no_read_sized_for_the_batch():
    """glow-pytorch: the rebuild's ``batch_size=batch_size`` was read as the loop sizing something from the batch:
    the first loader kept per process (global 16 at 2) and the rebuild made global (8), with a false line."""
    p = plan(REBUILT_LOADER)
    assert [x.line for x in p.left if "kept per process" in x.what] == [], p.left
    assert p.text.count("global_batch_size=batch_size") == 2, p.text
    # (review: rebuilt, a ddpkit.data_loader reads epoch 0's order again each time: said where it is rebuilt)
    assert [x.line for x in p.left] == [15] and "set_epoch" in p.left[0].fix, p.left


LIST_MEAN = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.0)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=16)


def train_epoch():
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    {end}


{call}
'''


@pytest.mark.parametrize("end, call", [
    ("return sum(losses) / len(losses)", "print('Training loss: %.6f' % train_epoch())"),  # STGCN-PyTorch
    ("print('Training loss: %.6f' % np.mean(losses))", "train_epoch()"),
    ("print('Training loss: %.6f' % torch.mean(torch.FloatTensor(losses)))", "train_epoch()"),  # a DCGAN's
    ("with torch.no_grad():\n        print('Training loss: %.6f' % np.mean(losses))", "train_epoch()"),  # review 3
])
def test_a_mean_of_the_training_loops_list_is_averaged_where_it_is_written(tmp_path, end, call):
    """STGCN-PyTorch returns ``sum(losses) / len(losses)`` of its training loop's list: printed and pickled, it was
    rank 0's batches' mean (only ``m = np.mean(l)`` statements were averaged)."""
    source = LIST_MEAN.format(end=end, call=call)
    p = plan(source)
    assert "ddpkit.reduce(" in p.text and "op='mean')" in p.text, p.text
    (tmp_path / "one.py").write_text(source)
    (tmp_path / "two.py").write_text(p.text)
    one = ok(run_cmd([sys.executable, tmp_path / "one.py"], timeout=60))
    two = ok(launch(tmp_path / "two.py", timeout=120))
    assert one.stdout.split() == two.stdout.split(), (one.stdout, two.stdout)


def test_a_mean_a_scheduler_steps_by_is_averaged_and_one_under_a_test_is_listed():
    """Review 3: ``sched.step(np.mean(losses))`` (ReduceLROnPlateau on each rank's own mean: the ranks' learning
    rates could part) and a mean under an ``if`` (not every rank may reach a collective there) were said nowhere."""
    p = plan(LIST_MEAN.format(end="sched.step(np.mean(losses))", call="train_epoch()").replace(
        "g = torch", "sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)\ng = torch"))
    assert "sched.step(ddpkit.reduce(np.mean(losses), op='mean'))" in p.text, p.text
    for end in ("history.append(sum(losses) / len(losses))", "logging.getLogger('x').warning('%.4f', np.mean(losses))"):
        p = plan(LIST_MEAN.format(end=end, call="history = []\ntrain_epoch()").replace("import numpy", "import "
                                                                                          "logging\nimport numpy"))
        assert "ddpkit.reduce(" in p.text and not p.left, (end, p.left)  # (review: listed "under a test")
    p = plan(LIST_MEAN.format(end="if losses:\n        print(np.mean(losses))", call="train_epoch()"))
    assert "ddpkit.reduce" not in p.text and [x.line for x in p.left] == [21], p.left
    assert "m = ddpkit.reduce(m, op='mean') right after the loop" in p.left[0].fix, p.left


def test_a_training_loader_built_with_shuffle_false_is_said_in_order():
    """Review note: ``DataLoader(..., shuffle=False)`` was said "reshuffled every epoch" (the output kept it)."""
    p = plan(LIST_MEAN.format(end="pass", call="train_epoch()").replace("batch_size=16)", "batch_size=16, "
                                                                        "shuffle=False)"))
    said = [e.why for e in p.edits if e.what.startswith("DataLoader -> ddpkit.data_loader")]
    assert said == ["training: each rank takes its own shard, in order (shuffle=False, kept)"], said


LOGGED = {
    "train.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset
from utils import Logger

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)), batch_size=8,
                    shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
logger = Logger("log.txt")
logger.set_names(["Epoch", "Loss"])
for epoch in range(3):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    logger.append([epoch, round(loss.item(), 3)])
logger.close()
''',
    "utils/__init__.py": "from .logger import *\nfrom .misc import *\n",
    "utils/logger.py": '''class Logger:
    def __init__(self, fpath):
        self.file = open(fpath, "w")

    def set_names(self, names):
        self.file.write("\\t".join(names) + "\\n")

    def append(self, numbers):
        self.file.write("\\t".join(str(n) for n in numbers) + "\\n")
        self.file.flush()

    def close(self):
        self.file.close()
''',
    "utils/misc.py": '''import torch
from torch.utils.data import DataLoader


def get_mean_and_std(dataset):
    loader = DataLoader(dataset, batch_size=1, shuffle=True)
    mean = torch.zeros(3)
    for inputs, targets in loader:
        mean += inputs.mean()
    return mean / len(dataset)
''',
}


def test_a_logger_class_that_keeps_its_file_open_writes_one_copy_and_an_uncalled_helper_is_kept(tmp_path):
    """RAdam's CIFAR recipe: ``Logger(path)`` from utils/ keeps ``open(fpath, 'w')`` and appends a row per epoch
    (both ranks wrote it: rows run together); utils/misc.py's ``get_mean_and_std``, which nothing calls, refused
    the whole --imports conversion ("a DataLoader whose role cannot be told")."""
    for rel, text in LOGGED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    out = tmp_path / "out"
    said = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", out, tmp_path / "train.py"])
    assert said.returncode == 0, said.stderr
    assert "get_mean_and_std(), which no file of the project calls" in said.stderr, said.stderr
    ok(launch(out / "train.py", timeout=120, cwd=out))
    rows = (out / "log.txt").read_text().splitlines()
    assert rows[0] == "Epoch\tLoss" and len(rows) == 4 and [r.split("\t")[0] for r in rows[1:]] == ["0", "1", "2"], \
        rows


def test_a_device_chosen_after_the_loaders_from_availability_alone_converts():
    """x-vector-pytorch: ``use_cuda = torch.cuda.is_available()`` and the device after the loaders: refused as
    "starts ddpkit before the device set-up can say cpu=", though that choice is the defaults'."""
    source = '''import torch
from torch import nn

torch.manual_seed(0)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))),
                                     batch_size=8, shuffle=True)
use_cuda = torch.cuda.is_available()
device = torch.device("cuda" if use_cuda else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''
    p = plan(source)
    assert not p.refused and not p.left, p.left
    chosen = plan(source.replace("use_cuda = torch.cuda.is_available()", "use_cuda = args.cuda"))
    assert chosen.refused, "a user's switch read after the loaders still cannot say cpu= in time"


@pytest.mark.parametrize("save, said", [("torch.save(net.state_dict(), 'ckpt.pth')", True),
                                        ("torch.save(net.module.state_dict(), 'ckpt.pth')", False)])
def test_a_deleted_dataparallel_wrap_says_the_checkpoint_keys_lose_module(save, said):
    """Knowledge-Distillation-Zoo: the original saved its DataParallel's state_dict ('module.' keys), the project's
    own loader keeps the keys its DataParallel model has: converted, it silently loaded 0 of 128 tensors."""
    p = plan(LIST_MEAN.format(end="pass", call="train_epoch()").replace(
        "opt = torch.optim.SGD(", "net = torch.nn.DataParallel(net)\nopt = torch.optim.SGD(") + save + "\n")
    kept = [k for k in p.kept if "'module.' prefix" in k.what]
    assert bool(kept) == said, p.kept


FACTOR = {
    "data.py": '''import torch
from torch.utils.data import DataLoader


def return_data(args):
    train_loader = DataLoader(torch.randn(64, 4), batch_size=args.batch_size, shuffle=True, drop_last=True)
    data_loader = train_loader
    return data_loader
''',
    "solver.py": '''import os
import torch
import torch.nn.functional as F
from data import return_data


class Solver:
    def __init__(self, args):
        self.batch_size = args.batch_size
        self.data_loader = return_data(args)
        self.D = torch.nn.Linear(4, 2)
        self.optim = torch.optim.Adam(self.D.parameters(), lr=1e-3)
        self.ckpt_dir = "ckpt"
        if args.ckpt_load:
            self.load_checkpoint(args.ckpt_load)

    def train(self):
        zeros = torch.zeros({size}, dtype=torch.long)
        for step in range(2):
            for x in self.data_loader:
                loss = F.cross_entropy(self.D(x), zeros[:x.size(0)])
                self.optim.zero_grad()
                loss.backward()
                self.optim.step()
                if step == 1:
                    self.save_checkpoint(str(step))

    def save_checkpoint(self, name):
        with open(os.path.join(self.ckpt_dir, name), "wb+") as f:
            torch.save(self.D.state_dict(), f)

    def load_checkpoint(self, name):
        path = os.path.join(self.ckpt_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                self.D.load_state_dict(torch.load(f))
''',
    "main.py": '''import argparse
from solver import Solver

p = argparse.ArgumentParser()
p.add_argument("--batch_size", type=int, default=16)
p.add_argument("--ckpt_load", default=None)
Solver(p.parse_args()).train()
''',
}


@pytest.mark.parametrize("size, said", [("self.batch_size", True), ("64", False)])
def test_factorvae_a_returned_copy_of_the_loader_a_start_up_load_and_targets_sized_by_the_batch(size, said):
    """FactorVAE: ``data_loader = train_loader`` then ``return data_loader`` was not taken for the loader asked
    ("not converted there", false); ``load_checkpoint`` called from ``__init__`` reads before any save (two false
    barrier lines); ``torch.zeros(self.batch_size)`` sized targets of B for a rank's B/N batch (a crash, unsaid)."""
    files = {rel: text.replace("{size}", size) for rel, text in FACTOR.items()}
    done = settled(files)
    assert "ddpkit.data_loader(torch.randn(64, 4), global_batch_size=args.batch_size" in done["data.py"].text
    left = done["solver.py"].left
    # (the load in ``__init__``: main.py may build a second Solver after training; review 3 kept the barrier line)
    assert [x.line for x in left if "barrier" not in x.fix] == ([18] if said else []), left
    assert said == any("zeros(self.batch_size" in x.what for x in left)


def test_a_script_converted_alone_says_which_module_of_its_folder_writes_files(tmp_path):
    """RAdam's cifar.py and randomized smoothing's train.py, converted alone: ``Logger(path)`` / ``log(path, row)``
    of a module beside them writes log.txt, which every rank then wrote (rows twice, run together); nothing said."""
    for rel, text in LOGGED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text.replace("from .misc import *\n", ""))
    said = run_cmd([sys.executable, "-m", "ddpkit", "convert", "-o", tmp_path / "alone.py", tmp_path / "train.py"])
    assert said.returncode == 1, said.stderr
    assert "left to you: Logger (utils/logger.py:3, open(..., 'w')) writes a file" in said.stderr, said.stderr
    assert "ddpkit convert --imports" in said.stderr


def test_a_batch_sampler_that_groups_samples_is_not_told_to_become_a_sampler():
    """triplet-reid's P x K identity sampler: "pass sampler= and batch_size=" dealt each identity's images to
    different ranks (every anchor without a positive)."""
    p = plan(LIST_MEAN.format(end="pass", call="train_epoch()").replace(
        "batch_size=16)", "batch_sampler=BalancedSampler(4, 4))"))
    said = [x for x in p.left if "batch_sampler" in x.what]
    assert said and said[0].blocks and "groups samples: keep it per rank yourself" in said[0].fix, p.left


SCINET = {
    "exps/__init__.py": "",
    "exps/basic.py": '''import os
import torch


class ExpBasic:
    def __init__(self, args):
        self.args = args
        self.model = torch.nn.Linear(4, 2)

    def _acquire_device(self):
        os.environ["CUDA_VISIBLE_DEVICES"] = str(self.args.gpu)
        return torch.device("cuda:0")
''',
    "exps/tools.py": '''import os
import torch


def save_model(epoch, model, model_dir):
    if not os.path.exists(model_dir):
        os.makedirs(model_dir)
    torch.save({"epoch": epoch, "model": model.state_dict()}, os.path.join(model_dir, "m.bin"))


def load_model(model, model_dir):
    file_name = os.path.join(model_dir, "m.bin")
    if not os.path.exists(file_name):
        return model, 0
    checkpoint = torch.load(file_name)
    model.load_state_dict(checkpoint["model"])
    return model, checkpoint["epoch"]
''',
    "exps/exp.py": '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from exps.basic import ExpBasic
from exps.tools import load_model, save_model


class Exp(ExpBasic):
    def _select_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self):
        loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=8, shuffle=True)
        opt = self._select_optimizer()
        if self.args.resume:
            self.model, epoch_start = load_model(self.model, "ckpt")
        else:
            epoch_start = 0
        for epoch in range(epoch_start, 2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(self.model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        save_model(2, self.model, "ckpt")
''',
    "run.py": '''import argparse
from exps.exp import Exp

p = argparse.ArgumentParser()
p.add_argument("--resume", action="store_true")
p.add_argument("--gpu", type=int, default=0)
Exp(p.parse_args()).train()
''',
}


def test_scinet_a_model_reloaded_under_resume_a_save_load_pair_and_an_uncalled_device_method():
    """SCINet: ``self.model, e = load_model(self.model, path)`` under ``if resume`` was taken for the model's build
    (wrapped in that branch, listed, stopped at the first step); utils/tools.py's save_model / load_model pair
    owed a barrier in a file where nothing runs both; ``_acquire_device`` (never called) set CUDA_VISIBLE_DEVICES."""
    done = settled(SCINET)
    assert "self.model = ddpkit.prepare_model(torch.nn.Linear(4, 2))" in done["exps/basic.py"].text, \
        done["exps/basic.py"].text
    for rel in ("exps/basic.py", "exps/exp.py"):
        assert not done[rel].left, (rel, done[rel].left)
    # (exp.py runs both save_model and load_model: the pair owes its barrier there, review 3)
    assert [x.line for x in done["exps/tools.py"].left] == [8], done["exps/tools.py"].left


def test_a_tensor_made_before_the_loop_under_a_name_the_loop_rebinds_sizes_nothing():
    """jcjohnson's lesson with a DataLoader: ``x = torch.randn(N, D_in)`` is the data, and ``for x, y in loader``
    rebinds ``x``: listed as "the training loop reads x, sized for a batch of N" (false)."""
    p = plan('''import torch
from torch.utils.data import DataLoader, TensorDataset

N, D_in, D_out = 64, 10, 2
x = torch.randn(N, D_in)
y = torch.randn(N, D_out)
model = torch.nn.Linear(D_in, D_out)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
loader = DataLoader(TensorDataset(x, y), batch_size=N)
for t in range(5):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
''')
    assert not [x for x in p.left if "kept per process" in x.what], p.left


# the second review of this session's change (3b5dc89..d9cead5): each case failed at d9cead5

REVIEW2_X_MODE = '''import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(ds, batch_size=8, shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
log = open("log.txt", "x")
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(f"{loss.item()}\\n")
log.close()
'''
REVIEW2_READ_BACK = '''import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
words = ["a", "b", "c", "d"]
out = open("vocab.txt", "w")
for w in words:
    out.write(w + "\\n")
out.close()
vocab = open("vocab.txt").read().split()
ds = TensorDataset(torch.randn(64, 4), torch.randn(64, len(vocab)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
model = torch.nn.Linear(4, len(vocab))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
'''
REVIEW2_SAVED_MEAN = '''import json
import numpy as np
import torch
torch.manual_seed(0)
from torch.utils.data import DataLoader, TensorDataset

ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(ds, batch_size=8, shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save({"model": model.state_dict(), "loss": np.mean(losses)}, "ckpt.pt")
    with open("log.txt", "a") as f:
        f.write(f"{epoch} {sum(losses) / len(losses)}\\n")
'''


@pytest.mark.parametrize("source", [REVIEW2_X_MODE, REVIEW2_READ_BACK,
                                    REVIEW2_X_MODE.replace('"x")', '"w")').replace("import torch\n", "import torch\n"
                                                                                  "os = 3\n", 1)])
def test_a_kept_open_file_the_null_device_cannot_stand_in_for_is_left(source):
    """Review 2: ``open(p, "x")`` on os.devnull raised FileExistsError; a file written then read back by the script
    got no barrier (rank 1 read before rank 0 wrote); a name ``os`` of the script's own shadowed the module."""
    p = plan(source)
    assert any("kept open" in x.what for x in p.left) and "os.devnull" not in p.text, p.left


def test_a_mean_of_the_training_list_inside_a_save_rank_0_makes_is_not_reduced_there():
    """Review 2: ``torch.save({..., "loss": np.mean(losses)})``, guarded to rank 0, got a collective inside: the
    other ranks never joined it (a hang)."""
    p = plan(REVIEW2_SAVED_MEAN)
    assert "ddpkit.reduce(np.mean" not in p.text and "ddpkit.reduce(sum(" not in p.text, p.text


REVIEW2_SKIPS_ONE = '''import torch
import ddpkit
torch.manual_seed(0)
ds = torch.utils.data.TensorDataset(torch.randn(18, 4), torch.randn(18, 1))
loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)
model = ddpkit.prepare_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    if x.size(0) < 2:  # BatchNorm needs two samples
        continue
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_runs_that_both_stepped_a_different_number_of_times_are_still_compared(tmp_path):
    """Review 2: a script that skips a batch of one sample (each rank's short last batch at 2 processes) took 2
    steps where 1 process took 3: a real difference, FAILed before, then "cannot compare"."""
    script = tmp_path / "skips_one.py"
    script.write_text(REVIEW2_SKIPS_ONE)
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "5", script], timeout=300)
    assert r.returncode == 4 and r.stdout.startswith("FAIL"), r.stdout + r.stderr[-2000:]


METER = LIST_MEAN.replace("def train_epoch():\n    losses = []", '''class AverageMeter:
    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count


def train_epoch():
    losses = AverageMeter()''').replace("losses.append(loss.item())", "losses.update(loss.item(), x.size(0))")


def test_a_training_meters_average_returned_after_the_loop_is_averaged_across_ranks(tmp_path):
    """RAdam's CIFAR recipe (and randomized smoothing): ``train()`` returns ``losses.avg`` of an AverageMeter its
    training loop updates; logged per epoch, it was rank 0's shard's."""
    source = METER.format(end="return losses.avg", call="print('Training loss: %.6f' % train_epoch())")
    p = plan(source)
    assert "return ddpkit.reduce(losses.avg, op='mean')" in p.text, p.text
    (tmp_path / "one.py").write_text(source)
    (tmp_path / "two.py").write_text(p.text)
    one = ok(run_cmd([sys.executable, tmp_path / "one.py"], timeout=60))
    two = ok(launch(tmp_path / "two.py", timeout=120))
    assert one.stdout.split() == two.stdout.split(), (one.stdout, two.stdout)


def test_an_init_is_not_moved_above_the_attribute_its_switch_reads():
    """Review 2 (P1, older than this change): ``args.use_cuda = ... and not args.cpu`` set below the loader; the
    init moved above the loader read ``args.use_cuda`` unset (AttributeError): now refused with the fix."""
    p = plan('''import argparse
import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--cpu", action="store_true")
args = parser.parse_args()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))),
                                     batch_size=8, shuffle=True)
args.use_cuda = torch.cuda.is_available() and not args.cpu
device = torch.device("cuda" if args.use_cuda else "cpu")
model = nn.Linear(4, 2).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
''')
    assert p.refused and "before the device set-up" in p.left[0].what, (p.left, p.text)


# the third review (d9cead5..7884ac5): each case failed at 7884ac5

REVIEW3_TEST_ON_OWN_AVG = '''import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.0)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=16)


class AverageMeter:
    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, v, n=1):
        self.sum += v * n
        self.count += n
        self.avg = self.sum / self.count


best = 1e9
for epoch in range(2):
    losses = AverageMeter()
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.update(loss.item(), x.size(0))
    if losses.avg < best:
        best = losses.avg
print('best', best)
'''

REVIEW3_EARLY_RETURN = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.0)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=16)


def train_epoch():
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    try:
        if max(losses) > 2.5:  # a spike: skip this epoch's report
            raise ValueError(max(losses))
    except ValueError:
        return None
    print('train loss', np.mean(losses))
    return 0


for epoch in range(3):
    train_epoch()
print('done')
'''

REVIEW3_LOADER_PER_EPOCH = '''import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
net = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
data = TensorDataset(torch.arange(16.).unsqueeze(1), torch.zeros(16, 1))


def make_loader():
    return DataLoader(data, batch_size=8, shuffle=True)


for epoch in range(3):
    loader = make_loader()  # a fresh loader each epoch
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print('epoch', epoch, 'weight', net.weight.item())
'''

REVIEW3_WRAPPED = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class WithHead(torch.nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.backbone(x)))


torch.manual_seed(0)
model = torch.nn.Linear(4, 8)
model = WithHead(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=16)

for epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
print('head weight sum', model.head.weight.sum().item())
'''


@pytest.mark.parametrize("source", [REVIEW3_TEST_ON_OWN_AVG, REVIEW3_EARLY_RETURN])
def test_no_collective_where_a_rank_may_route_around_it(source):
    """Review 3: ``if losses.avg < best: best = losses.avg`` and a print below an ``except`` that returns early got
    ``ddpkit.reduce`` inside: a rank that skipped it left the others waiting (a hang). (The list itself, read whole
    by ``max(losses)``, is averaged right after the loop, where every rank passes: sixteenth set.)"""
    text = plan(source).text
    assert not [line for line in text.splitlines() if "ddpkit.reduce(" in line and
                not line.startswith("    losses = ddpkit.reduce(torch.tensor(losses")], text


def test_a_shuffled_loader_a_function_builds_each_epoch_is_listed():
    """Review 3: ``loader = make_loader()`` in the epoch loop: every epoch the same order, nothing said."""
    assert any("built inside a loop" in x.what for x in plan(REVIEW3_LOADER_PER_EPOCH).left)


def test_a_model_wrapped_by_a_module_of_the_script_is_no_reload():
    """Review 3: ``model = WithHead(model)`` taken for a reload: the head's parameters never synchronised."""
    assert "ddpkit.prepare_model(WithHead(model))" in plan(REVIEW3_WRAPPED).text


REVIEW3_CALLER_SAVES_THEN_LOADS = {
    'main.py': '''import torch
from torch.utils.data import DataLoader, TensorDataset
from utils import save_model, load_model

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=16)

best = 1e9
for epoch in range(3):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if epoch == 2:
        best = loss.item()
        save_model(net, 'best.pth')

net = load_model(net, 'best.pth')
print('weight after load', net.weight.sum().item())
''',
    'utils.py': '''import torch


def save_model(model, path):
    torch.save(model.state_dict(), path)


def load_model(model, path):
    model.load_state_dict(torch.load(path))
    return model
''',
}

REVIEW3_SECOND_SOLVER = {
    'data.py': '''import torch
from torch.utils.data import DataLoader


def return_data(args):
    g = torch.Generator().manual_seed(0)
    return DataLoader(torch.randn(64, 4, generator=g), batch_size=args.batch_size, drop_last=True)
''',
    'main.py': '''import argparse
from solver import Solver

p = argparse.ArgumentParser()
p.add_argument("--batch_size", type=int, default=16)
p.add_argument("--ckpt_load", action="store_true")
args = p.parse_args()
Solver(args).train()
args.ckpt_load = True
Solver(args)  # a second solver, resumed from the checkpoint just written
''',
    'solver.py': '''import os
import torch
from data import return_data


class Solver:
    def __init__(self, args):
        self.ckpt = "ckpt.pth"
        self.state = None
        if args.ckpt_load:
            self.load_checkpoint()
        torch.manual_seed(0)
        self.D = torch.nn.Linear(4, 1)
        if self.state is not None:
            self.D.load_state_dict(self.state["D"])
        print("loaded", self.D.weight.sum().item())
        self.optim = torch.optim.SGD(self.D.parameters(), lr=0.1)
        self.data_loader = return_data(args)

    def train(self):
        for step in range(3):
            for x in self.data_loader:
                loss = self.D(x).pow(2).mean()
                self.optim.zero_grad()
                loss.backward()
                self.optim.step()
            if step == 2:
                self.save_checkpoint()

    def save_checkpoint(self):
        torch.save({"D": self.D.state_dict(), "big": torch.zeros(3_000_000)}, self.ckpt)

    def load_checkpoint(self):
        self.state = torch.load(self.ckpt)
''',
}


@pytest.mark.parametrize("files, rel", [(REVIEW3_CALLER_SAVES_THEN_LOADS, "utils.py"),
                                        (REVIEW3_SECOND_SOLVER, "solver.py")])
def test_a_save_load_pair_another_file_runs_both_still_owes_the_barrier(files, rel):
    """Review 3: utils.py's save_model / load_model, which main.py calls in that order; a solver's load in
    ``__init__`` and a second Solver built after training: "kept" with no barrier anywhere (rank 1 read first)."""
    done = settled(files)
    assert any("barrier" in x.fix for x in done[rel].left), (done[rel].left, done[rel].kept)


def test_a_score_over_lists_the_training_loop_fills_is_listed():
    """x-vector-pytorch: ``accuracy_score(full_gts, full_preds)`` over lists each training step extends, printed as
    the training accuracy: rank 0's shard's, nothing said."""
    source = LIST_MEAN.format(end="print(accuracy_score(gts, preds))", call="train_epoch()").replace(
        "import numpy as np\n", "import numpy as np\nfrom sklearn.metrics import accuracy_score\n").replace(
        "    losses = []\n", "    losses, gts, preds = [], [], []\n").replace(
        "        losses.append(loss.item())\n",
        "        losses.append(loss.item())\n        gts.extend(y.tolist())\n        preds.extend(net(x).tolist())\n")
    p = plan(source)
    assert any("accuracy_score(...) after the training loop" in x.what for x in p.left), (p.left, source)
