"""Projects whose training loader comes from another module in shapes the seventh held-out set met (docs/convert.md):
a neighbour imported by its package path (TCN's ``from TCN.mnist_pixel.utils import ...``), loaders returned beside
their shape by functions picked in an ``if``/``elif`` (LynnHo's ``data.make_*_dataset``), and a dict of loaders read
by key (cs230's ``fetch_dataloader(...)['train']``). Each converted nothing, or refused, before its fix."""
import sys

import pytest

from conftest import run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.convert import project  # noqa: E402
from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

CONVERT = [sys.executable, "-m", "ddpkit", "convert"]
DATA = "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n" \
       "ds = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), " \
       "torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(1)))\n"
LOOP = "for epoch in range(2):\n    for x, y in {over}:\n        loss = F.cross_entropy(model(x), y)\n" \
       "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n    print(loss.item())\n"
ENTRY = "import torch\nimport torch.nn.functional as F\n{imports}\ntorch.manual_seed(0)\n{loaders}\n" \
        "model = torch.nn.Linear(8, 2)\noptimizer = torch.optim.Adam(model.parameters(), lr=0.01)\n" + LOOP


def _settled(files, root_outer=()):
    return settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing), root_outer)


def test_a_neighbour_imported_by_its_package_path_is_part_of_the_project(tmp_path):
    sub = tmp_path / "TCN" / "mnist_pixel"
    sub.mkdir(parents=True)
    (sub / "utils.py").write_text(DATA + "\n\ndef loaders(b):\n    return DataLoader(ds, batch_size=b, shuffle=True)\n")
    (sub / "train.py").write_text("import sys\nsys.path.append('../../')\n" + ENTRY.format(
        imports="from TCN.mnist_pixel.utils import loaders", loaders="train_loader = loaders(16)",
        over="train_loader"))
    root, files = project.files_of(str(sub / "train.py"), imports=True)
    assert files == ["train.py", "utils.py"], files
    done = _settled({rel: (sub / rel).read_text() for rel in files}, project.outer(root))
    assert "ddpkit.data_loader(ds, global_batch_size=b, shuffle=True)" in done["utils.py"].text
    assert not done["train.py"].left and not done["train.py"].refused, done["train.py"].left
    # review: written to -o OUT, the copy still imported TCN.mnist_pixel.utils (no such package there, or the
    # unconverted original inside the repository): the import is the folder's own now
    out = tmp_path / "out"
    r = run_cmd(CONVERT + ["--imports", "-o", str(out), "train.py"], timeout=60, cwd=str(sub))
    assert r.returncode == 0 and "from utils import loaders" in (out / "train.py").read_text(), r.stderr
    ran = run_cmd([sys.executable, "train.py"], timeout=120, cwd=str(out))
    assert ran.returncode == 0, ran.stderr[-1500:]
    # a library's module is never taken for a neighbour: torch.utils stays torch's beside a utils.py
    assert project.local("torch.utils", project.outer(str(tmp_path / "torch")), lambda m: m == "utils") == "utils"
    assert project.local("torch.utils", ("TCN.mnist_pixel",), lambda m: m == "utils") == "torch.utils"


PICKED = {
    "data.py": DATA + "".join(f"\n\ndef make_{n}(batch_size, shuffle=True):\n    loader = DataLoader(ds, batch_size="
                              "batch_size, shuffle=shuffle, drop_last=True)\n    return loader, [8]\n"
                              for n in ("small", "large")),
    "train.py": ENTRY.format(imports="import data\nimport argparse\n"
                             "size = argparse.ArgumentParser().parse_args([]) and 'small'",
                             loaders="if size == 'small':\n    data_loader, shape = data.make_small(16)\n"
                             "elif size == 'large':\n    data_loader, shape = data.make_large(16)\n",
                             over="data_loader"),
}


def test_loaders_returned_with_their_shape_by_functions_picked_in_an_if_elif_all_convert():
    done = _settled(PICKED)
    assert not done["data.py"].refused and not done["train.py"].left, (done["data.py"].left, done["train.py"].left)
    assert done["data.py"].text.count("ddpkit.data_loader(ds, global_batch_size=batch_size") == 2, done["data.py"].text


