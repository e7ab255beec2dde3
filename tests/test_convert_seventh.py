"""What the seventh held-out set (docs/convert.md) found ``ddpkit convert`` owes public scripts, each a case that
converted wrong before its fix: a model left unprepared with nothing said (weight-decay groups over
``self.model.named_parameters()``, an optimizer reached through a star import, a model unpacked from a tuple and
handed to another module's optimizer helper), a project's own ``train_test_split`` given a keyword it does not take,
and a false "batch size kept per process" for a loop that reads another field of the args object."""
import textwrap

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
"""

TRAINER = HEAD + """
class Trainer:
    def __init__(self, args):
        self.args = args
        self.model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))

    def train(self):
        loader = DataLoader(dataset, batch_size=self.args.train_batch_size, shuffle=True)
        no_decay = ["bias", "1.weight"]
        groups = [{"params": [p for n, p in self.model.named_parameters() if not any(d in n for d in no_decay)],
                   "weight_decay": 0.01},
                  {"params": [p for n, p in self.model.named_parameters() if any(d in n for d in no_decay)],
                   "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=0.01)
        for x, y in loader:
            loss = nn.functional.cross_entropy(self.model(x), y)
            if self.args.gradient_accumulation_steps > 1:
                loss = loss / self.args.gradient_accumulation_steps
            loss.backward()
            optimizer.step()
            self.model.zero_grad()
"""


def test_weight_decay_groups_of_a_trainers_own_model_prepare_it_and_other_args_are_no_batch_size():
    result = plan(TRAINER)
    assert "self.model = ddpkit.prepare_model(nn.Sequential(" in result.text, result.text
    assert "global_batch_size=self.args.train_batch_size" in result.text and not result.left, result.left


def project(files, entry):
    done = settle(list(files), lambda rel, crossing: plan(textwrap.dedent(files[rel]), crossing=crossing))
    return done[entry], done


def test_an_optimizer_reached_through_a_star_import_of_a_project_module_is_one():
    files = {"cfg.py": "import torch\nimport torch.optim as optim\nfrom torch import nn\n",
             "main.py": "from cfg import *\nfrom torch.utils.data import DataLoader\n" + HEAD.split("\n", 5)[-1] +
             "net = nn.Linear(8, 2)\nopt = optim.Adam(net.parameters())\n"
             "loader = DataLoader(dataset, batch_size=16, shuffle=True)\nfor x, y in loader:\n"
             "    opt.zero_grad()\n    nn.functional.cross_entropy(net(x), y).backward()\n    opt.step()\n"}
    main, _ = project(files, "main.py")
    assert "net = ddpkit.prepare_model(nn.Linear(8, 2))" in main.text, main.text


def test_a_model_unpacked_from_a_tuple_and_handed_to_another_modules_optimizer_helper_is_prepared():
    files = {"util.py": "import torch.optim as optim\n\n\ndef set_optimizer(opt, model):\n"
                        "    return optim.SGD(model.parameters(), lr=opt['lr'])\n",
             "main.py": HEAD + "from util import set_optimizer\n\n\ndef set_model():\n"
                        "    return nn.Linear(8, 2), nn.CrossEntropyLoss()\n\n\n"
                        "loader = DataLoader(dataset, batch_size=16, shuffle=True)\nmodel, criterion = set_model()\n"
                        "optimizer = set_optimizer({'lr': 0.1}, model)\nfor x, y in loader:\n"
                        "    optimizer.zero_grad()\n    criterion(model(x), y).backward()\n    optimizer.step()\n"}
    main, done = project(files, "main.py")
    assert "model = ddpkit.prepare_model(model)" in main.text, main.text
    assert not done["util.py"].left and not main.left, (done["util.py"].left, main.left)


def test_a_project_modules_own_train_test_split_is_not_given_random_state():
    result = plan(HEAD + "import series\nfrom sklearn.model_selection import train_test_split as tts\n"
                  "a, b = series.train_test_split(x, y, split=0.8)\nc, d = tts(x, y)\n")
    assert "series.train_test_split(x, y, split=0.8)\n" in result.text, result.text
    assert "tts(x, y, random_state=0)" in result.text, result.text
