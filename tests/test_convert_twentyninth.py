"""Convert on what the twenty-ninth held-out set of public scripts showed, and what the sets before it left (the
measurers' repros, written again in our own words): each test failed on the tree before its fix."""

from __future__ import annotations

import pytest

from conftest import settled

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

LOOP = """import json, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
norms = []
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    norms.append({name: p.grad.norm().item() for name, p in model.named_parameters()})
    opt.step()
print(sorted(norms[0]), [n for n, _ in model.named_buffers()])
"""


def test_names_read_from_the_prepared_model_are_the_modules_own():
    """Extra five of set 28 (D6): a log of gradient norms keyed by ``model.named_parameters()`` read
    ``module.0.weight`` under launch where one process writes ``0.weight``; now read from the module."""
    p = plan(LOOP)
    assert "for name, p in ddpkit.unwrap(model).named_parameters()}" in p.text, p.text
    assert "[n for n, _ in ddpkit.unwrap(model).named_buffers()]" in p.text, p.text
    assert any("'module.' prefix" in e.why for e in p.edits), [e.why for e in p.edits]
    assert not p.left, [left.what for left in p.left]


def test_an_argmax_of_each_row_of_an_evaluated_training_batch_is_per_sample():
    """Set 29 (c, D1): ``for idx, i in enumerate(output): if torch.argmax(i) == y[idx]`` was read as an argmax over
    each whole batch (a unit), and the script refused; a row is one sample: the counts are summed across ranks."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 3)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nloader = DataLoader(ds, batch_size=10, shuffle=True)\n"
            "for X, y in loader:\n    opt.zero_grad()\n    torch.nn.functional.cross_entropy(model(X), y).backward()\n"
            "    opt.step()\ncorrect = total = 0\nwith torch.no_grad():\n    for X, y in loader:\n"
            "        output = model(X)\n        for idx, i in enumerate(output):\n"
            "            if torch.argmax(i) == y[idx]:\n                correct += 1\n            total += 1\n"
            "print(correct / total)\n")
    p = plan(text)
    assert not p.left, [left.what for left in p.left]
    assert any("correct, total summed across ranks" in e.what for e in p.edits), [e.what for e in p.edits]
    whole = plan(text.replace("for idx, i in enumerate(output):\n            if torch.argmax(i) == y[idx]",
                              "for idx in range(1):\n            if torch.argmax(output) == y[idx]"))
    assert any("over each whole batch" in left.what for left in whole.left), [x.what for x in whole.left]


TRAIN = ("import torch\nfrom torch.utils.data import DataLoader\n{imp}\nmodel = torch.nn.Linear(4, 1)\n"
         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in DataLoader(ds, batch_size={size}):\n"
         "    opt.zero_grad()\n    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n")


@pytest.mark.parametrize("imp, size, value, kept", [
    ("from settings import *", "batch_size", 1, True),
    ("from settings import batch_size as bs", "bs", 9, True),
    ("import settings", "settings.batch_size", 9, True),
    ("from settings import *", "batch_size", 8, False),
])
def test_an_odd_batch_size_set_in_a_settings_module_stays_per_process(imp, size, value, kept):
    """Set 29 (c, D3): ``batch_size = 1`` in variables.py, read through ``from variables import *``, became
    ``global_batch_size=batch_size`` and every rank stopped at the loader (1 does not divide by 2)."""
    done = settled({"settings.py": f"batch_size = {value}\nepochs = 1\n",
                    "train.py": TRAIN.format(imp=imp, size=size)})
    text = done["train.py"].text
    assert ("global_batch_size" not in text) is kept, text
    assert any("splits evenly over no even number" in k.why for k in done["train.py"].kept) is kept


def test_a_project_helper_nothing_calls_writing_a_file_beside_a_reader_is_no_line():
    """Set 29 (c, D2): utils.py's ``write_json`` (open, write, close), beside its ``read_json``, and called by no
    file, was "a file opened for writing and kept open ... every rank writes it", left to the user (exit 1)."""
    utils = ("import json\ndef write_json(data, name):\n    f = open(name, 'w')\n    f.write(json.dumps(data))\n"
             "    f.close()\ndef read_json(name):\n    with open(name) as f:\n        return json.load(f)\n")
    done = settled({"utils.py": utils, "train.py": TRAIN.format(imp="import utils", size=8) +
                    "print(utils.read_json.__name__)\n"})
    assert not done["utils.py"].left, [left.what for left in done["utils.py"].left]


def test_a_batch_size_a_model_reads_from_its_settings_dict_stays_per_process_listed():
    """Set 29 (a, D1): ``config = {"batch_size": BATCH}``, ``Enc(config)`` sizing its recurrent state with
    ``cfg["batch_size"]``: the loader's BATCH became global and each rank's batch of BATCH/N met a state of BATCH."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nBATCH = 8\nconfig = {'batch_size': BATCH}\n"
            "class Enc(torch.nn.Module):\n    def __init__(self, cfg):\n        super().__init__()\n"
            "        self.b = cfg['batch_size']\n        self.rnn = torch.nn.GRU(4, 4)\n"
            "    def forward(self, x):\n        return self.rnn(x, torch.zeros(1, self.b, 4))[0]\n"
            "model = Enc(config)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for x, y in DataLoader(ds, batch_size=BATCH, shuffle=True):\n    opt.zero_grad()\n"
            "    model(x).mean().backward()\n    opt.step()\n")
    p = plan(text)
    assert "global_batch_size" not in p.text
    assert any("the model is built with it at line 12 (Enc(...))" in left.what for left in p.left), p.left