DICT = {
    "model/__init__.py": "",
    "model/data_loader.py": DATA + "\n\ndef fetch_dataloader(types, batch_size):\n    loaders = {}\n"
    "    for split in ['train', 'val']:\n        if split in types:\n            if split == 'train':\n"
    "                dl = DataLoader(ds, batch_size=batch_size, shuffle=True)\n            else:\n"
    "                dl = DataLoader(ds, batch_size=batch_size, shuffle=False)\n            loaders[split] = dl\n"
    "    return loaders\n",
    "train.py": ENTRY.format(imports="import model.data_loader as data_loader",
                             loaders="dataloaders = data_loader.fetch_dataloader(['train', 'val'], 16)\n"
                             "train_dl = dataloaders['train']\n", over="train_dl"),
}


def test_a_dict_of_loaders_read_by_key_shards_the_one_that_shuffles_and_launches(tmp_path):
    """cs230's pattern: the entry was refused ("fed by hand"), the module's loaders "role cannot be told"."""
    for rel, text in DICT.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    out = tmp_path / "out"
    r = run_cmd(CONVERT + ["--imports", "-o", str(out), str(tmp_path / "train.py")], timeout=60)
    assert r.returncode == 0 and "refused" not in r.stderr, r.stderr
    data = (out / "model" / "data_loader.py").read_text()
    assert "dl = ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in data, data
    assert "dl = DataLoader(ds, batch_size=batch_size, shuffle=False)" in data, data
    launched = run_cmd([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "train.py"],
                       timeout=240, cwd=str(out))
    assert launched.returncode == 0 and "global batch 16 = 8 per process x 2" in launched.stderr, \
        launched.stdout + launched.stderr[-1500:]


def test_a_dict_whose_loaders_all_shuffle_or_do_not_say_is_still_refused():
    """Which loader a key holds is not followed: with two that shuffle (or a shuffle not written out), the
    shuffle cannot tell them apart, and sharding an evaluation loader would skew its metric silently."""
    for second in ("shuffle=True", "shuffle=flag"):
        files = dict(DICT, **{"model/data_loader.py": DICT["model/data_loader.py"].replace("shuffle=False", second)})
        done = _settled(files)
        assert done["model/data_loader.py"].refused, done["model/data_loader.py"].text


SOLVER = {
    "data_loader.py": DATA + "\n\ndef get_loader(batch_size):\n    return DataLoader(ds, batch_size=batch_size, "
                      "shuffle=True)\n",
    "solver.py": "import torch\nimport torch.nn.functional as F\n\n\nclass Solver:\n"
                 "    def __init__(self, loader, iters):\n        self.loader, self.iters = loader, iters\n"
                 "        self.model = torch.nn.Linear(8, 2)\n"
                 "        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)\n\n"
                 "    def train(self):\n        data_iter = iter(self.loader)\n        for i in range(self.iters):\n"
                 "            try:\n                x, y = next(data_iter)\n            except StopIteration:\n"
                 "                data_iter = iter(self.loader)\n                x, y = next(data_iter)\n"
                 "            loss = F.cross_entropy(self.model(x), y)\n            self.opt.zero_grad()\n"
                 "            loss.backward()\n            self.opt.step()\n        print(loss.item())\n",
    "main.py": "import torch\nfrom data_loader import get_loader\nfrom solver import Solver\n\n"
               "torch.manual_seed(0)\nloader = get_loader(16)\nsolver = Solver(loader, 6)\nsolver.train()\n",
}


