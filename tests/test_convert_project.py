"""Issue 44: a project whose trainer lives in another file (minGPT's shape: ``chargpt.py`` builds the data, model
and Trainer; ``mingpt/trainer.py`` moves the model, builds the DataLoader and runs the loop). Converting the script
alone prepared no model ("cannot compare"); ``--imports`` converts it with the modules it imports, and a folder
converts every file; one refused file leaves every file as it was."""
import sys

import pytest

from conftest import ROOT, run_cmd, settled

CORPUS = ROOT / "tests" / "convert_corpus" / "char_transformer.py"
CONVERT = [sys.executable, "-m", "ddpkit", "convert"]
# the corpus script's sections (between its "# ----" lines) as minGPT lays them out, each with the imports it needs
LAYOUT = {"mingpt/utils.py": ([1], "import random\n\nimport torch\n"),
          "mingpt/model.py": ([2], "import math\n\nimport torch\nimport torch.nn as nn\nfrom torch.nn import "
                                   "functional as F\n\nfrom mingpt.utils import CN\n"),
          "mingpt/trainer.py": ([3], "import time\nfrom collections import defaultdict\n\nimport torch\nfrom "
                                     "torch.utils.data import DataLoader\n\nfrom mingpt.utils import CN\n"),
          "chargpt.py": ([4, 5], "import argparse\nimport random\n\nimport torch\nfrom torch.utils.data import "
                                 "Dataset\n\nfrom mingpt.model import GPT\nfrom mingpt.trainer import Trainer\n"
                                 "from mingpt.utils import CN, set_seed\n"),
          "mingpt/__init__.py": ([], "")}


@pytest.fixture
def project(tmp_path):
    """tests/convert_corpus/char_transformer.py split into a minGPT-shaped project: the script beside a package
    that holds the model, the Trainer (its device, the model's move, its DataLoader and loop) and the helpers."""
    text = CORPUS.read_text()
    sections = text.split("\n# " + "-" * 77 + "\n")
    assert len(sections) == 6, len(sections)
    root = tmp_path / "project"
    for name, (parts, head) in LAYOUT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(head + "\n" + "\n".join(sections[i] for i in parts))
    return root


def test_the_script_alone_says_its_training_is_in_the_modules_it_imports(project):
    """The held-out minGPT and a course's train.py (its loop in Pipeline/run.py) converted their prints, exit 0:
    launched, every rank ran the whole training alone."""
    r = run_cmd(CONVERT + [str(project / "chargpt.py")], timeout=60)
    assert r.returncode == 1, r.stderr
    assert "left to you: no model is prepared and no DataLoader converted here, and the script imports " \
        "mingpt/__init__.py, mingpt/model.py, mingpt/trainer.py ..." in r.stderr, r.stderr
    assert "ddpkit convert --imports" in r.stderr


def test_a_script_and_the_modules_it_imports_convert_together_and_verify_passes(tmp_path, project):
    """Also: the project's other files (a config, a data folder) are copied beside the converted ones, so the
    copy runs as the original did (the held-out learn-GAN's data folder was missing there); a .py file the entry
    does not import is not (code that trains would run unconverted), and said."""
    (project / "configs").mkdir()
    (project / "configs" / "run.json").write_text('{"lr": 0.1}')
    (project / "sweep.py").write_text("print('not imported')\n")
    out = tmp_path / "out"
    r = run_cmd(CONVERT + ["--imports", "-o", str(out), "--verify", "--steps", "3", str(project / "chargpt.py"),
                           "--max-iters", "3"], timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "3 of 5 file(s) changed" in r.stderr, r.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.py")) == [
        "chargpt.py", "mingpt/__init__.py", "mingpt/model.py", "mingpt/trainer.py", "mingpt/utils.py"]
    trainer = (out / "mingpt" / "trainer.py").read_text()
    assert "ddpkit.prepare_model(" in trainer and "ddpkit.data_loader(" in trainer and "ddpkit.init()" in trainer
    assert "verify: PASS" in r.stderr, r.stderr[-3000:]
    assert (project / "mingpt" / "trainer.py").read_text().count("ddpkit") == 0  # the originals untouched
    assert (out / "configs" / "run.json").read_text() == '{"lr": 0.1}'
    assert "1 other file(s) of the project copied" in r.stderr and "sweep.py (a .py file the conversion did not " \
        "read)" in r.stderr, r.stderr