def test_a_loss_method_another_file_calls_is_named_in_forward_methods():
    """Set 29 (a, D2): main.py hands the model to training.py's ``train(model, ...)``, which backwards
    ``model.loss(batch)``: the wrap lacked ``forward_methods=('loss',)`` and the first step stopped."""
    main = ("import torch\nfrom torch.utils.data import DataLoader\nfrom training import train\n"
            "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = torch.nn.Linear(4, 1)\n    def loss(self, batch):\n        x, y = batch\n"
            "        return ((self.fc(x) - y) ** 2).mean()\n"
            "model = Net()\nopt = torch.optim.Adam(model.parameters())\n"
            "loader = DataLoader(ds, batch_size=8, shuffle=True)\ntrain(model, opt, loader)\n")
    training = ("def train(model, optimizer, loader):\n    for batch in loader:\n        loss = model.loss(batch)\n"
                "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n")
    done = settled({"main.py": main, "training.py": training})
    assert "ddpkit.prepare_model(Net(), forward_methods=('loss',))" in done["main.py"].text, done["main.py"].text
    assert not done["main.py"].left and not done["training.py"].left


def test_an_init_loop_after_a_loop_over_the_settings_is_still_listed():
    """Set 29 (a, D3): a ``for k, v in config.items(): print(k, v)`` between the optimizer and an init loop over
    ``model.named_parameters()`` was taken for training: the init after the wrap went unsaid."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nconfig = {'lr': 0.1}\n"
            "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=config['lr'])\n"
            "for k, v in config.items():\n    print(k, v)\nfor name, p in model.named_parameters():\n"
            "    torch.nn.init.normal_(p)\nfor x, y in DataLoader(ds, batch_size=8, shuffle=True):\n"
            "    opt.zero_grad()\n    model(x).mean().backward()\n    opt.step()\n")
    p = plan(text)
    assert [left.line for left in p.left if "initialised here, after prepare_model" in left.what] == [8], p.left


def test_a_spread_dict_updated_with_other_keys_keeps_its_batch_global():
    """Set 29 (a, D5): pytorch/examples' ``train_kwargs.update(cuda_kwargs)`` kept the batch per process (the
    global batch doubled at 2 processes); an update holding no 'batch_size' leaves the batch the spread one."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 2)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain_kwargs = {'batch_size': 32, 'shuffle': True}\n"
            "extra = {'num_workers': 1, 'pin_memory': True}\nif torch.cuda.is_available():\n"
            "    train_kwargs.update(extra)\n    train_kwargs.update({'persistent_workers': True})\n"
            "for x, y in DataLoader(ds, **train_kwargs):\n    opt.zero_grad()\n"
            "    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    assert "'global_batch_size': 32" in plan(text).text
    resized = plan(text.replace("{'persistent_workers': True}", "{'batch_size': 8}")).text
    assert "'global_batch_size'" not in resized


