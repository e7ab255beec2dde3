"""What the experiment classes of the time-series forecasting repositories, and the eleventh held-out set
(docs/convert.md), showed ``ddpkit convert`` owes public scripts: each a case written in our own words after the
pattern met."""
import sys

import pytest

pytest.importorskip("libcst")

from conftest import launch, run_cmd  # noqa: E402
from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

BASIC = '''import torch
from torch import nn


class Exp_Basic(object):
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cpu")
        self.model = self._build_model().to(self.device)

    def _build_model(self):
        raise NotImplementedError
'''

MAIN = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from exp.exp_basic import Exp_Basic


class Exp_Main(Exp_Basic):
    def _build_model(self):
        return nn.Linear(8, 1)

    def train(self):
        loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4, shuffle=True)
        opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(self.model(x.to(self.device)), y).backward()
            opt.step()
'''


def test_a_model_its_base_class_builds_in_another_module_is_wrapped_there():
    """Time-Series-Library's ``Exp_Main(Exp_Basic)``: the optimizer over ``self.model`` in the subclass, the model
    built by ``Exp_Basic.__init__`` in exp/exp_basic.py. Refused as "where it is built was not found"."""
    files = {"exp/exp_basic.py": BASIC, "exp/exp_main.py": MAIN, "exp/__init__.py": ""}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done["exp/exp_basic.py"].text
    assert not done["exp/exp_main.py"].left, done["exp/exp_main.py"].left
    assert any("a base class builds" in k.what for k in done["exp/exp_main.py"].kept)
    alone = plan(MAIN)  # converted alone: said, with the module to convert with it
    assert any("built by a base class imported from another module (Exp_Basic (from exp.exp_basic))" in item.what
               for item in alone.left), alone.left


def test_a_model_a_base_class_of_the_same_file_builds_is_wrapped_in_it():
    one = BASIC.replace("from torch import nn\n", "from torch import nn\nfrom torch.utils.data import DataLoader, "
                        "TensorDataset\n") + MAIN.split("import Exp_Basic\n")[1]
    done = plan(one)
    assert done.text.count("ddpkit.prepare_model(") == 1, done.text
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done.text and not done.left, done.left


SERIES = '''class Series(Dataset):
    def __init__(self, flag):
        g = torch.Generator().manual_seed({{"train": 0, "val": 1, "test": 2}}[flag])
        self.x = torch.randn({n}, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


'''

FACTORY = '''import torch
from torch.utils.data import DataLoader, Dataset


''' + SERIES.format(n=36) + '''def data_provider(args, flag):
    if flag == "test":
        shuffle_flag = False
        batch_size = 1
    else:
        shuffle_flag = True
        batch_size = args.batch_size
    data_set = Series(flag)
    data_loader = DataLoader(data_set, batch_size=batch_size, shuffle=shuffle_flag, drop_last=True)
    return data_set, data_loader
'''

EXPERIMENT = '''import os
import torch
from torch import nn
from data_provider.data_factory import data_provider
from exp.exp_basic import Exp_Basic


class Exp_Main(Exp_Basic):
    def _build_model(self):
        model = nn.Linear(8, 1)
        if self.args.use_multi_gpu:
            model = nn.DataParallel(model, device_ids=self.args.device_ids)
        return model

    def _get_data(self, flag):
        data_set, data_loader = data_provider(self.args, flag)
        return data_set, data_loader

    def vali(self, vali_loader):
        total = []
        self.model.eval()
        with torch.no_grad():
            for x, y in vali_loader:
                total.append(nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device)).item())
        self.model.train()
        return sum(total) / len(total)

    def train(self, setting):
        _, train_loader = self._get_data(flag="train")
        _, vali_loader = self._get_data(flag="val")
        path = os.path.join(self.args.checkpoints, setting)
        if not os.path.exists(path):
            os.makedirs(path)
        opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        for epoch in range(self.args.train_epochs):
            for x, y in train_loader:
                opt.zero_grad()
                loss = nn.functional.mse_loss(self.model(x.to(self.device)), y.to(self.device))
                loss.backward()
                opt.step()
            print("epoch", epoch, "vali", self.vali(vali_loader))
            torch.save(self.model.state_dict(), path + "/checkpoint.pth")
