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
