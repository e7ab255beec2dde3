"""Review 38 (a reviewer who wrote none of it, on 7142e72..84b5778): each defect it showed, as a case in our own
words."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nfrom torch.utils.data import DataLoader\n"
LOADER = "loader = DataLoader(ds, batch_size=64, shuffle=True)\n"
STEP = "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"


def test_a_list_of_summed_step_losses_is_not_averaged_as_means():
    """D04: ``losses.append(loss.detach())`` of ``reduction="sum"``, then ``torch.stack(losses).mean()``: averaged
    across ranks and said right, while each value was a sum over B/N samples (the loss printed halved)."""
    src = HEAD + LOADER + ("model = nn.Linear(16, 16)\nopt = torch.optim.Adam(model.parameters())\nlosses = []\n"
                           "for (x,) in loader:\n    loss = F.mse_loss(model(x), x, reduction='sum')\n" + STEP +
                           "    losses.append(loss.detach())\nmean_loss = torch.stack(losses).mean()\n"
                           "print(mean_loss)\n")
    result = plan(src)
    assert "ddpkit.reduce(torch.stack" not in result.text, result.text
    assert any("holds losses summed" in k.what for k in result.kept), result.kept


TWO_CLASSES = '''class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.criterion = nn.CrossEntropyLoss({reduction})

    def forward(self, x):
        return self.fc(x)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.criterion = nn.CrossEntropyLoss()


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
running, seen = 0.0, 0
for x, y in loader:
    loss = model.criterion(model(x), y)
'''


def test_a_criterion_held_by_two_classes_is_read_from_the_models_own():
    """D03: ``model.criterion(...)`` read from "any one class" holding ``self.criterion``: the other class's mean
    taken for the model's ``reduction="sum"`` (the per-sample loss printed halved, the steps 1/N, nothing said)."""
    src = HEAD + LOADER + TWO_CLASSES.format(reduction="reduction='sum'") + STEP + (
        "    running += loss.item()\n    seen += y.size(0)\nprint(running / seen)\n")
    result = plan(src)
    assert any("a sum over the batch" in x.what for x in result.left), result.left
    assert "running = ddpkit.reduce(running)\n" in result.text, result.text
    mean = plan(src.replace("reduction='sum'", ""))
    assert "running = ddpkit.reduce(running, op='mean')" in mean.text and not mean.left, mean.left


def test_a_summed_criterion_in_a_step_helper_stepped_by_adam_is_said_as_a_sum():
    """D16: ``pred, loss = apply(model, criterion, x, y)`` with ``criterion = nn.NLLLoss(reduction="sum")`` and Adam:
    the printed loss was said "a mean over its 1/N" (its fix showed half the batch too)."""
    src = HEAD + LOADER + ("model = nn.Linear(8, 3)\nopt = torch.optim.Adam(model.parameters())\n"
                           "criterion = nn.NLLLoss(reduction='sum')\n\n\ndef apply(model, criterion, x, y):\n"
                           "    pred = F.log_softmax(model(x), dim=1)\n    return pred, criterion(pred, y)\n\n\n"
                           "for x, y in loader:\n    pred, loss = apply(model, criterion, x, y)\n" + STEP +
                           "    print(loss.item())\n")
    kept = [k.what for k in plan(src).kept if k.line == 21]
    assert kept and "a loss summed over the batch" in kept[0], kept


def test_a_per_sample_element_of_a_helpers_tuple_is_no_share_of_a_sum():
    """D08: ``return rec, rec.item() / x.size(0)``: the second element, a mean over the samples, printed; said "a
    loss summed over the batch ... 1/N", naming ``loss``."""
    src = HEAD + LOADER + ("model = nn.Linear(16, 16)\nopt = torch.optim.Adam(model.parameters())\n\n\n"
                           "def loss_func(out, x):\n    rec = F.mse_loss(out, x, reduction='sum')\n"
                           "    return rec, rec.item() / x.size(0)\n\n\nfor (x,) in loader:\n"
                           "    loss, per_sample = loss_func(model(x), x)\n" + STEP + "    print(per_sample)\n")
    assert not [k for k in plan(src).kept if "a loss summed over the batch" in k.what], plan(src).kept