'''

RUN = '''import argparse
import torch
from exp.exp_main import Exp_Main

if __name__ == "__main__":
    torch.manual_seed(2021)
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=6)
    parser.add_argument("--train_epochs", type=int, default=1)
    parser.add_argument("--checkpoints", default="./checkpoints/")
    parser.add_argument("--use_multi_gpu", action="store_true")
    args = parser.parse_args()
    Exp_Main(args).train("s1")
'''

FORECAST = {"data_provider/__init__.py": "", "data_provider/data_factory.py": FACTORY, "exp/__init__.py": "",
            "exp/exp_basic.py": BASIC, "exp/exp_main.py": EXPERIMENT, "run.py": RUN}


def test_one_loader_factory_for_every_split_shards_the_split_trained_on_and_verify_passes(tmp_path):
    """Time-Series-Library's ``data_provider(args, flag)``: one ``DataLoader(...)`` line for the train, val and test
    splits, reached through ``self._get_data(flag='train')``. Refused as "batches fed by hand" in the experiment and
    "role cannot be told" in the factory. Now the string decides: sharded for 'train', whole for the others."""
    for name, text in FORECAST.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    out = tmp_path / "out"
    r = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", str(out), str(tmp_path / "run.py")],
                timeout=60)
    assert r.returncode == 0 and "left to you" not in r.stderr, r.stderr
    factory = (out / "data_provider" / "data_factory.py").read_text()
    assert "data_loader = ddpkit.data_loader(data_set, global_batch_size=batch_size, shuffle=shuffle_flag, " \
        "drop_last=True) if flag == 'train' else DataLoader(data_set, batch_size=batch_size" in factory, factory
    assert "nn.DataParallel" not in (out / "exp" / "exp_main.py").read_text()
    v = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", str(out / "run.py")],
                timeout=300, cwd=str(out))
    assert v.returncode == 0 and v.stdout.startswith("PASS"), v.stdout + v.stderr[-1500:]


def test_a_factory_whose_splits_no_string_tells_apart_is_sharded_and_its_evaluation_told():
    """The same factory called for evaluation with a name, not a string (``self._get_data(flag=kind)``): which
    split each call takes cannot be told, so the one loader is sharded for training, as before, and the file
    that evaluates it learns so (its sums reduced or refused), not that it reads every batch."""
    files = dict(FORECAST, **{"exp/exp_main.py": EXPERIMENT.replace('self._get_data(flag="val")',
                                                                      "self._get_data(flag=self.args.kind)")})
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert ") if flag == 'train' else" not in done["data_provider/data_factory.py"].text
    assert "ddpkit.data_loader(" in done["data_provider/data_factory.py"].text
    said = [item.what for item in done["exp/exp_main.py"].left]
    assert any("sharded for training where it is built" in w or "also evaluated here" in w for w in said), said


ONE_FILE = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


''' + SERIES.format(n=63) + '''def data_provider(args, flag):
    shuffle_flag = flag == "train"
    data_set = Series(flag)
    data_loader = DataLoader(data_set, batch_size=args.batch_size, shuffle=shuffle_flag)
    return data_set, data_loader


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch_size", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _, train_loader = data_provider(args, "train")
    _, val_loader = data_provider(args, "val")
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in val_loader:
            total += nn.functional.mse_loss(model(x), y, reduction="sum").item()
            n += len(x)
    print("val samples", n)


if __name__ == "__main__":
    main()
'''


def test_a_factory_of_the_same_file_called_per_split_evaluates_every_sample_once(tmp_path):
    """The one-file shape of the same factory: its loader was made a training loader for both calls, so the
    validation ran over padded training shards, and its reduced count was 64 for 63 samples (one counted twice)."""
    done = plan(ONE_FILE)
    assert "shuffle=shuffle_flag) if flag == 'train' else DataLoader(data_set" in done.text, done.text
    assert "ddpkit.reduce" not in done.text and not done.left, done.left
    script = tmp_path / "split.py"
    script.write_text(done.text)
    r = launch(script, nproc=2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("val samples 63") == 1, r.stdout


def _forecast(**changes):
    """The forecasting project converted together, with some files' texts changed (path -> (old, new) pairs)."""
    files = dict(FORECAST)
    for path, pairs in changes.items():
        for old, new in pairs:
            assert old in files.get(path, old), (path, old)
            files[path] = files[path].replace(old, new) if old else files.get(path, "") + new
    return settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))


