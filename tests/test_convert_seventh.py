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


# the second review of the sixth set's fixes: each converted wrong (a crash, a number N times off) or said falsely
RNN = HEAD + """
train_loader = DataLoader(dataset, batch_size=8, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    {above}
    total = 0.0
    for i, (x, y) in enumerate(train_loader):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += loss.item()
    {below}
"""


@pytest.mark.parametrize("above, below, kept", [
    # sized for this rank's batch above the batch loop (an RNN's hidden state, a GAN's labels): this rank's share
    ("hidden = torch.zeros(train_loader.batch_size, 8)", "print(total)", "torch.zeros(train_loader.batch_size, 8)"),
    # a count of batches, rounded up: no dataset size, the sum stays this rank's mean
    ("pass", "print(total / ((len(train_loader.dataset) + 7) // 8))", "print(total / ((len(train_loader.dataset)"),
    # another loader's dataset beside a training mean: not this sum's size
    ("pass", "print(total / len(train_loader), len(val_loader.dataset))", "print(total / len(train_loader), len("),
    # both counts of this rank's in one line: kept alike
    ("pass", "print(f'[{(i + 1) * train_loader.batch_size}/{len(train_loader) * train_loader.batch_size}]')",
     "{(i + 1) * train_loader.batch_size}"),
])
def test_review_what_is_this_ranks_stays_this_ranks(above, below, kept):
    result = plan(RNN.format(above=above, below=below))
    assert kept in result.text and "ddpkit.reduce(total)" not in result.text, result.text


def test_review_a_global_batch_read_in_an_f_string_whose_quotes_differ_is_rewritten_and_a_helpers_loader_too():
    source = RNN.format(above="pass", below="print(f\"{i * train_loader.batch_size}\")").replace(
        "train_loader = DataLoader(dataset, batch_size=8, shuffle=True)",
        "config = {'bs': 8}\n\n\ndef make_loader():\n    return DataLoader(dataset, batch_size=config['bs'], "
        "shuffle=True)\n\n\ntrain_loader = make_loader()")
    result = plan(source)
    assert "print(f\"{i * config['bs']}\")" in result.text and not result.left, (result.left, result.text)