def test_a_folder_converts_every_file_and_one_refused_file_writes_none(project):
    r = run_cmd(CONVERT + [str(project)], timeout=120)  # the diffs, nothing written
    assert r.returncode == 0 and "3 of 5 file(s) changed" in r.stderr, r.stderr
    assert r.stdout.count("+++ ") == 3 and "ddpkit.prepare_model(" in r.stdout
    (project / "launch_by_hand.py").write_text(  # a file distributed by hand: refused, so is the project
        "import torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n")
    before = {p: p.read_bytes() for p in project.rglob("*.py")}
    r = run_cmd(CONVERT + ["--write", str(project)], timeout=120)
    assert r.returncode == 1 and "refused: nothing written for any of the 6 files" in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in project.rglob("*.py")} == before
    r = run_cmd(CONVERT + ["--verify", str(project)], timeout=60)
    assert r.returncode == 2 and "--verify runs one script" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_script_that_hands_its_training_to_a_module_elsewhere_says_so(tmp_path):
    """minGPT's projects/chargpt/chargpt.py imports its Trainer from a package outside the script's folder; the
    held-out run converted its prints, exit 0, and every rank trained alone."""
    script = tmp_path / "chargpt.py"
    script.write_text("import torch\nfrom mingpt.trainer import Trainer\nfrom mingpt.model import GPT\n"
                      "model = GPT()\ntrainer = Trainer(model)\ntrainer.run()\nprint('done')\n")
    r = run_cmd(CONVERT + [str(script)], timeout=60)
    assert r.returncode == 1 and "left to you: no training loop here" in r.stderr, r.stderr
    assert "ddpkit convert --imports" in r.stderr and "ddpkit convert FOLDER" in r.stderr


# a course's layout: module-level names (the options, the model, its optimizer, the loaders) imported across files
COURSE = {
    "Pipe/__init__.py": "", "Arch/__init__.py": "", "Data/__init__.py": "",
    "Pipe/option.py": "import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float, "
                      "default=0.01)\nargs = p.parse_args()\n",
    "Arch/model.py": "import torch.nn as nn\nmodel = nn.Linear(20, 4)\n",
    "Arch/optim.py": "import torch.optim as optim\nfrom Pipe.option import args\nfrom Arch.model import model\n"
                     "optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)\n",
    "Data/data.py": "import torch\nfrom torch.utils.data import TensorDataset, DataLoader\n"
                    "g = torch.Generator().manual_seed(0)\n"
                    "ds = TensorDataset(torch.randn(64, 20, generator=g), torch.randint(0, 4, (64,), generator=g))\n"
                    "train_loader = DataLoader(ds, batch_size=16, shuffle=True)\n"
                    "test_loader = DataLoader(ds, batch_size=64)\n",
    "train.py": "import torch.nn.functional as F\nfrom Arch.model import model\nfrom Arch.optim import optimizer\n"
                "from Data.data import train_loader, test_loader\n"
                "for data, target in train_loader:\n    optimizer.zero_grad()\n"
                "    F.cross_entropy(model(data), target).backward()\n    optimizer.step()\n"
                "correct = 0\nfor x, y in test_loader:\n    correct += (model(x).argmax(1) == y).sum().item()\n",
}