FACTORY_PY = "data_provider/data_factory.py"
TEST_SSE = '''

def test_sse(args, model):
    _, loader = data_provider(args, "test")
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += ((model(x) - y) ** 2).sum().item()
    return total
'''


def test_the_factorys_own_calls_count_in_the_split():
    """The review: the factory's module evaluating its 'test' split itself kept the whole loader and still reduced
    its sum (every rank's whole sum added: doubled at 2 processes); training on a 'pretrain' split itself left that
    one whole (each rank trained on all of it)."""
    done = _forecast(**{FACTORY_PY: [("", TEST_SSE)]})[FACTORY_PY]
    assert ") if flag == 'train' else DataLoader(" in done.text and "ddpkit.reduce" not in done.text, done.text
    pretrain = TEST_SSE.replace('"test"', '"pretrain"').replace("with torch.no_grad():", "if True:").replace(
        "total += ((model(x) - y) ** 2).sum().item()", "((model(x) - y) ** 2).sum().backward()")
    done = _forecast(**{FACTORY_PY: [("", pretrain)]})[FACTORY_PY]
    assert ") if flag in ('pretrain', 'train') else DataLoader(" in done.text, done.text


def test_a_split_parameter_rebound_before_the_loader_decides_nothing():
    """``flag = flag.lower()`` in the factory (or a method that maps its flag before passing it on): the string the
    caller passes is not what the test would read, so the training loader was never sharded (exit 0). Now no split:
    the one loader is sharded for training, and the evaluation told so."""
    lower = ("    data_set = Series(flag)", "    flag = flag.lower()\n    data_set = Series(flag)")
    for path, pair in ((FACTORY_PY, lower),
                       ("exp/exp_main.py", ("        data_set, data_loader = data_provider(self.args, flag)",
                                            "        flag = {'fit': 'train'}.get(flag, flag)\n"
                                            "        data_set, data_loader = data_provider(self.args, flag)"))):
        done = _forecast(**{path: [pair]})
        assert ") if flag == " not in done[FACTORY_PY].text and "ddpkit.data_loader(" in done[FACTORY_PY].text
        assert any("sharded for training where it is built" in i.what for i in done["exp/exp_main.py"].left), path


def test_strings_with_commas_keywords_and_case_variants_are_read_whole():
    """A string holding a comma crashed convert (the asks were joined with commas); 'train' passed by position
    and 'val' by keyword were two places; two experiments training on 'train' and on 'TRAIN' split nothing."""
    done = _forecast(**{"exp/exp_main.py": [('self._get_data(flag="val")', 'self._get_data(flag="va,l")')]})
    assert ") if flag == 'train' else DataLoader(" in done[FACTORY_PY].text
    direct = [('_, train_loader = self._get_data(flag="train")', '_, train_loader = data_provider(self.args, "TRAIN")'),
              ('_, vali_loader = self._get_data(flag="val")', '_, vali_loader = data_provider(self.args, flag="val")')]
    done = _forecast(**{"exp/exp_main.py": direct})
    assert ") if flag == 'TRAIN' else DataLoader(" in done[FACTORY_PY].text
    second = EXPERIMENT.replace("class Exp_Main", "class Exp_Other").replace('flag="train"', 'flag="TRAIN"')
    done = _forecast(**{"exp/exp_other.py": [("", second)], "run.py": [("from exp.exp_main import Exp_Main",
                                                                          "from exp.exp_main import Exp_Main\n"
                                                                          "from exp.exp_other import Exp_Other")]})
    assert ") if flag in ('TRAIN', 'train') else DataLoader(" in done[FACTORY_PY].text
    assert not done["exp/exp_other.py"].left and not done["exp/exp_main.py"].left
    assert not any("@" in i.what for d in done.values() for i in d.kept + d.left)