def test_review_a_teacher_run_in_a_loss_helper_is_prepared_frozen_and_a_parameter_count_does_not_stop_it():
    source = HEAD + """
def make():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))


def distill(student, teacher, x):
    with torch.no_grad():
        t = teacher(x)
    return ((student(x) - t) ** 2).mean()


loader = DataLoader(dataset, batch_size=16, shuffle=True)
student, teacher = make(), make()
teacher.load_state_dict(student.state_dict())
print(sum(p.numel() for p in teacher.parameters()))
opt = torch.optim.SGD(student.parameters(), lr=0.1)
for x, _ in loader:
    loss = distill(student, teacher, x)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
    result = plan(source.replace("student, teacher = make(), make()", "student = make()\nteacher = make()"))
    assert "teacher = ddpkit.prepare_model(make().requires_grad_(False))" in result.text, result.text


def test_review_an_argmax_over_a_column_of_the_batch_is_the_whole_batchs():
    source = HEAD + "import numpy as np\nloader = DataLoader(dataset, batch_size=16, shuffle=True)\n" \
        "test_loader = DataLoader(dataset, batch_size=4)\nmodel = nn.Linear(8, 2)\n" \
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n    opt.zero_grad()\n" \
        "    nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\nright = 0\n" \
        "with torch.no_grad():\n    for x, y in test_loader:\n        right += int(model(x)[:, 1].argmax() == 0)\n" \
        "print(right)\n"
    assert "test_loader = DataLoader(dataset, batch_size=4)" in plan(source).text


@pytest.mark.parametrize("build", [
    "import bitsandbytes as bnb\nopt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)",
    "from timm.optim import create_optimizer_v2\nopt = create_optimizer_v2(model, 'adamw', lr=1e-3)",
    "import torch.optim as optim\nopt = getattr(optim, 'Adam')(model.parameters(), lr=1e-3)",
])
def test_optimizers_of_other_packages_or_picked_by_name_prepare_their_model(build):
    source = HEAD + f"loader = DataLoader(dataset, batch_size=16, shuffle=True)\nmodel = nn.Linear(8, 2)\n{build}\n" \
        "for x, y in loader:\n    opt.zero_grad()\n    nn.functional.cross_entropy(model(x), y).backward()\n" \
        "    opt.step()\n"
    assert "model = ddpkit.prepare_model(nn.Linear(8, 2))" in plan(source).text


def test_a_loss_over_the_whole_batch_is_listed_and_a_logged_dice_score_is_not():
    source = HEAD + "def dice_bce(p, t):\n    p, t = p.sigmoid().view(-1), t.view(-1).float()\n" \
        "    return 1 - 2 * (p * t).sum() / (p.sum() + t.sum())\n\n\n" \
        "def dice_score(p, t):\n    return dice_bce(p, t)\n\n\n" \
        "loader = DataLoader(dataset, batch_size=16, shuffle=True)\nmodel = nn.Linear(8, 1)\n" \
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n" \
        "    loss = {loss}(model(x).squeeze(1), y)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    said = plan(source.format(loss="dice_bce")).left
    assert any("a loss over the whole batch at once" in left.what for left in said), said
    assert not plan(source.format(loss="nn.functional.mse_loss") + "    print(dice_score(model(x), y))\n").left


def test_a_log_file_opened_once_and_written_every_epoch_is_rank_0s_and_a_with_block_is_still_guarded():
    """Listed before; now the other ranks open os.devnull (RAdam's Logger, fifteenth set), the writes unchanged."""
    source = HEAD + "log = open('log.txt', 'w')\nloader = DataLoader(dataset, batch_size=16, shuffle=True)\n" \
        "model = nn.Linear(8, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n" \
        "    opt.zero_grad()\n    nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n" \
        "    log.write('step\\n')\nwith open('done.txt', 'w') as f:\n    f.write('ok')\n"
    result = plan(source)
    assert not result.left and "open('log.txt' if ddpkit.init().is_main else os.devnull, 'w')" in result.text, \
        (result.left, result.text)
    assert "is_main:\n    with open('done.txt', 'w') as f:" in result.text, result.text


def test_a_script_alone_whose_optimizer_comes_from_a_module_beside_it_is_listed(tmp_path, capsys):
    from ddpkit.commands.convert.command import main

    (tmp_path / "util.py").write_text("import torch.optim as optim\n\n\ndef set_optimizer(model):\n"
                                      "    return optim.SGD(model.parameters(), lr=0.1)\n")
    script = tmp_path / "main.py"
    script.write_text(HEAD + "from util import set_optimizer\nloader = DataLoader(dataset, batch_size=16, "
                      "shuffle=True)\nmodel = nn.Linear(8, 2)\noptimizer = set_optimizer(model)\nfor x, y in loader:\n"
                      "    optimizer.zero_grad()\n    nn.functional.cross_entropy(model(x), y).backward()\n"
                      "    optimizer.step()\n")
    assert main(["-o", str(tmp_path / "out.py"), str(script)]) == 1
    assert "util.py:5 (imported from the script's folder) builds an optimizer (SGD)" in capsys.readouterr().err


def test_an_optimizer_of_a_package_convert_does_not_know_is_told_by_its_steps():
    """``Lion(model.parameters())`` (lion_pytorch) and davda54's ``SAM(model.parameters(), SGD, ...)`` stepped
    through ``first_step`` / ``second_step``: no model was prepared (the runtime stopped at step 1). A call that
    is not stepped (an EMA over the parameters) prepares nothing."""
    loop = "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y)\n{}"
    lion = HEAD + "from lion_pytorch import Lion\nloader = DataLoader(dataset, batch_size=8, shuffle=True)\n" \
        "model = nn.Linear(8, 2)\nopt = Lion(model.parameters(), lr=1e-4)\n" + \
        loop.format("    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    sam = HEAD + "from sam import SAM\nloader = DataLoader(dataset, batch_size=8, shuffle=True)\n" \
        "model = nn.Linear(8, 2)\nopt = SAM(model.parameters(), torch.optim.SGD, lr=0.1)\n" + \
        loop.format("    loss.backward()\n    opt.first_step(zero_grad=True)\n"
                    "    nn.functional.cross_entropy(model(x), y).backward()\n    opt.second_step(zero_grad=True)\n")
    for source in (lion, sam):
        result = plan(source)
        assert "model = ddpkit.prepare_model(nn.Linear(8, 2))" in result.text, result.text
    ema = HEAD + "from ema import EMA\nmodel = nn.Linear(8, 2)\nema = EMA(model.parameters(), 0.99)\nema.update()\n"
    assert "prepare_model" not in plan(ema).text