def test_a_dataset_of_feature_label_pairs_drawn_apart_differs_in_its_fingerprint():
    """Set 29 (a, D4): a toy Dataset holding ``[(np.array, float), ...]`` drawn with ``random`` unseeded: every
    rank's differed, and the check before training saw only its length."""
    import numpy as np
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Toy(Dataset):
        def __init__(self, k):
            self.set = [(np.full(3, float(k + i), dtype=np.float32), float(i)) for i in range(8)]

        def __len__(self):
            return len(self.set)

        def __getitem__(self, i):
            return self.set[i]

    assert bool((fingerprint(Toy(0)) == fingerprint(Toy(0))).all())
    assert not bool((fingerprint(Toy(0)) == fingerprint(Toy(1))).all())


def test_a_picture_a_datasets_getitem_writes_of_each_sample_stays_every_ranks():
    """Set 29 (c, D4): ``plt.savefig(f"dbg/sample_{idx}.png")`` in a Dataset's ``__getitem__`` was guarded to rank 0
    ("every rank holds the same results"): each rank reads its own samples, and half the pictures went missing."""
    text = ("import torch\nimport matplotlib.pyplot as plt\nfrom torch.utils.data import DataLoader, Dataset\n"
            "class Noisy(Dataset):\n    def __len__(self):\n        return 32\n    def __getitem__(self, idx):\n"
            "        x = torch.rand(1, 8, 8)\n        plt.imshow(x[0])\n        plt.savefig(f'dbg/{idx}.png')\n"
            "        return x, x.mean()\nmodel = torch.nn.Linear(64, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=1)\n"
            "for x, y in DataLoader(Noisy(), batch_size=8, shuffle=True):\n    opt.zero_grad()\n"
            "    ((model(x.flatten(1)).squeeze(1) - y) ** 2).mean().backward()\n    opt.step()\n")
    p = plan(text)
    assert "is_main" not in p.text.split("def __getitem__")[1].split("return")[0], p.text
    assert any("in Noisy.__getitem__ left as it is" in k.what for k in p.kept), p.kept


def test_a_counted_bar_disabled_off_rank_zero_says_what_was_written():
    """Set 29 (c, D5): ``with tqdm(total=len(loader)) as pbar`` got ``disable=not ...is_main``, said as
    "tqdm -> ddpkit.progress", an edit it did not make."""
    text = ("import torch\nfrom tqdm import tqdm\nfrom torch.utils.data import DataLoader\n"
            "model = torch.nn.Linear(4, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=1)\nloader = DataLoader(ds, batch_size=8, shuffle=True)\n"
            "with tqdm(total=len(loader)) as pbar:\n    for x, y in loader:\n        opt.zero_grad()\n"
            "        model(x).mean().backward()\n        opt.step()\n        pbar.update(1)\n")
    p = plan(text)
    assert "disable=not ddpkit.init().is_main" in p.text
    assert [e.what for e in p.edits if e.line == 7] == ["tqdm(...) -> tqdm(..., disable=not ddpkit.init().is_main)"]


