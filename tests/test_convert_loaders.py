"""Training loaders in the shapes the third held-out set showed (issue 44), read as "batches fed by hand" before:
a DataLoader subclass of the script's own (refused now with its true cause and a fix that converts), and torch's
names through ``from torch.utils.data import *`` (converted). In process, on small scripts."""
import textwrap

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
LOADER = "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)\n"
STEPS = "for x, y in loader:\n    opt.zero_grad()\n    nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n"


def training(build, optimizer="torch.optim.SGD(model.parameters(), lr=0.1)"):
    """A script: the imports, a training loader, ``build`` (which binds ``model``), its optimizer, the loop."""
    return HEAD + LOADER + build + f"opt = {optimizer}\n" + STEPS

SUBCLASS = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class BaseLoader(DataLoader):
    def __init__(self, ds, batch_size, shuffle=True):
        super().__init__(ds, batch_size=batch_size, shuffle=shuffle)


class MnistLoader(BaseLoader):
    pass


ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = MnistLoader(ds, 8)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_a_dataloader_subclass_is_refused_for_what_it_is_with_a_fix_that_converts():
    result = plan(textwrap.dedent(SUBCLASS))
    assert result.refused, result.text
    said = [x for x in result.left if x.blocks]
    assert len(said) == 1 and "loader = MnistLoader(...), a subclass of DataLoader" in said[0].what, said
    assert "fed by hand" not in said[0].what and said[0].line == 17, said
    assert "ddpkit.data_loader(dataset, global_batch_size=B" in said[0].fix
    fixed = plan(textwrap.dedent(SUBCLASS).replace("loader = MnistLoader(ds, 8)",
                                                   "loader = ddpkit.data_loader(ds, global_batch_size=8)")
                 .replace("import torch\n", "import torch\nimport ddpkit\n", 1))
    assert not fixed.refused and "model = ddpkit.prepare_model(nn.Linear(4, 1))" in fixed.text, fixed.left


@pytest.mark.parametrize("imports", ["from torch.utils.data import *\nfrom torch.optim import *\n",
                                     "from torch.utils.data import *\nfrom torch.optim import SGD\n"])
def test_torch_names_through_a_star_import_convert(imports):
    source = ("import torch\nfrom torch import nn\n" + imports +
              "ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
              "loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = nn.Linear(4, 1)\n"
              "opt = SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n    opt.zero_grad()\n"
              "    nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n")
    result = plan(source)
    assert not result.refused and not result.left, result.left
    assert "loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in result.text, result.text
    assert "model = ddpkit.prepare_model(nn.Linear(4, 1))" in result.text, result.text


CHECK = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
train_loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), batch_size=8, shuffle=True)
test_loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,))), batch_size=8)
model = nn.Linear(4, 3).to(device)
opt = torch.optim.Adam(model.parameters())
for x, y in train_loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def check_accuracy(loader, model):
    num_correct = 0
    num_samples = 0
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            num_correct += (model(x).argmax(1) == y).sum()
            num_samples += x.size(0)
    print(float(num_correct) / float(num_samples))


check_accuracy(train_loader, model)
check_accuracy(test_loader, model)
"""


def test_a_training_loader_also_evaluated_trains_and_a_shared_evaluation_is_reduced_once():
    """The fourth held-out set's tutorial shape: ``check_accuracy(train_loader)`` and ``check_accuracy(test_loader)``
    after training was refused ("a DataLoader whose role cannot be told"); and an evaluation loop reached through
    two loaders (this function, or a test loader bound in both branches of an ``if``) got its ``ddpkit.reduce``
    once per loader: the reported sums N times too large at N processes, with no word."""
    result = plan(textwrap.dedent(CHECK))
    assert not result.refused and not result.left, result.left
    assert "train_loader = ddpkit.data_loader(TensorDataset(" in result.text, result.text
    assert result.text.count("num_correct = ddpkit.reduce(num_correct)") == 1, result.text
    assert result.text.count("num_samples = ddpkit.reduce(num_samples)") == 1, result.text
    branches = textwrap.dedent(CHECK).replace(
        "test_loader = DataLoader(", "if len(sys.argv) > 1:\n    test_loader = DataLoader(TensorDataset(torch.randn("
        "40, 4), torch.randint(0, 3, (40,))), batch_size=20)\nelse:\n    test_loader = DataLoader(", 1).replace(
        "import torch\n", "import sys\nimport torch\n", 1)
    result = plan(branches)
    assert result.text.count("num_correct = ddpkit.reduce(num_correct)") == 1, result.text


def test_a_training_loader_whose_evaluation_keeps_a_list_is_refused_with_the_fix():
    """Sharded to train, its evaluation would hold rank 0's shard only: refused, not converted silently wrong."""
    source = textwrap.dedent(CHECK).replace("            num_samples += x.size(0)\n",
                                            "            num_samples += x.size(0)\n            preds.append(x)\n")
    result = plan(source.replace("    num_samples = 0\n", "    num_samples = 0\n    preds = []\n"))
    assert result.refused, result.text
    said = [x for x in result.left if x.blocks]
    assert said and "the evaluation loop over the training DataLoader at line 7 keeps per-batch results" in \
        said[0].what and "a DataLoader of its own (DataLoader(dataset, batch_size)" in said[0].fix, said