def test_a_loader_handed_to_a_solver_that_draws_with_next_is_converted_where_the_entry_gets_it(tmp_path):
    """StarGAN's shape: the entry gets the loader from the data module and hands it to ``Solver(...)``, whose loop
    draws ``next(data_iter)``: the solver's file was refused ("fed by hand"), the data module's loader kept plain."""
    for rel, text in SOLVER.items():
        (tmp_path / rel).write_text(text)
    out = tmp_path / "out"
    r = run_cmd(CONVERT + ["--imports", "-o", str(out), str(tmp_path / "main.py")], timeout=60)
    assert r.returncode == 0 and "left to you" not in r.stderr, r.stderr
    assert "ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in (out / "data_loader.py").read_text()
    assert "self.model = ddpkit.prepare_model(torch.nn.Linear(8, 2))" in (out / "solver.py").read_text()
    assert "kept: the training loop over loader (a parameter of Solver.__init__) left as it is" in r.stderr, r.stderr
    launched = run_cmd([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "main.py"],
                       timeout=240, cwd=str(out))
    assert launched.returncode == 0 and "global batch 16 = 8 per process x 2" in launched.stderr, \
        launched.stdout + launched.stderr[-1500:]


CALLABLE = {
    "datasets.py": DATA + "\n\ndef get_dataloaders(batch_size=16, shuffle=True):\n"
                   "    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)\n",
    "training.py": "import torch.nn.functional as F\n\n\nclass Trainer:\n    def __init__(self, model, optimizer):\n"
                   "        self.model, self.optimizer = model, optimizer\n\n"
                   "    def __call__(self, data_loader, epochs=2):\n        for epoch in range(epochs):\n"
                   "            self._epoch(data_loader)\n\n    def _epoch(self, data_loader):\n"
                   "        for x, y in data_loader:\n            self._step(x, y)\n\n    def _step(self, x, y):\n"
                   "        loss = F.cross_entropy(self.model(x), y)\n        self.optimizer.zero_grad()\n"
                   "        loss.backward()\n        self.optimizer.step()\n",
    "main.py": "import torch\nfrom datasets import get_dataloaders\nfrom training import Trainer\n\n"
               "train_loader = get_dataloaders(batch_size=16)\nmodel = torch.nn.Linear(8, 2)\n"
               "trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01))\n"
               "trainer(train_loader, epochs=2)\n",
}


def test_a_callable_trainer_handed_a_loader_from_the_projects_own_datasets_module():
    """disentangling-vae's shape: ``trainer(train_loader)`` calls ``Trainer.__call__``; the loader comes from the
    project's ``datasets.py``, which shadows the Hugging Face library of that name for the script."""
    done = settle(list(CALLABLE), lambda rel, crossing: plan(CALLABLE[rel], crossing=crossing))
    assert "ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=shuffle)" in done["datasets.py"].text
    assert not done["training.py"].left and any("a parameter of Trainer.__call__" in k.what
                                                for k in done["training.py"].kept), done["training.py"].left
    alone = plan(CALLABLE["training.py"])
    assert any("a parameter of Trainer.__call__ that no call in this file passes" in x.what for x in alone.left)


def test_two_loaders_handed_to_a_solver_that_picks_one_and_a_loader_a_method_of_an_imported_class_returns():
    """StarGAN builds ``celeba_loader`` and ``rafd_loader`` (each None unless its dataset is chosen), and the solver
    draws from ``data_loader = self.celeba_loader`` or ``self.rafd_loader``: both are trained on. NCF gets its
    loader from ``sample_generator.instance_a_train_loader(...)``, a method of a class of its data module."""
    solver = SOLVER["solver.py"].replace("def __init__(self, loader, iters):\n        self.loader, self.iters = "
                                         "loader, iters", "def __init__(self, a, b, iters, pick):\n        self.a, "
                                         "self.b, self.iters, self.pick = a, b, iters, pick")
    solver = solver.replace("data_iter = iter(self.loader)", "data_loader = self.a\n        if self.pick == 'b':\n"
                            "            data_loader = self.b\n        data_iter = iter(data_loader)", 1)
    solver = solver.replace("data_iter = iter(self.loader)", "data_iter = iter(data_loader)")
    files = {"data_loader.py": SOLVER["data_loader.py"] + "\n\ndef get_other(batch_size):\n    return DataLoader("
                                                          "ds, batch_size=batch_size, shuffle=True)\n",
             "solver.py": solver,
             "main.py": "from data_loader import get_loader, get_other\nfrom solver import Solver\n\na = b = None\n"
                        "if pick_a:\n    a = get_loader(16)\nelse:\n    b = get_other(16)\n"
                        "Solver(a, b, 6, 'b').train()\n"}
    done = _settled(files)
    assert done["data_loader.py"].text.count("ddpkit.data_loader(ds, global_batch_size=batch_size") == 2, \
        done["data_loader.py"].text
    assert not done["solver.py"].left, done["solver.py"].left
    ncf = _settled({"data.py": DATA + "\n\nclass Gen:\n    def loader(self, batch_size):\n        return DataLoader("
                               "ds, batch_size=batch_size, shuffle=True)\n",
                    "train.py": ENTRY.format(imports="from data import Gen", loaders="gen = Gen()\n"
                                             "train_loader = gen.loader(16)", over="train_loader")})
    assert "ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in ncf["data.py"].text
    assert not ncf["train.py"].left, ncf["train.py"].left