def test_names_imported_across_a_projects_modules_convert_where_they_are_built_and_verify_passes(tmp_path):
    """The held-out course script: its loop reads a model, an optimizer and loaders that other modules bind at
    module level. It was refused as "batches fed by hand" (and the optimizer's model as "not found"). Converted
    as a project, each name is converted in the module that builds it, and the loop's file says so."""
    for name, text in COURSE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "train.py")], timeout=60)
    assert r.returncode == 0 and "left to you" not in r.stderr, r.stderr
    out = tmp_path / "out"
    assert "model = ddpkit.prepare_model(nn.Linear(20, 4))" in (out / "Arch/model.py").read_text()
    data = (out / "Data/data.py").read_text()
    assert "train_loader = ddpkit.data_loader(ds, global_batch_size=16, shuffle=True)" in data, data
    assert "test_loader = DataLoader(ds, batch_size=64)" in data, data  # each rank evaluates it all: right
    assert "train.py:7: kept: the training loop over train_loader left as it is: train_loader is a " \
           "ddpkit.data_loader where it is built, in Data/data.py" in r.stderr, r.stderr
    assert (out / "Arch/optim.py").read_text() == COURSE["Arch/optim.py"]
    v = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", str(out / "train.py")],
                timeout=300, cwd=str(out))
    assert v.returncode == 0 and v.stdout.startswith("PASS"), v.stdout + v.stderr[-1500:]
    # the loop's file alone: not refused as batches fed by hand; what to do is named
    alone = run_cmd(CONVERT + [str(tmp_path / "train.py")], timeout=60)
    assert alone.returncode == 1 and "refused" not in alone.stderr, alone.stderr
    assert "the loops read loaders imported from modules of the script ('train_loader' from Data.data)" in \
        alone.stderr and "ddpkit convert --imports" in alone.stderr, alone.stderr


def test_a_projects_crossing_names_are_asked_of_the_right_module_once():
    """Review: one file training on a loader and another evaluating on it left it plain while the trainer was told
    it was converted; two modules' ``model`` (a GAN's ``gen`` and ``disc``) were told apart by name only; a module
    with an optimizer of its own prepared its model twice; ``model = None`` became prepare_model(None)."""
    loop = "for x, y in {0}:\n    opt.zero_grad()\n    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n"
    head = "import torch\nfrom data import loader\nmodel = torch.nn.Linear(2, 1)\n" \
           "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    done = settled({"data.py": "import torch\nfrom torch.utils.data import DataLoader\n"
                                "loader = DataLoader(ds, batch_size=8, shuffle=True)\n",
                     "a_train.py": head + loop.format("loader"),
                     "b_eval.py": "import torch\nfrom data import loader\nfor x, y in loader:\n    print(x)\n"})
    assert "loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in done["data.py"].text
    gan = settled({"gen.py": "import torch\nmodel = torch.nn.Linear(2, 2)\n",
                    "disc.py": "import torch\nmodel = None\n",
                    "train.py": "import torch\nfrom gen import model as G\nfrom disc import model as D\n"
                                "og = torch.optim.SGD(G.parameters(), lr=0.1)\nod = torch.optim.SGD(D.parameters(), "
                                "lr=0.1)\n"})
    assert "prepare_model" not in gan["disc.py"].text, gan["disc.py"].text
    assert [x.line for x in gan["train.py"].left] == [5], gan["train.py"].left  # D: not prepared anywhere
    twice = settled({"m.py": "import torch\nmodel = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters()"
                              ", lr=0.1)\nmodel = torch.compile(model)\n",
                      "train.py": "import torch\nfrom m import model\nopt2 = torch.optim.SGD(model.parameters(), "
                                  "lr=0.1)\n"})
    assert twice["m.py"].text.count("prepare_model") == 1, twice["m.py"].text


GETTER = {
    "data.py": "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
               "def get_loaders(batch_size):\n    g = torch.Generator().manual_seed(0)\n"
               "    ds = TensorDataset(torch.randn(64, 20, generator=g), torch.randint(0, 4, (64,), generator=g))\n"
               "    train_loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\n"
               "    test_loader = DataLoader(ds, batch_size=64)\n    return train_loader, test_loader\n",
    "train.py": "import torch\nimport torch.nn.functional as F\nfrom data import get_loaders\n\n"
                "train_loader, test_loader = get_loaders(16)\nmodel = torch.nn.Linear(20, 4)\n"
                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "for data, target in train_loader:\n    optimizer.zero_grad()\n"
                "    F.cross_entropy(model(data), target).backward()\n    optimizer.step()\n"
                "model.eval()\nwith torch.no_grad():\n    for x, y in test_loader:\n"
                "        print((model(x).argmax(1) == y).float().mean().item())\n",
}