def test_a_converted_split_converts_to_itself():
    """Its own output, converted again, was refused: the whole-loader side read as a DataLoader in an expression."""
    text = _forecast()[FACTORY_PY].text
    again = plan(text)
    assert again.text == text and not again.left, again.left


def test_the_model_a_base_class_builds_as_an_instance_is_made_is_the_one_wrapped():
    """The review: ``__init__`` calls ``self._setup()``, which builds the model, and ``load()`` rebuilds it: the
    last binding (load's) was wrapped and the trained model never prepared. A mixin listed first that sets
    ``self.model`` in ``load_best()`` was taken for the base. A mixin imported from another module, listed
    first, and a base of a base in a third module, were refused as 'outside a project'."""
    setup = BASIC.replace("        self.model = self._build_model().to(self.device)\n",
                          "        self._setup()\n\n    def _setup(self):\n"
                          "        self.model = self._build_model().to(self.device)\n\n    def load(self, path):\n"
                          "        self.model = self._build_model()\n"
                          "        self.model.load_state_dict(torch.load(path))\n")
    done = _forecast(**{"exp/exp_basic.py": [(BASIC, setup)]})
    assert "    def _setup(self):\n        self.model = ddpkit.prepare_model(self._build_model())" in \
        done["exp/exp_basic.py"].text, done["exp/exp_basic.py"].text
    assert done["exp/exp_basic.py"].text.count("prepare_model(") == 1
    mixin = "class LogMixin:\n    def log(self, *a):\n        print(*a)\n"
    done = _forecast(**{"utils/__init__.py": [("", "")], "utils/mixins.py": [("", mixin)],
                        "exp/exp_main.py": [("class Exp_Main(Exp_Basic):", "class Exp_Main(LogMixin, Exp_Basic):"),
                                            ("import os\n", "import os\nfrom utils.mixins import LogMixin\n")]})
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done["exp/exp_basic.py"].text
    assert not done["exp/exp_main.py"].left, done["exp/exp_main.py"].left
    middle = "from exp.exp_basic import Exp_Basic\n\n\nclass Exp_Forecast(Exp_Basic):\n    pass\n"
    done = _forecast(**{"exp/exp_forecast.py": [("", middle)],
                        "exp/exp_main.py": [("class Exp_Main(Exp_Basic):", "class Exp_Main(Exp_Forecast):"),
                                            ("import os\n", "import os\nfrom exp.exp_forecast import Exp_Forecast\n")]})
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done["exp/exp_basic.py"].text
    assert not done["exp/exp_main.py"].left, done["exp/exp_main.py"].left


DUMP_OR_RESUME = '''import argparse
import torch
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--resume", default="")
p.add_argument("--save_data", type=int, default=0)
args = p.parse_args()
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, shuffle=True)
if args.save_data and not args.resume:
    torch.save(data.tensors, "data.pt")
model = torch.nn.Linear(4, 1)
if args.resume:
    model.load_state_dict(torch.load(args.resume))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
'''


def test_a_save_and_a_load_under_tests_that_exclude_each_other_owe_no_barrier():
    """loss-landscape's dump (``if args.save_data and not args.resume:``) and its resume (``if args.resume:``):
    listed as a read that may come before rank 0's write, though no run does both (four held-out scripts had such
    false lines). The sides of one if / else too; tests that may both hold still list it."""
    assert not plan(DUMP_OR_RESUME).left, plan(DUMP_OR_RESUME).left
    both = DUMP_OR_RESUME.replace("if args.save_data and not args.resume:", "if args.save_data:")
    assert any("a file is read at line" in i.what for i in plan(both).left)
    dump = "if args.save_data and not args.resume:\n    torch.save(data.tensors, \"data.pt\")\n"
    sides = DUMP_OR_RESUME.replace(dump, "").replace("    model.load_state_dict(torch.load(args.resume))\n",
                                               "    model.load_state_dict(torch.load(args.resume))\n"
                                               "else:\n    torch.save(model.state_dict(), 'init.pt')\n")
    assert not plan(sides).left, plan(sides).left