@pytest.mark.parametrize("setup", [
    "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n",
    "if torch.cuda.is_available():\n    device = 'cuda'\nelse:\n    device = 'cpu'\n",
])
def test_a_device_given_as_a_string_stays_a_string_that_runs_its_tests(setup):
    """kentaroy47's ``if 'cuda' in device:`` (and makemore's ``device.startswith('cuda')``) raised TypeError on
    every rank once ``device`` became a torch.device; it is ``state.device.type`` now, a string as before."""
    source = ("import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n" + setup +
              "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)\n"
              "model = nn.Linear(4, 1).to(device)\nif 'cuda' in device and device.startswith('cuda'):\n"
              "    print('on', device)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n"
              "    opt.zero_grad()\n    nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()\n"
              "    opt.step()\n")
    result = plan(source)
    assert "device = state.device.type" in result.text and not result.left, result.text
    namespace = {}
    exec(result.text.replace("import ddpkit\n", "").split("loader =")[0].replace(
        "state = ddpkit.init()", "import types\nstate = types.SimpleNamespace(device=torch.device('cpu'))"),
         namespace)
    assert namespace["device"] == "cpu" and "cuda" not in namespace["device"]


def test_a_model_chosen_in_a_chain_whose_else_raises_under_main_is_prepared_below_it():
    """makemore: ``if __name__ == "__main__":`` around everything, the model chosen by ``--type`` in an if / elif
    chain whose ``else`` raises: only the last branch was wrapped, and the line said the model was not bound on
    every path (the default type trained unprepared until the runtime stopped it)."""
    chain = ("if kind == 'mlp':\n    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))\n"
             "elif kind == 'linear':\n    model = nn.Linear(4, 1)\nelse:\n    raise ValueError(kind)\n")
    source = HEAD + "if __name__ == '__main__':\n" + textwrap.indent(
        training(chain, "torch.optim.AdamW(model.parameters())")[len(HEAD):], "    ")
    result = plan(source)
    assert not result.left and result.text.count("prepare_model") == 1, result.left
    assert "        raise ValueError(kind)\n    model = ddpkit.prepare_model(model)\n" in result.text, result.text


def test_a_progress_bar_or_a_setting_imported_from_elsewhere_is_no_loader():
    """going_modular's ``for epoch in tqdm(range(epochs))`` (``from tqdm.auto import tqdm``) and pytorch-cifar100's
    ``range(1, settings.EPOCH + 1)`` (``from conf import settings``) were listed as "loaders imported from modules
    of the script" (exit 1, for nothing to do)."""
    source = ("import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "from tqdm.auto import tqdm\nfrom conf import settings\n"
              "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=True)\n"
              "model = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for epoch in tqdm(range(1, settings.EPOCH + 1)):\n    for x, y in loader:\n        opt.zero_grad()\n"
              "        nn.functional.mse_loss(model(x), y).backward()\n        opt.step()\n")
    result = plan(source)
    assert not result.left and not result.asks, (result.left, result.asks)
    assert "loader = ddpkit.data_loader(" in result.text


def test_a_model_bound_in_a_try_and_its_handler_is_prepared_below_the_try():
    """``try: model = torch.load(p)`` / ``except FileNotFoundError: model = Net()``: the wrap went into the handler,
    leaving a loaded model unprepared (each rank its own copy, until the runtime stopped it at the first step)."""
    source = training("try:\n    model = torch.load('model.pt', weights_only=False)\nexcept FileNotFoundError:\n"
                      "    model = nn.Linear(4, 1)\n")
    result = plan(source)
    assert not result.left and result.text.count("prepare_model") == 1, result.left
    assert "    model = nn.Linear(4, 1)\nmodel = ddpkit.prepare_model(model)\n" in result.text, result.text
    assert any("below the try" in e.what for e in result.edits), result.edits