def test_a_weight_of_a_stepped_loss_is_no_term_of_it():
    """D01: ``beta = min(1.0, step / 20)``, ``loss = rec + beta * kl``, ``beta`` printed: said "terms of the step's
    loss ... this rank's" (a schedule, the same on every rank)."""
    src = HEAD + LOADER + ("model = nn.Linear(16, 16)\nopt = torch.optim.Adam(model.parameters())\nstep = 0\n"
                           "for (x,) in loader:\n    rec = F.mse_loss(model(x), x)\n    kl = model(x).pow(2).mean()\n"
                           "    beta = min(1.0, step / 20)\n    loss = rec + beta * kl\n" + STEP +
                           "    step += 1\n    print(beta)\n")
    assert not [k for k in plan(src).kept if "terms of the step's loss" in k.what], plan(src).kept


@pytest.mark.parametrize("repro", ["d09_nested_factory", "d10_loader_in_tuple"])
def test_a_loader_function_called_through_another_or_for_its_length_is_no_unbound_use(repro):
    """D09 / D10: ``return build_loader(...)`` in a second function, ``len(make_loader(...))`` beside the bound call:
    refused as "iterated in place, unbound"; both converted right before."""
    factory = ("def build_loader(n, bs):\n    return DataLoader(TensorDataset(torch.randn(n, 8)), batch_size=bs, "
               "shuffle=True)\n\n\n")
    body = ("model = nn.Linear(8, 8)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for (x,) in train_loader:\n    loss = F.mse_loss(model(x), x)\n" + STEP)
    head = HEAD.replace("DataLoader\n", "DataLoader, TensorDataset\n") + factory
    if repro == "d09_nested_factory":
        src = head + "def get_train(bs):\n    return build_loader(512, bs)\n\n\ntrain_loader = get_train(32)\n" + body
    else:
        src = head + "train_loader = build_loader(512, 32)\nprint(len(build_loader(512, 32)))\n" + body
    result = plan(src)
    assert not result.refused and "ddpkit.data_loader(" in result.text, result.left


def test_a_loader_function_handed_on_for_an_evaluation_is_refused():
    """D02: ``evaluate(model, make_loader(128, 64))`` beside the bound training call of the same function: sharded
    with the training loader before; now refused, with a fix that works (a DataLoader line of its own)."""
    src = HEAD.replace("DataLoader\n", "DataLoader, TensorDataset\n") + (
        "def make(n, bs):\n    return DataLoader(TensorDataset(torch.randn(n, 8)), batch_size=bs, shuffle=True)\n\n\n"
        "def evaluate(model, loader):\n    total = 0.0\n    with torch.no_grad():\n        for (x,) in loader:\n"
        "            total += F.mse_loss(model(x), x, reduction='sum').item()\n    return total\n\n\n"
        "model = nn.Linear(8, 8)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain_loader = make(512, 32)\n"
        "for (x,) in train_loader:\n    loss = F.mse_loss(model(x), x)\n" + STEP +
        "print(evaluate(model, make(64, 8)))\n")
    result = plan(src)
    assert result.refused and "DataLoader line of its own" in result.left[0].fix, result.left


def test_a_training_method_of_the_model_no_line_calls_is_not_listed():
    """D17: a model class's ``fit_single_device(self, ...)`` calling ``self(x)``, never called (the script trains in
    its own loop): listed as a loop running outside DDP."""
    src = HEAD + LOADER + ("class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                           "        self.fc = nn.Linear(8, 2)\n\n    def forward(self, x):\n"
                           "        return self.fc(x)\n\n"
                           "    def fit_one(self, loader, opt):\n        for x, y in loader:\n"
                           "            opt.zero_grad()\n            F.cross_entropy(self(x), y).backward()\n"
                           "            opt.step()\n\n\nmodel = Net()\n"
                           "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                           "for x, y in loader:\n    loss = F.cross_entropy(model(x), y)\n" + STEP)
    assert not plan(src).left, plan(src).left
    called = src + "model.fit_one(loader, opt)\n"
    assert [x.what[:33] for x in plan(called).left] == ["the training loop of Net.fit_one "], plan(called).left