def test_one_builder_of_the_training_and_the_evaluation_loader_is_refused_with_that_cause():
    """char-cnn's ``make_data_loader()`` builds both: the refusal named "a loader left unsharded" and a fix that
    cannot be applied where it is built (the training loader's line)."""
    source = DATA + "\n\ndef make(seed, b):\n    return ds, DataLoader(ds, batch_size=b, shuffle=True)\n\n\n" \
        "def evaluate(loader, model):\n    n = 0\n    with torch.no_grad():\n        for x, y in loader:\n" \
        "            n += (model(x).argmax(1) == y).sum().item()\n    print(n)\n\n\n" \
        "import torch.nn.functional as F\n_, train_loader = make(0, 16)\n_, dev_loader = make(1, 16)\n" \
        "model = torch.nn.Linear(8, 2)\noptimizer = torch.optim.Adam(model.parameters(), lr=0.01)\n" + \
        LOOP.format(over="train_loader") + "evaluate(dev_loader, model)\n"
    result = plan(source)
    assert result.refused and any("which make() builds with the same DataLoader line as the training loader" in x.what
                                  for x in result.left), result.left


def test_loaders_kept_as_attributes_of_a_data_class_of_another_module():
    """davda54/sam's ``dataset = Cifar(batch_size, threads)`` keeps ``self.train`` and ``self.test``; the entry
    trains on ``dataset.train`` and evaluates ``dataset.test``: the first is sharded, the second stays whole."""
    files = {"data/__init__.py": "",
             "data/cifar.py": DATA + "\n\nclass Cifar:\n    def __init__(self, batch_size):\n"
                              "        self.train = DataLoader(ds, batch_size=batch_size, shuffle=True)\n"
                              "        self.test = DataLoader(ds, batch_size=batch_size, shuffle=False)\n",
             "train.py": ENTRY.format(imports="from data.cifar import Cifar", loaders="dataset = Cifar(16)",
                                      over="dataset.train") +
             "with torch.no_grad():\n    right = 0\n    for x, y in dataset.test:\n"
             "        right += (model(x).argmax(1) == y).sum().item()\nprint(right)\n"}
    done = _settled(files)
    data = done["data/cifar.py"].text
    assert "self.train = ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in data, data
    assert "self.test = DataLoader(ds, batch_size=batch_size, shuffle=False)" in data, data
    assert not done["train.py"].left and "ddpkit.reduce" not in done["train.py"].text, done["train.py"].left


SOLVER_EVAL = "import torch\nimport torch.nn.functional as F\n\n\nclass Solver:\n" \
    "    def __init__(self, train_loader, val_loader):\n        self.train_loader, self.val_loader = train_loader, " \
    "val_loader\n\n    def run(self, model, opt):\n        data = self.train_loader\n        for x, y in data:\n" \
    "            loss = F.cross_entropy(model(x), y)\n            opt.zero_grad()\n            loss.backward()\n" \
    "            opt.step()\n        data = {evaluated}\n        right, total = 0, 0\n        with torch.no_grad():\n" \
    "            for x, y in data:\n                right += (model(x).argmax(1) == y).sum().item()\n" \
    "                total += y.numel()\n        print(right / total, total)\n"