def test_a_loop_through_a_progress_bar_over_a_loader_a_function_returns_is_followed():
    """aladdin's U-Net: ``train_fn(loader, ...)`` loops over ``loop = tqdm(loader)``, its loader from
    ``get_loaders()`` of ``utils``: read as a loader imported from ``tqdm`` ("left to you"), or as one handed in
    by another module. It is the training loader ``utils`` builds: asked of it."""
    source = ("import torch\nfrom tqdm import tqdm\nfrom utils import get_loaders\n\n\n"
              "def train_fn(loader, model, opt):\n    loop = tqdm(loader)\n    for x, y in loop:\n"
              "        opt.zero_grad()\n        (model(x) - y).pow(2).mean().backward()\n        opt.step()\n\n\n"
              "def main():\n    model = torch.nn.Linear(2, 1)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "    train_loader, val_loader = get_loaders(8)\n    train_fn(train_loader, model, opt)\n")
    result = plan(source)
    # (the ask names what the call passes too, ``@[["#0", null]]``: a value, not a literal; review 29)
    assert [(a.module, a.name.split("@")[0]) for a in result.asks] == [("utils", "get_loaders()[0]")], result.asks
    assert not any("tqdm" in x.what for x in result.left), result.left


def test_a_dataparallel_around_a_submodule_goes_and_the_wrap_below_it_stays():
    """pytorch-vgg-cifar10's ``model.features = torch.nn.DataParallel(model.features)`` before ``if args.cpu:
    model.cpu() else: model.cuda()``: the wrap placed below the deleted line was deleted with it (refused: "said
    and lost")."""
    source = training("model = Net()\nmodel.features = torch.nn.DataParallel(model.features)\nif cpu:\n"
                      "    model.cpu()\nelse:\n    model.cuda()\n")
    result = plan(source)
    assert not result.refused and "DataParallel" not in result.text, result.left
    assert "model = Net()\nmodel = ddpkit.prepare_model(model)\nif cpu:" in result.text, result.text


def test_a_loader_helper_no_line_calls_is_kept_and_a_loop_over_a_constructor_parameter_is_listed():
    """Image_Segmentation's ``Solver(config, train_loader)`` looping over ``self.train_loader`` was refused as
    batches fed by hand; a ``utils.py`` helper that returns a DataLoader and that no line calls refused a whole
    project ("role cannot be told")."""
    helper = plan("from torch.utils.data import DataLoader\n\n\ndef get_loader(ds, bs):\n"
                  "    return DataLoader(ds, batch_size=bs, shuffle=True)\n")
    assert not helper.refused and not helper.left and helper.kept, helper.left
    solver = plan("import torch\n\n\nclass Solver:\n    def __init__(self, config, train_loader):\n"
                  "        self.train_loader = train_loader\n        self.model = torch.nn.Linear(2, 1)\n"
                  "        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)\n\n    def train(self):\n"
                  "        for x, y in self.train_loader:\n            self.opt.zero_grad()\n"
                  "            (self.model(x) - y).pow(2).mean().backward()\n            self.opt.step()\n")
    assert not solver.refused, solver.left
    assert any("a parameter of Solver.__init__" in x.what for x in solver.left), solver.left


def test_an_evaluation_handed_either_of_two_loaders_of_this_file_is_reduced_once():
    """efficient_densenet's ``test_epoch(model, loader=valid_loader if valid_loader else test_loader)``: two loaders
    built here, both sharded: one reduce, not a refusal of "an expression"."""
    source = textwrap.dedent(CHECK).replace(
        "check_accuracy(train_loader, model)\ncheck_accuracy(test_loader, model)\n",
        "valid_loader = DataLoader(TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,))), batch_size=8)\n"
        "check_accuracy(valid_loader if valid_loader else test_loader, model)\n")
    result = plan(source)
    assert not result.refused and result.text.count("num_correct = ddpkit.reduce(num_correct)") == 1, result.left


def test_the_second_reviews_shapes_are_refused_or_listed_not_converted_wrong():
    """The second review of this work: an evaluation shared with a loader left plain got one reduce (that one's
    accuracy N times too large); a loader factory called through a dict was "kept" (every rank trained on all of
    it); a model bound in a try whose body then breaks was prepared below the try (the break path skipped it); a
    guarded write block that returns or breaks left the other ranks without its value (or hung them)."""
    shared = textwrap.dedent(CHECK).replace("check_accuracy(train_loader, model)\n", "preds = []\nmodel.eval()\n"
                                            "with torch.no_grad():\n    for x, y in test_loader:\n"
                                            "        preds.append(model(x))\ncheck_accuracy(train_loader, model)\n")
    result = plan(shared)
    assert result.refused and any("a loader kept whole" in x.what for x in result.left), result.left
    factory = ("import torch\nfrom torch.utils.data import DataLoader\n\n\ndef make(bs):\n"
               "    return DataLoader(ds, batch_size=bs, shuffle=True)\n\n\nFACTORIES = {'train': make}\n"
               "loader = FACTORIES['train'](8)\nmodel = torch.nn.Linear(2, 1)\n"
               "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n    opt.zero_grad()\n"
               "    (model(x) - y).pow(2).mean().backward()\n    opt.step()\n")
    assert plan(factory).refused
    retry = ("import torch\nfrom torch import nn\nfor attempt in range(3):\n    try:\n"
             "        model = torch.load('m.pt', weights_only=False)\n        break\n    except FileNotFoundError:\n"
             "        model = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    assert not any("below the try" in e.what for e in plan(retry).edits)
    returning = ("import json\nimport torch\nstate = None\n\n\ndef make_config(out):\n"
                 "    with open(out, 'w') as f:\n        json.dump({'lr': 1}, f)\n        return {'lr': 1}\n")
    result = plan(returning)
    assert "is_main" not in result.text and any("does more than write" in x.what for x in result.left), result.text


def test_a_training_loader_rebound_unshuffled_for_predictions_is_kept_plain_there():
    """A forecaster's shape (fifth held-out set): train, then rebind ``train_loader`` to an unshuffled loader and
    collect its predictions with ``np.concatenate``. The first binding trains (sharded); the second only feeds
    a loop that keeps every batch's output, so it stays a plain loader (each rank predicts the whole set)."""
    script = training("model = nn.Linear(4, 1)\n") + (
        "import numpy as np\n"
        "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, shuffle=False)\n"
        "model.eval()\n"
        "preds = np.array([])\n"
        "for x, y in loader:\n"
        "    preds = np.concatenate((preds, model(x).detach().numpy().ravel()))\n")
    result = plan(script)
    lines = result.text.splitlines()
    first = next(line for line in lines if "shuffle=True" in line)
    assert first.startswith("loader = ddpkit.data_loader("), first
    rebound = next(line for line in lines if "shuffle=False" in line)
    assert rebound.startswith("loader = DataLoader("), rebound
    assert any("keeps per-batch results" in x.what for x in result.kept), result.kept
    assert not result.refused, result.left


EVAL_TAIL = ("model.eval()\ntotal = 0.0\nwith torch.no_grad():\n    for x, y in test_loader:\n"
             "        x = torch.cat([x, x.flip(1)])\n"
             "        total += nn.functional.mse_loss(model(x).view(2, -1, 1).mean(0), y).item() * len(y)\n"
             "print(total / len(test_loader.dataset))\n")


def test_a_batch_joined_with_its_own_mirror_is_no_kept_result():
    """Review: test-time augmentation (``x = torch.cat([x, x.flip(1)])``, the loop's own batch) read as "keeps
    per-batch results", which left the evaluation unsharded. Only a name bound before the loop keeps results."""
    script = training("model = nn.Linear(4, 1)\n") + \
        "test_loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)\n" + EVAL_TAIL
    result = plan(script)
    assert "test_loader = ddpkit.data_loader(" in result.text and "total = ddpkit.reduce(total)" in result.text
    assert not result.left, result.left


@pytest.mark.parametrize("rebind", [
    "loader = DataLoader(loader.dataset, batch_size=8, shuffle=False)\n",
    "loader = torch.utils.data.DataLoader(loader.dataset, batch_size=8)\n",
])
def test_a_loader_rebuilt_over_its_own_dataset_is_a_new_loader(rebind):
    """Review: ``DataLoader(train_loader.dataset, shuffle=False)`` reads the name it rebinds, so it was taken for
    the same loader (``loader = tqdm(loader)``), and the training loader refused for the predictions' loop."""
    script = training("model = nn.Linear(4, 1)\n") + rebind + (
        "import numpy as np\nmodel.eval()\npreds = np.array([])\nfor x, y in loader:\n"
        "    preds = np.concatenate((preds, model(x).detach().numpy().ravel()))\n")
    result = plan(script)
    assert not result.refused, result.left
    assert "loader = ddpkit.data_loader(TensorDataset(" in result.text and rebind.strip() in result.text


def test_a_loader_rebound_inside_the_epoch_loop_is_read_by_the_loop_above_it():
    """Review: a progressive batch size (``loader = DataLoader(ds, batch_size=16 * (stage + 1))`` at the end of
    each stage) was "kept: nothing reads loader" (read above its line, on the loop's next pass): from the
    second stage on, every rank trained on the whole set."""
    script = HEAD + "model = nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + LOADER + \
        "for stage in range(3):\n" + "".join("    " + line + "\n" for line in STEPS.splitlines()) + \
        "    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16 * (stage + 1))\n"
    result = plan(script)
    assert "    loader = ddpkit.data_loader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), " \
        "global_batch_size=16 * (stage + 1), shuffle=False)" in result.text, result.text