def test_a_homework_batchnorm_always_normalising_by_the_batch_is_listed():
    """Set 29 (b, D2): ``MyBN.forward`` taking ``x.mean(dim=(0, 2, 3))`` and ``x.var(...)`` with no test of training
    went unsaid ("prepare_model converts BatchNorm"); each rank's statistics are over its share."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nclass MyBN(torch.nn.Module):\n"
            "    def forward(self, x):\n        m = x.mean(dim=(0, 2, 3), keepdim=True)\n"
            "        v = x.var(dim=(0, 2, 3), keepdim=True)\n        return (x - m) / (v + 1e-5).sqrt()\n"
            "model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), MyBN())\n"
            "opt = torch.optim.SGD(model.parameters(), lr=1)\n"
            "for x in DataLoader(ds, batch_size=8, shuffle=True):\n    opt.zero_grad()\n"
            "    model(x).mean().backward()\n    opt.step()\n")
    assert [x.line for x in plan(text).left if "statistics over the batch" in x.what] == [6]
    pooled = text.replace("        v = x.var(dim=(0, 2, 3), keepdim=True)\n", "        v = 1.0\n")
    assert not plan(pooled).left  # a mean over dim 0 alone may be over time (a sequence-first tensor)


@pytest.mark.parametrize("optimizer, listed", [("Adam", []), ("SGD", ["the training loss is a sum"])])
def test_a_loss_whose_every_term_is_a_sum_is_not_a_term_beside_a_mean(optimizer, listed):
    """Set 29 (b, D3): ``BCE = F.binary_cross_entropy(..., reduction='sum')`` plus ``KLD = -0.5 * torch.sum(...)``:
    convert listed the KLD alone as a term beside a mean, and its fix made a correct Adam script differ."""
    text = ("import torch\nimport torch.nn.functional as F\nfrom torch.utils.data import DataLoader\n"
            "def vae_loss(recon, x, mu, logvar):\n    BCE = F.binary_cross_entropy(recon, x, reduction='sum')\n"
            "    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())\n    return BCE + KLD\n"
            f"model = Vae()\nopt = torch.optim.{optimizer}(model.parameters(), lr=1e-3)\n"
            "for x, _ in DataLoader(ds, batch_size=8, shuffle=True):\n    opt.zero_grad()\n"
            "    recon, mu, logvar = model(x)\n    loss = vae_loss(recon, x, mu, logvar)\n    loss.backward()\n"
            "    opt.step()\n")
    p = plan(text)
    assert [x.what[:26] for x in p.left] == listed, [x.what for x in p.left]
    beside = plan(text.replace("reduction='sum'", "reduction='mean'"))
    assert [x.line for x in beside.left if "a term of the training loss is summed" in x.what] == [6]


def test_a_whole_model_saved_moved_to_the_cpu_is_unwrapped():
    """Set 29 (c, D6): a trainer's ``torch.save(self.model.cpu(), path)`` pickled the DDP wrapper and rank 0 died
    in the save, a truncated file left behind."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nclass Trainer:\n"
            "    def __init__(self, loader):\n        self.model = torch.nn.Linear(4, 2)\n"
            "        self.opt = torch.optim.Adam(self.model.parameters())\n        self.loader = loader\n"
            "    def train(self):\n        for x, y in self.loader:\n            self.opt.zero_grad()\n"
            "            torch.nn.functional.cross_entropy(self.model(x), y).backward()\n            self.opt.step()\n"
            "    def save(self, path):\n        torch.save(self.model.cpu(), path)\n"
            "loader = DataLoader(ds, batch_size=8, shuffle=True)\nt = Trainer(loader)\nt.train()\nt.save('m.pt')\n")
    p = plan(text)
    assert "        self.model.cpu()\n        if ddpkit.init().is_main:\n" \
        "            torch.save(ddpkit.unwrap(self.model), path)" in p.text, p.text