SOLVER_MAIN = DATA + "import torch.nn.functional as F\nfrom solver import Solver\n\n" \
    "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\nval_loader = DataLoader(ds, batch_size=8)\n" \
    "model = torch.nn.Linear(8, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" \
    "Solver({passed}, val_loader).run(model, opt)\n"


def test_review_an_evaluation_over_what_the_callers_hand_in_is_reduced_and_a_later_binding_is_not_trained_on():
    """Review: a solver's evaluation over the handed-in training loader kept its shard's sums unreduced; a name
    bound to the validation loader after the training loop made the validation loader a training one."""
    over_train = _settled({"solver.py": SOLVER_EVAL.format(evaluated="self.train_loader"),
                           "main.py": SOLVER_MAIN.format(passed="train_loader")})
    assert "right = ddpkit.reduce(right)" in over_train["solver.py"].text, over_train["solver.py"].text
    rebound = _settled({"solver.py": SOLVER_EVAL.format(evaluated="self.val_loader"),
                        "main.py": SOLVER_MAIN.format(passed="train_loader")})
    assert "val_loader = DataLoader(ds, batch_size=8)" in rebound["main.py"].text, rebound["main.py"].text
    assert "ddpkit.reduce" not in rebound["solver.py"].text


def test_review_a_list_of_batches_handed_to_the_solver_is_not_said_fed_by_a_loader():
    """Review: any file of the project that trained on a converted loader made the solver's loop "kept", though
    its caller handed it a list of batches: each rank trained on all of them, with no word."""
    main = SOLVER_MAIN.format(passed="batches").replace("Solver(", "batches = [ds[i:i + 8] for i in range(0, 64, 8)]\n"
                                                        "for x, y in train_loader:\n    F.cross_entropy(model(x), y)"
                                                        ".backward()\n    opt.step()\nSolver(")
    done = _settled({"solver.py": SOLVER_EVAL.format(evaluated="self.val_loader"), "main.py": main})
    assert any("a parameter of Solver.__init__: what a caller in the project passes was not made" in x.what
               for x in done["solver.py"].left), (done["solver.py"].left, done["solver.py"].kept)


def test_review_a_dict_whose_keys_are_written_out_shards_the_loader_of_the_training_key():
    """Review: the validation loader shuffled and the training one did not: the validation loader was sharded for
    training, the training one kept whole. With the keys written out, the key tells."""
    files = {"data.py": DATA + "\n\ndef fetch(b):\n    train = DataLoader(ds, batch_size=b, shuffle=False)\n"
                               "    val = DataLoader(ds, batch_size=b, shuffle=True)\n"
                               "    return {'train': train, 'val': val}\n",
             "train.py": ENTRY.format(imports="import data", loaders="loaders = data.fetch(16)\n"
                                      "train_dl = loaders['train']", over="train_dl")}
    data = _settled(files)["data.py"].text
    assert "train = ddpkit.data_loader(ds, global_batch_size=b, shuffle=False)" in data, data
    assert "val = DataLoader(ds, batch_size=b, shuffle=True)" in data, data
    swapped = dict(DICT, **{"model/data_loader.py": DICT["model/data_loader.py"].replace(
        "shuffle=True", "shuffle=X").replace("shuffle=False", "shuffle=True").replace("shuffle=X", "shuffle=False")})
    assert _settled(swapped)["model/data_loader.py"].refused  # keys not written out: the one that shuffles is not
    # in the body of ``if split == 'train':``, so which is which cannot be told