HELPERS = '''import torch
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset
import optim_wrap


def build_model(device):
    net = torch.nn.Linear(4, 3)
    net = net.to(device)
    if device == "cuda":
        net = torch.nn.DataParallel(net)
    return net


def create_optimizer(lr, model_params):
    return optim.Adam(model_params, lr)


def get_instance(module, name, config, *args):
    return getattr(module, config[name]["type"])(*args, **config[name]["args"])


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), batch_size=16, shuffle=True)
    net = build_model(device)
    optimizer = create_optimizer(1e-2, net.parameters())
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        optimizer.step()


main()
'''


@pytest.mark.parametrize("made, model", [
    ("optimizer = create_optimizer(1e-2, net.parameters())", "net = ddpkit.prepare_model(build_model(device))"),
    ("optimizer = optim_wrap.Optim(net.parameters(), 'adam', 1e-2, 10.0)",
     "net = ddpkit.prepare_model(build_model(device))"),
    ("optimizer = get_instance(torch.optim, 'optimizer', {'optimizer': {'type': 'SGD', 'args': {'lr': 0.1}}}, "
     "filter(lambda p: p.requires_grad, net.parameters()))", "net = ddpkit.prepare_model(build_model(device))"),
])
def test_an_optimizer_made_by_a_helper_trains_the_model_it_is_handed(made, model):
    """AdaBound's ``create_optimizer(args, net.parameters())`` (its ``optim.Adam(model_params, ...)`` trains a
    parameter), LSTNet's ``Optim(model.parameters(), ...)`` stepped with ``model.zero_grad()``, pytorch-segmentation's
    ``get_instance(torch.optim, 'optimizer', config, params)``: the loader was sharded, the DataParallel line
    deleted, and no model prepared, with exit 0 (the run stopped at its first step)."""
    text = HELPERS.replace("optimizer = create_optimizer(1e-2, net.parameters())", made)
    if "optim_wrap" in made:
        text = text.replace("        optimizer.zero_grad()\n", "        net.zero_grad()\n")
    done = plan(text)
    assert model in done.text and not done.left, (done.left, done.text)


def test_a_sharded_training_loader_with_no_model_found_is_listed():
    """An optimizer convert cannot follow (an object of another module, handed the model itself): before, the loader
    was sharded and no model prepared, exit 0, unsaid; now listed at the backward's line (the converted script
    stops at its first step, with its own line)."""
    text = HELPERS.replace("optimizer = create_optimizer(1e-2, net.parameters())", "optimizer = optim_wrap.make(net)")
    done = plan(text)
    assert [i.what[:46] for i in done.left] == ["the training loader is sharded (each rank its "], done.left
    assert not done.left[0].blocks


BATCH_MEANS = '''import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train_set = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
loader = DataLoader(train_set, batch_size=16, shuffle=True)
net = torch.nn.Linear(4, 3)
opt = torch.optim.Adam(net.parameters(), lr=0.0)
crit = torch.nn.CrossEntropyLoss()
for e in range(2):
    train_loss = 0
    for x, y in loader:
        opt.zero_grad()
        loss = crit(net(x), y)
        loss.backward()
        opt.step()
        train_loss += loss.item()
    train_loss = train_loss / len(train_set)
    print(f"train_loss {train_loss:.6f}")
'''


def test_a_sum_of_batch_means_over_the_samples_is_averaged_across_ranks(tmp_path):
    """Deep-Emotion's epoch loss, ``train_loss += loss.item()`` then ``/ len(train_set)``: summed across ranks it
    printed 2x the one-process value at 2 processes (each rank takes as many steps, of half the batch). Averaged
    now; the weights never move (lr 0), so both runs print the same number."""
    done = plan(BATCH_MEANS)
    assert "train_loss = ddpkit.reduce(train_loss, op='mean')" in done.text, done.text
    one = run_cmd([sys.executable, "-c", BATCH_MEANS], timeout=60)
    script = tmp_path / "means.py"
    script.write_text(done.text)
    two = launch(script, nproc=2, timeout=120)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.split() == one.stdout.split(), (one.stdout, two.stdout)
    by_batches = BATCH_MEANS.replace("/ len(train_set)", "/ len(loader)")  # a mean of batch means: averaged too
    assert "train_loss = ddpkit.reduce(train_loss, op='mean')" in plan(by_batches).text  # (fourteenth set)