def test_loaders_a_function_of_another_module_returns_convert_there_and_verify_passes(tmp_path):
    """A project's ``get_loaders()`` in its data module (the fourth held-out shape): the training loop's file was
    refused as "batches fed by hand". The function's training loader converts where it is built; its
    evaluation loader stays (each rank evaluates all of it); the loop's file prepares its model."""
    for name, text in GETTER.items():
        (tmp_path / name).write_text(text)
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "train.py")], timeout=60)
    assert r.returncode == 0 and "left to you" not in r.stderr, r.stderr
    out = tmp_path / "out"
    data = (out / "data.py").read_text()
    assert "train_loader = ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in data, data
    assert "test_loader = DataLoader(ds, batch_size=64)" in data, data
    assert "model = ddpkit.prepare_model(torch.nn.Linear(20, 4))" in (out / "train.py").read_text()
    assert "kept: the training loop over train_loader left as it is" in r.stderr, r.stderr
    v = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", str(out / "train.py")],
                timeout=300, cwd=str(out))
    assert v.returncode == 0 and v.stdout.startswith("PASS"), v.stdout + v.stderr[-1500:]


def test_a_module_imported_whole_is_followed_to_its_names():
    """``import data.sets as ds`` then ``ds.train_loader``, ``import models.net`` then ``models.net.model``: the
    names of those modules, asked of them (they were read as ``data``'s ``sets``, or not at all)."""
    loop = "for x, y in {0}:\n    opt.zero_grad()\n    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n"
    done = settled({"data/sets.py": "import torch\nfrom torch.utils.data import DataLoader\n"
                                     "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\n",
                     "models/net.py": "import torch\nmodel = torch.nn.Linear(2, 1)\n",
                     "train.py": "import torch\nimport data.sets as ds\nimport models.net\nmodel = models.net.model\n"
                                 "opt = torch.optim.SGD(models.net.model.parameters(), lr=0.1)\n" +
                                 loop.format("ds.train_loader")})
    assert "train_loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in done["data/sets.py"].text
    assert "model = ddpkit.prepare_model(torch.nn.Linear(2, 1))" in done["models/net.py"].text, \
        done["models/net.py"].text
    assert not done["train.py"].left, done["train.py"].left


def test_a_loop_over_a_loader_handed_in_by_another_module_is_fed_by_its_converted_loader():
    """going_modular: ``engine.train_step(model, dataloader, ...)`` loops over its parameter, handed in by
    ``train.py`` from ``data_setup.create_dataloaders()``. It passed only because a ``tqdm`` in the same file was
    taken for an imported loader; read right, it was refused as batches fed by hand. In a project whose training
    loader converts, the loop is said fed by it; converted alone, it is left to you with the fix."""
    files = {"data_setup.py": GETTER["data.py"],
             "engine.py": "import torch\nimport torch.nn.functional as F\n\n\ndef train_step(model, dataloader, opt):\n"
                          "    for x, y in dataloader:\n        opt.zero_grad()\n"
                          "        F.cross_entropy(model(x), y).backward()\n        opt.step()\n",
             "train.py": "import torch\nimport data_setup, engine\n\ntrain_loader, test_loader = "
                         "data_setup.get_loaders(16)\nmodel = torch.nn.Linear(20, 4)\n"
                         "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                         "engine.train_step(model, train_loader, opt)\n"}
    done = settled(files)
    assert not any(p.refused or p.left for p in done.values()), {k: p.left for k, p in done.items()}
    assert "ddpkit.data_loader(ds, global_batch_size=batch_size" in done["data_setup.py"].text
    assert any("the training loop over dataloader (a parameter of train_step) left as it is" in k.what and
               "its callers in train.py pass is a ddpkit.data_loader" in k.why for k in done["engine.py"].kept), \
        done["engine.py"].kept
    from ddpkit.commands.convert.plan import plan

    alone = plan(files["engine.py"])
    assert not alone.refused and any("a parameter of train_step that no call in this file passes" in x.what
                                     for x in alone.left), alone.left


def test_an_evaluation_a_sharded_and_an_unsharded_loader_share_or_a_provided_training_loader_is_refused():
    """The review of the fourth held-out fixes: one ``check_accuracy(loader)`` run over this file's training loader
    and a ``val_loader`` imported plain from another module got one ``ddpkit.reduce`` (the plain one's accuracy
    N times too large); a training loader another module shards, evaluated here, got none (rank 0's shard over
    the whole length). Both were silent; both are refused now, with the fix."""
    check = ("def check_accuracy(loader, model):\n    correct = 0\n    with torch.no_grad():\n"
             "        for x, y in loader:\n            correct += (model(x).argmax(1) == y).sum().item()\n"
             "    return correct / len(loader.dataset)\n")
    loop = ("for x, y in train_loader:\n    opt.zero_grad()\n    F.cross_entropy(model(x), y).backward()\n"
            "    opt.step()\n")
    head = "import torch\nimport torch.nn.functional as F\nfrom torch.utils.data import DataLoader\n"
    model = "model = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    done = settled({"data.py": "from torch.utils.data import DataLoader\nval_loader = DataLoader(val, batch_size=8)\n",
                     "train.py": head + "from data import val_loader\ntrain_loader = DataLoader(ds, batch_size=8, "
                     "shuffle=True)\n" + model + check + loop + "print(check_accuracy(train_loader, model))\n"
                     "print(check_accuracy(val_loader, model))\n"})
    said = [x for x in done["train.py"].left if x.blocks]
    assert said and "also runs over val_loader" in said[0].what, done["train.py"].left
    done = settled({"data.py": GETTER["data.py"],
                     "train.py": head + "from data import get_loaders\ntrain_loader, test_loader = get_loaders(8)\n" +
                     model + check + loop + "print(check_accuracy(train_loader, model))\n"})
    said = [x for x in done["train.py"].left if x.blocks]
    assert said and "train_loader, a ddpkit.data_loader for training in data.py, is also evaluated here" in \
        said[0].what, done["train.py"].left