def test_a_shuffled_validation_loader_handed_to_another_modules_evaluation_stays_whole():
    """Eighth held-out set (clovaai's deep-text-recognition-benchmark): ``validation(model, valid_loader)`` of
    ``evaluate.py``, called in the training loop, with ``valid_loader`` shuffled: taken for a training loader by its
    shuffle=True, each rank validated its half and rank 0 reported and kept the best by its half, silently."""
    files = {"evaluate.py": "import torch\n\n\ndef validation(model, loader):\n    right, n = 0, 0\n"
                            "    for x, y in loader:\n        right += (model(x).argmax(1) == y).sum().item()\n"
                            "        n += len(y)\n    return right / n\n",
             "train.py": DATA + "import torch.nn.functional as F\nfrom evaluate import validation\n"
                         "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
                         "valid_loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = torch.nn.Linear(8, 2)\n"
                         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" +
                         LOOP.format(over="train_loader").replace("    print(loss.item())",
                                                                 "    with torch.no_grad():\n"
                                                                 "        print(validation(model, valid_loader))")}
    done = _settled(files)
    assert "valid_loader = DataLoader(ds, batch_size=8, shuffle=True)" in done["train.py"].text, done["train.py"].text
    assert "train_loader = ddpkit.data_loader(" in done["train.py"].text and not done["train.py"].left
    alone = plan(files["train.py"])  # converted alone: its role is not guessed, and that is said
    assert "valid_loader = DataLoader(" in alone.text and any("handed to validation" in x.what for x in alone.left)


def test_a_demo_loop_under_main_of_an_imported_module_does_not_refuse_the_project():
    """Eighth held-out set (deeplab-xception, pytorch-semseg): a dataset module's ``if __name__ == "__main__":``
    demo loops over a DataLoader of its own: "role cannot be told" refused the whole project. Imported, the block
    never runs; the same block in the entry script is still converted as ever."""
    toy = DATA + "\n\nif __name__ == '__main__':\n    demo = DataLoader(ds, batch_size=2, shuffle=True)\n" \
                 "    for x, y in demo:\n        print(x.shape)\n"
    files = {"toy.py": toy, "train.py": ENTRY.format(imports="from torch.utils.data import DataLoader\n"
                                                             "from toy import ds", loaders="train_loader = "
                                                             "DataLoader(ds, batch_size=16, shuffle=True)",
                                                     over="train_loader")}
    done = _settled(files)
    assert not any(p.refused for p in done.values()), {k: p.left for k, p in done.items()}
    assert "demo = DataLoader(ds, batch_size=2, shuffle=True)" in done["toy.py"].text
    assert plan(toy).refused  # converted as a script of its own, its loop's role still cannot be told


def test_a_loader_read_through_a_generator_or_a_helper_that_draws_next_of_it():
    """Eighth held-out set: altosaar's VAE reads ``enumerate(cycle(loader))`` (its ``cycle`` yields each batch:
    "role cannot be told"); shayneobrien's GAN trainer draws ``next(iter(iterator))`` in ``process_batch(
    self.train_iter)`` ("fed by hand"), and its data module's unread ``val_iter`` was made a training loader."""
    cycled = DATA + "import torch.nn.functional as F\n\n\ndef cycle(it):\n    while True:\n        for x in it:\n" \
        "            yield x\n\n\nloader = DataLoader(ds, batch_size=8, shuffle=True)\n" \
        "model = torch.nn.Linear(8, 2)\n" \
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\nfor step, (x, y) in enumerate(cycle(loader)):\n" \
        "    loss = F.cross_entropy(model(x), y)\n    optimizer.zero_grad()\n    loss.backward()\n" \
        "    optimizer.step()\n    if step == 11:\n        break\n"
    result = plan(cycled)
    assert not result.refused and "ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in result.text
    assert "no_grad" not in result.text, result.text  # (the after-fix re-run: the generator's loop went under it)
    trainer = "import torch\nfrom utils import *\n\n\nclass Trainer:\n    def __init__(self, model, train_iter, " \
        "val_iter):\n        self.model, self.train_iter, self.val_iter = model, train_iter, val_iter\n\n" \
        "    def batch(self, iterator):\n        return next(iter(iterator))\n\n    def train(self, steps):\n" \
        "        opt = torch.optim.Adam(self.model.parameters())\n        for _ in range(steps):\n" \
        "            x, y = self.batch(self.train_iter)\n            loss = (self.model(x) - y).pow(2).mean()\n" \
        "            opt.zero_grad()\n            loss.backward()\n            opt.step()\n\n\n" \
        "if __name__ == '__main__':\n    train_iter, val_iter = get_data()\n" \
        "    Trainer(torch.nn.Linear(8, 2), train_iter, val_iter).train(8)\n"
    data = DATA + "\n\ndef get_data(b=8):\n    train_iter = DataLoader(ds, batch_size=b, shuffle=True)\n" \
        "    val_iter = DataLoader(ds, batch_size=b, shuffle=True)\n    return train_iter, val_iter\n"
    done = _settled({"utils.py": data, "train.py": trainer})
    assert not done["train.py"].left and not done["train.py"].refused, done["train.py"].left
    assert "train_iter = ddpkit.data_loader(" in done["utils.py"].text
    assert "val_iter = DataLoader(ds, batch_size=b, shuffle=True)" in done["utils.py"].text, done["utils.py"].text