DICT_OF_LOSSES = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def train(model, loader, opt):
    losses = {"mse": 0.0}
    for x, _ in loader:
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses["mse"] += loss.item()
    return losses


model = torch.nn.Linear(4, 4)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
train_loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.zeros(64)), batch_size=16, shuffle=True)
for epoch in range(2):
    train_losses = train(model, train_loader, opt)
    for k in train_losses.keys():
        print(epoch, k, train_losses[k])
'''


def test_a_loop_over_what_a_training_function_returns_is_no_loop_over_its_loader():
    """VQ-VAE's ``train_losses = train(model, train_loader, opt)``, then ``for k in train_losses.keys()``: the dict
    loop was taken for a loop over the loader (the call "passes its items on"), and the loader refused as one whose
    role cannot be told."""
    done = plan(DICT_OF_LOSSES)
    assert "train_loader = ddpkit.data_loader(" in done.text and not done.left, done.left


def test_an_animation_or_image_written_by_imageio_is_rank_0s():
    """wgan-gp's training GIF, ``imageio.mimsave(path, frames)``: written by every rank, unsaid."""
    text = DICT_OF_LOSSES.replace("import torch\n", "import imageio\nimport torch\n", 1) + \
        "imageio.mimsave('training.gif', [])\n"
    done = plan(text)
    assert "if ddpkit.init().is_main:\n    imageio.mimsave('training.gif', [])" in done.text, done.text


FACTORY_OBJECT = {
    "data_factory.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Toy:
    def __init__(self, batch_size):
        g = torch.Generator().manual_seed(0)
        self.trainloader = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,),
                                      generator=g)), batch_size=batch_size, shuffle=True)
        self.testloader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,))),
                                     batch_size=batch_size)
        self.num_classes = 3


def create(batch_size):
    return Toy(batch_size)
''',
    "main.py": '''import torch
import data_factory


def train(model, loader, opt):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


dataset = data_factory.create(batch_size=16)
trainloader, testloader = dataset.trainloader, dataset.testloader
model = torch.nn.Linear(4, dataset.num_classes)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train(model, trainloader, opt)
'''}


def test_loaders_kept_by_an_object_a_factory_function_returns_convert_where_they_are_built():
    """center-loss's ``dataset = datasets.create(...)``, ``trainloader = dataset.trainloader`` handed to
    ``train(...)``: refused as batches fed by hand (only a class's own call was followed, and only the loop's
    name)."""
    done = settle(list(FACTORY_OBJECT), lambda rel, crossing: plan(FACTORY_OBJECT[rel], crossing=crossing))
    assert "self.trainloader = ddpkit.data_loader(" in done["data_factory.py"].text
    assert "self.testloader = DataLoader(" in done["data_factory.py"].text
    assert not done["main.py"].left, done["main.py"].left