def test_a_loop_over_a_loader_handed_in_is_not_said_fed_by_an_unrelated_files_loader():
    """Review: ``engine.train_epoch(model, dataloader)`` fed by ``finetune.py`` with a list of batches was said "kept"
    because ``pretrain.py``, which never calls it, had a training loader. Only a file that reaches it counts."""
    loop = ("    for x, y in {0}:\n        opt.zero_grad()\n        (model(x) - y).pow(2).mean().backward()\n"
            "        opt.step()\n")
    done = settled({"engine.py": "def train_epoch(model, dataloader, opt):\n" + loop.format("dataloader"),
                     "pretrain.py": "import torch\nfrom torch.utils.data import DataLoader\n"
                                    "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                    "loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
                                    "def run():\n" + loop.format("loader"),
                     "finetune.py": "import torch\nimport engine\nmodel = torch.nn.Linear(2, 1)\n"
                                    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                    "engine.train_epoch(model, batches, opt)\n"})
    assert not done["engine.py"].kept and any("a parameter of train_epoch" in x.what for x in done["engine.py"].left)


def test_the_projects_other_files_copied_beside_skip_pipes_and_a_folder_written_in_place(tmp_path):
    """Review: ``-o .`` (the project's own folder) copied each file onto itself (SameFileError, exit 2 after the
    converted files were written), and a named pipe aborted the copy the same way."""
    import os

    from ddpkit.commands.convert.project import companions

    root = tmp_path / "p"
    (root / "cfg").mkdir(parents=True)
    (root / "train.py").write_text("print(1)\n")
    (root / "cfg" / "a.json").write_text("{}")
    os.mkfifo(root / "events.pipe")
    assert companions(str(root), ["train.py"], str(root)) == (0, [])
    copied, skipped = companions(str(root), ["train.py"], str(tmp_path / "out"))
    assert copied == 1 and skipped == ["events.pipe (not a regular file)"], skipped
    assert (tmp_path / "out" / "cfg" / "a.json").read_text() == "{}"


RUNNER = """import torch
from torch import nn

from data import make_loader


class Runner:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def train(self, loader, epochs):
        for epoch in range(epochs):
            print(epoch, self.one_epoch(loader))

    def one_epoch(self, loader):
        self.model.train()
        total = 0.0
        for x, y in loader:
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total += loss.item() * len(x)
        return total / len(loader.dataset)


def main():
    loader = make_loader(32)
    model = nn.Linear(4, 1)
    Runner(model, torch.optim.SGD(model.parameters(), lr=0.05)).train(loader, 2)


main()
"""
DATA = """import torch
from torch.utils.data import DataLoader, TensorDataset


def make_loader(batch_size):
    x = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size, shuffle=True)
"""