def test_second_review_a_reused_name_a_training_loader_evaluated_elsewhere_and_an_entry_imported_by_a_sibling():
    """Second review: (1) ``dl`` reused for both loaders stored by key made the validation loader a sharded training
    one, silently; (2) the training loader also handed to another module's evaluation gave rank 0's shard's
    accuracy; (3) an entry whose main block trains, imported by a sibling for its model, was refused as a demo."""
    reused = dict(DICT, **{"model/data_loader.py": DATA + "\n\ndef fetch_dataloader(types, batch_size):\n"
                           "    loaders = {}\n    dl = DataLoader(ds, batch_size=batch_size, shuffle=True)\n"
                           "    loaders['train'] = dl\n    dl = DataLoader(ds, batch_size=batch_size)\n"
                           "    loaders['val'] = dl\n    return loaders\n"})
    data = _settled(reused)["model/data_loader.py"].text
    assert data.count("ddpkit.data_loader(") == 1 and "dl = DataLoader(ds, batch_size=batch_size)" in data, data
    utils = "import torch\n\n\ndef evaluate(model, loader):\n    right = 0\n    with torch.no_grad():\n" \
        "        for x, y in loader:\n            right += (model(x).argmax(1) == y).sum().item()\n    return right\n"
    main = DATA + "import torch.nn.functional as F\nfrom utils import evaluate\n" \
        "train_loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = torch.nn.Linear(8, 2)\n" \
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOOP.format(over="train_loader") + \
        "print(evaluate(model, train_loader))\n"
    done = _settled({"utils.py": utils, "main.py": main})
    assert done["main.py"].refused and any("also handed to another module's evaluation" in x.what
                                           for x in done["main.py"].left), done["main.py"].left
    entry = DATA + "import torch.nn.functional as F\n\n\ndef build_model():\n    return torch.nn.Linear(8, 2)\n\n\n" \
        "if __name__ == '__main__':\n    train_loader = DataLoader(ds, batch_size=8, shuffle=True)\n" \
        "    model = build_model()\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" \
        "    for x, y in train_loader:\n        loss = F.cross_entropy(model(x), y)\n" \
        "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n"
    done = _settled({"train.py": entry, "test.py": "from train import build_model\nmodel = build_model()\n"})
    assert "train_loader = ddpkit.data_loader(" in done["train.py"].text, done["train.py"].left


def test_second_review_imports_through_the_package_path_over_several_lines_or_as_a_module_are_localized():
    text = "from TCN.pix.utils import (\n    get,\n    put,\n)\nimport TCN.pix.model as m\n\n\ndef f():\n" \
           "    from TCN.pix.utils import get\n"
    done, lines = project.localize(text, ("TCN.pix", "pix"), ["utils.py", "model.py"])
    assert done == "from utils import get, put\nimport model as m\n\n\ndef f():\n    from utils import get\n", done
    assert lines == [1, 5, 9]


def test_a_project_whose_loader_was_not_converted_where_it_is_built_is_not_told_to_convert_together():
    """deeplab, converted with --imports, was told "convert them together (--imports)": the project's own
    module said why its loader stayed plain; the entry now points there."""
    files = dict(DICT, **{"model/data_loader.py": DICT["model/data_loader.py"].replace("shuffle=False",
                                                                                        "shuffle=True")})
    said = [x for rel, done in _settled(files).items() for x in done.left if "loaders" in x.what and
            "modules" in x.what]
    assert said and all("--imports" not in x.fix and "other modules of the project" in x.what for x in said), \
        [(x.what, x.fix) for x in said]