HOLDER = {
    "analyzer.py": '''import torch
from tqdm import tqdm


class Analyzer:
    def __init__(self):
        self.model = torch.nn.Linear(4, 1)
        self.device = torch.device("cpu")
        self.model = self.model.to(self.device)

    def train(self, train_loader, optimizer, criterion):
        for x, y in tqdm(iterable=train_loader, desc="Training"):
            optimizer.zero_grad()
            loss = criterion(self.model(x.to(self.device)), y.to(self.device))
            loss.backward()
            optimizer.step()
        return loss.item()
''',
    "train.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset
from analyzer import Analyzer

torch.manual_seed(0)
analyzer = Analyzer()
optimizer = torch.optim.Adam(params=analyzer.model.parameters(), lr=1e-2)
train_loader = DataLoader(dataset=TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16)
for epoch in range(2):
    print(epoch, analyzer.train(train_loader=train_loader, optimizer=optimizer, criterion=torch.nn.MSELoss()))
'''}


def test_a_model_a_plain_object_holds_is_wrapped_where_its_class_builds_it(tmp_path):
    """SentimentAnalysis's ``analyzer = Analyzer()`` (no Module) and ``Adam(params=analyzer.model.parameters())``:
    ``analyzer = ddpkit.prepare_model(Analyzer())`` was written (it fails: not a Module), and the loop over
    ``tqdm(iterable=train_loader)`` in analyzer.py refused as fed by hand. Now the class's ``self.model`` is
    wrapped, the loader is the training one, and verify PASSes at 2 processes."""
    for name, text in HOLDER.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "out"
    r = run_cmd([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", str(out), str(tmp_path / "train.py")],
                timeout=60)
    assert r.returncode == 0 and "left to you" not in r.stderr, r.stderr
    assert "self.model = ddpkit.prepare_model(self.model)" in (out / "analyzer.py").read_text()
    assert "prepare_model(Analyzer())" not in (out / "train.py").read_text()
    v = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "3", str(out / "train.py")],
                timeout=300, cwd=str(out))
    assert v.returncode == 0 and v.stdout.startswith("PASS"), v.stdout + v.stderr[-1500:]
    local = HOLDER["analyzer.py"] + HOLDER["train.py"].replace("from analyzer import Analyzer\n", "")
    assert "self.model = ddpkit.prepare_model(self.model)" in plan(local).text  # one file: the same


TAGGER = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from model import Tagger

embeddings = torch.FloatTensor(10, 4)
nn.init.uniform_(embeddings, -0.5, 0.5)
words = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(0))
loader = DataLoader(TensorDataset(words, words % 3), batch_size=8, shuffle=True)
model = Tagger()
model.init_word_embeddings(embeddings)
params = []
for key, value in dict(model.named_parameters()).items():
    if value.requires_grad:
        params += [{"params": [value]}]
optimizer = torch.optim.SGD(params, lr=0.1)
for w, t in loader:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(w), t).backward()
    optimizer.step()
'''


def test_a_models_own_init_method_and_parameter_groups_grown_with_plus_equals():
    """The sequence-labelling tutorial's ``model.init_word_embeddings(embeddings)`` (a method of another module whose
    unknown words' rows are random): wrapped above it, the ranks started different. The triplet network's groups,
    ``params += [{'params': [value]}]`` over ``model.named_parameters()``: no model was found, none prepared."""
    done = plan(TAGGER)
    assert "model.init_word_embeddings(embeddings)\nmodel = ddpkit.prepare_model(model)\n" in done.text, done.text
    assert not done.left, done.left


def test_a_model_handed_to_another_modules_checkpoint_helper_is_saved_unwrapped():
    """``save_checkpoint(epoch, model, optimizer)`` of utils.py, ``state = {'model': model, ...}; torch.save(state,
    f)``: the model another module prepares and passes was pickled as the DDP wrapper (its inference script then
    failed: no process group). Unwrapped there now (``ddpkit.unwrap`` hands anything else back as it is)."""
    utils = "import torch\n\n\ndef save_checkpoint(epoch, model, optimizer):\n    state = {'epoch': epoch, " \
        "'model': model, 'optimizer': optimizer}\n    torch.save(state, 'ckpt.pth.tar')\n"
    assert "'model': ddpkit.unwrap(model), 'optimizer': optimizer}" in plan(utils).text
    other = utils.replace("model", "config")
    assert "unwrap" not in plan(other).text


SAME_NAME = {
    "loaders.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset


def get_loader(batch_size):
    train_set = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    test_set = TensorDataset(torch.randn(10, 4), torch.arange(10) % 2)
    train_data_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    test_data_loader = DataLoader(test_set, batch_size=batch_size, shuffle=True)
    return train_data_loader, test_data_loader
''',
    "train.py": '''import torch
from loaders import get_loader


def train(data, model, optimizer):
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test(data, model):
    seen = 0
    with torch.no_grad():
        for x, y in data:
            seen += x.size(0)
    print("test samples", seen)


model = torch.nn.Linear(4, 2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
train_data_loader, test_data_loader = get_loader(4)
test(test_data_loader, model)
train(train_data_loader, model, optimizer)
'''}


def test_two_loops_over_one_parameter_name_keep_each_loaders_own_role():
    """The triplet network's ``train(data, ...)`` and ``test(data, ...)``: both loops read a parameter named
    ``data``, so the test loader, asked under that name, was made a training loader too (its test metrics then
    rank 0's half, padded and reshuffled)."""
    done = settle(list(SAME_NAME), lambda rel, crossing: plan(SAME_NAME[rel], crossing=crossing))
    text = done["loaders.py"].text
    assert "train_data_loader = ddpkit.data_loader(train_set" in text, text
    assert "test_data_loader = DataLoader(test_set" in text, text
    assert not done["train.py"].left, done["train.py"].left


def test_second_review_tests_a_save_may_change_and_branches_run_twice_still_owe_a_barrier():
    """``if not os.path.exists(p): torch.save(...)`` then ``if os.path.exists(p): torch.load(p)``: the save itself
    changes the test (rank 1 read before rank 0 wrote); an if / else in a function run twice, or in a loop, runs
    both sides in one run. All were taken for tests that cannot both hold."""
    exists = DUMP_OR_RESUME.replace("if args.save_data and not args.resume:", "if not os.path.exists('data.pt'):")
    exists = exists.replace("if args.resume:\n    model.load_state_dict(torch.load(args.resume))",
                            "if os.path.exists('data.pt'):\n    data = torch.load('data.pt')").replace(
        "import argparse\n", "import argparse\nimport os\n")
    assert any("a file is read at line" in i.what for i in plan(exists).left), plan(exists).left
    twice = ("import torch\n\n\ndef run(phase, m):\n    if phase == 'pretrain':\n        torch.save(m.state_dict(), "
             "'b.pt')\n    else:\n        m.load_state_dict(torch.load('b.pt'))\n\n\nm = torch.nn.Linear(2, 2)\n"
             "run('pretrain', m)\nrun('finetune', m)\n")
    assert any("a file is read at line" in i.what for i in plan(twice).left), plan(twice).left


def test_second_review_a_summed_loss_stays_summed_and_a_rebuilt_holder_model_is_refused():
    """A VAE's ``reduction='sum'`` loss (or one of the script's own) summed over the epoch: averaged across ranks it
    was half one process's. A holder whose ``warm_start()`` builds its model anew: only the first build was wrapped,
    and the trained one never averaged."""
    summed = BATCH_MEANS.replace("crit = torch.nn.CrossEntropyLoss()",
                                 "crit = torch.nn.CrossEntropyLoss(reduction='sum')")
    assert "train_loss = ddpkit.reduce(train_loss)\n" in plan(summed).text
    own = BATCH_MEANS.replace("crit = torch.nn.CrossEntropyLoss()", "crit = my_loss")
    assert "op='mean'" not in plan(own).text
    local = HOLDER["analyzer.py"] + HOLDER["train.py"].replace("from analyzer import Analyzer\n", "")
    warm = local.replace("    def train(self, train_loader", "    def warm_start(self):\n        self.model = "
                         "torch.nn.Linear(4, 1)\n\n    def train(self, train_loader").replace(
        "analyzer = Analyzer()\n", "analyzer = Analyzer()\nanalyzer.warm_start()\n")
    done = plan(warm)
    assert any("and again in Analyzer.warm_start()" in i.what and i.blocks for i in done.left), done.left


def test_second_review_a_helper_returning_the_loaders_iterator_passes_its_items_and_an_ema_step_is_no_optimizer():
    """``def batches(dl): return iter(dl)`` then ``for x, y in batches(loader)``: refused after the first review's
    fix (a call of an own function was no longer followed). ``ema.step(student.parameters())``: an EMA class stepped
    with parameters was taken for an optimizer of its teacher."""
    text = DICT_OF_LOSSES.replace("    for x, _ in loader:", "    for x, _ in batches(loader):").replace(
        "def train(", "def batches(dl):\n    return iter(dl)\n\n\ndef train(")
    done = plan(text)
    assert "train_loader = ddpkit.data_loader(" in done.text and not done.left, done.left
    ema = HELPERS.replace("    for x, y in loader:",
                          "    ema = EMA(teacher.parameters())\n    for x, y in loader:").replace(
        "        optimizer.step()\n", "        optimizer.step()\n        ema.step(net.parameters())\n").replace(
        "    net = build_model(device)\n", "    net = build_model(device)\n    teacher = build_model(device)\n")
    assert "teacher = ddpkit.prepare_model" not in plan(ema).text