def test_a_prepared_models_forward_called_by_name_becomes_a_call():
    """Set 29 (c, D7): ``model.forward(x)`` skipped the module's hooks, verify's dropout-off among them, in the
    one-process run only (DDP's forward calls the module): a false FAIL. The call runs the same path in both."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 2)\n"
            "opt = torch.optim.Adam(model.parameters())\nfor x, y in DataLoader(ds, batch_size=8, shuffle=True):\n"
            "    opt.zero_grad()\n    torch.nn.functional.cross_entropy(model.forward(x), y).backward()\n"
            "    opt.step()\n")
    assert "cross_entropy(model(x), y)" in plan(text).text


def test_a_homework_batch_norm_function_taking_its_statistics_before_the_flag_is_listed():
    """Set 29 (b, s03): Dive-into-DL's ``batch_norm(X, ..., is_training)`` takes ``torch.mean(X, dim=0)`` first and
    picks by the flag after: unsaid, while each rank normalised by its own share of the batch."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\n"
            "def batch_norm(X, gamma, is_training=True):\n    mean = torch.mean(X, dim=0, keepdim=True)\n"
            "    var = torch.mean((X - mean) ** 2, dim=0, keepdim=True)\n    if is_training:\n"
            "        return gamma * (X - mean) / torch.sqrt(var + 1e-5)\n    return X\n"
            "class BN(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.gamma = torch.nn.Parameter(torch.ones(2))\n"
            "    def forward(self, x):\n        return batch_norm(x, self.gamma, self.training)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(2, 2), BN())\n"
            "opt = torch.optim.SGD(model.parameters(), lr=1)\n"
            "for x in DataLoader(ds, batch_size=8, shuffle=True):\n    opt.zero_grad()\n    model(x).sum().backward()\n"
            "    opt.step()\n")
    assert [x.line for x in plan(text).left if "statistics over the batch" in x.what] == [4]


def test_output_into_a_folder_writes_the_script_there(tmp_path, capsys):
    """Set 29 (b): ``-o conv/`` for one script wrote nothing ("cannot write 'conv/'"); the script's name inside it."""
    from ddpkit.commands.convert.command import main
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint(torch.zeros(1))\n")
    assert main([str(script), "-o", str(tmp_path / "conv") + "/"]) == 0, capsys.readouterr().err
    assert (tmp_path / "conv" / "train.py").read_text().startswith("import torch")


@pytest.mark.parametrize("extra, order", [
    ("", "{'batch_size': 8, 'shuffle': False}"),  # as torch's loader read it: in order
    ("train_kwargs['shuffle'] = True\n", None),  # its own say, below
])
def test_a_spread_dict_without_shuffle_keeps_the_order_torch_gave_it(extra, order):
    """Extra five of set 29 (D2): ``DataLoader(ds, **train_kwargs)`` with no 'shuffle' (pytorch/examples' MNIST
    adds it on CUDA only) became a shuffling ddpkit.data_loader: the CPU run trained in another order."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 2)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain_kwargs = {'batch_size': 8}\n" + extra +
            "if torch.cuda.is_available():\n    train_kwargs.update({'shuffle': True, 'num_workers': 1})\n"
            "for x, y in DataLoader(ds, **train_kwargs):\n    opt.zero_grad()\n"
            "    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    text = plan(text).text
    assert ("'shuffle': False}" in text) is (order is not None), text


def test_a_meter_of_the_training_batches_printed_whole_is_said_to_be_this_ranks():
    """Extra five of set 29 (D3): ``print("loss", losses)`` of an AverageMeter formatting itself (the ImageNet
    example's idiom) showed rank 0's half of the epoch as the whole, and nothing was said."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nclass AverageMeter:\n    def __init__(self):\n"
            "        self.sum, self.count = 0.0, 0\n    def update(self, val, n=1):\n"
            "        self.sum += val * n\n        self.count += n\n    def __str__(self):\n"
            "        return f'{self.sum / self.count:.4f}'\nmodel = torch.nn.Linear(8, 2)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor epoch in range(2):\n"
            "    losses, acc = AverageMeter(), AverageMeter()\n"
            "    for x, y in DataLoader(ds, batch_size=32, shuffle=True):\n        out = model(x)\n"
            "        loss = torch.nn.functional.cross_entropy(out, y)\n        losses.update(loss.item(), x.size(0))\n"
            "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n    print(epoch, losses)\n")
    assert [k.what for k in plan(text).kept if k.what.startswith("losses")] == [
        "losses is fed each training batch (losses.update(...)) and read here"]