def test_a_runner_whose_train_method_calls_model_train_and_a_loader_another_module_returns(tmp_path):
    """Sixth held-out set: ``self.model.train()`` was taken for the script's own ``Runner.train`` (a false "fed
    by hand"); the loader ``make_loader()`` returns in data.py was said converted there but kept plain (every rank
    trained on every batch); and the training sum over it, divided by ``len(loader.dataset)``, was not reduced."""
    (tmp_path / "train.py").write_text(RUNNER)
    (tmp_path / "data.py").write_text(DATA)
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "train.py")], timeout=120)
    assert r.returncode == 0, r.stderr
    data = (tmp_path / "out" / "data.py").read_text()
    assert "return ddpkit.data_loader(TensorDataset(x, x.sum(1, keepdim=True)), global_batch_size=batch_size" in data
    train = (tmp_path / "out" / "train.py").read_text()
    assert "total = ddpkit.reduce(total)" in train and "ddpkit.prepare_model(nn.Linear(4, 1))" in train


def test_a_loader_and_a_device_read_through_a_star_import_of_a_project_module(tmp_path):
    """Sixth held-out set (a DCGAN's params.py, read with ``from params import *``): the loop over ``dataloader``
    was refused as "fed by hand", and params.py's loader kept as "nothing reads dataloader"."""
    (tmp_path / "params.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nlr = 0.1\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "dataloader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16, shuffle=True)\n")
    (tmp_path / "main.py").write_text(
        "import torch\nfrom torch import nn\nfrom params import *\n\nmodel = nn.Linear(8, 1).to(device)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=lr)\nfor x, y in dataloader:\n    opt.zero_grad()\n"
        "    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()\n    opt.step()\n")
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "main.py")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dataloader = ddpkit.data_loader(" in (tmp_path / "out" / "params.py").read_text()
    assert "model = ddpkit.prepare_model(nn.Linear(8, 1))" in (tmp_path / "out" / "main.py").read_text()


def test_a_model_built_in_the_entry_and_handed_to_another_modules_training_function(tmp_path):
    """Sixth held-out set: ``train_model(model, loader, device)`` of trainer.py, called from main.py, where the
    model is built: "where it is built was not found", even with --imports. main.py wraps what it passes now; the
    trainer converted alone still says it, with its line."""
    (tmp_path / "trainer.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef train_model(model, loader, device):\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n    for x, y in loader:\n        opt.zero_grad()\n"
        "        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()\n        opt.step()\n")
    (tmp_path / "main.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "from trainer import train_model\n\ndevice = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16, shuffle=True)\n"
        "model = nn.Linear(8, 1).to(device)\ntrain_model(model, loader, device)\n")
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "main.py")], timeout=120)
    assert r.returncode == 0, r.stderr
    main = (tmp_path / "out" / "main.py").read_text()
    assert "model = ddpkit.prepare_model(nn.Linear(8, 1))" in main and "ddpkit.data_loader(" in main, main
    alone = run_cmd(CONVERT + [str(tmp_path / "trainer.py")], timeout=60)
    assert alone.returncode == 1 and "is a parameter of train_model()" in alone.stderr, alone.stderr


def test_a_loader_sharded_for_one_files_training_and_evaluated_in_another_gets_its_sums_reduced(tmp_path):
    """Review: data.py's ``make_loader`` trained on in train.py and evaluated in evaluate.py became a training
    loader; evaluate.py's count was rank 0's shard (0.36 where the original printed 0.75), with nothing said."""
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "evaluate.py").write_text(
        "import torch\n\nfrom data import make_loader\n\n\ndef evaluate(model):\n    loader = make_loader(16)\n"
        "    total = 0.0\n    with torch.no_grad():\n        for x, y in loader:\n"
        "            total += (model(x) - y).abs().sum().item()\n    return total / len(loader.dataset)\n")
    (tmp_path / "train.py").write_text(RUNNER.replace("from data import make_loader\n",
                                                      "from data import make_loader\nfrom evaluate import evaluate\n"))
    r = run_cmd(CONVERT + ["--imports", "-o", str(tmp_path / "out"), str(tmp_path / "train.py")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "total = ddpkit.reduce(total)" in (tmp_path / "out" / "evaluate.py").read_text(), r.stderr
