"""Review 35: what a reviewer who wrote none of it found in the twenty-third set's fixes, each a case in our own
words (tests/test_convert_twentythird.py holds the fixes' own cases)."""
import pytest

from conftest import settled

pytest.importorskip("libcst")

from test_convert_twentythird import FACTORY, LOADERS, PICKED, PICKER, RUNNER, USE  # noqa: E402

from ddpkit.commands.convert.plan import plan  # noqa: E402

LOOP = '''import torch
from torch.utils.data import DataLoader
loader = DataLoader(ds, batch_size=16, shuffle=True)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total = 0.0
for i, (x,) in enumerate(loader):
    loss = torch.nn.functional.mse_loss(model(x), x{reduction})
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.item() / {size}
print(total / (i + 1))
'''


def test_a_summed_loss_over_the_batchs_size_is_a_per_sample_mean_still_averaged():
    p = plan(LOOP.format(reduction=', reduction="sum"', size="len(x)"))
    assert not any("the batch's own size" in x.what for x in p.left), p.left


def test_a_mean_over_the_batchs_size_with_the_batch_kept_per_process_is_still_averaged():
    p = plan(LOOP.format(reduction="", size="x.size(0)"), per_process_batch=True)
    assert "total = ddpkit.reduce(total, op='mean')" in p.text and not p.left, (p.left, p.text)


def test_a_models_outputs_on_a_fixed_validation_tensor_are_not_said_rank_zeros():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=16, '
            'shuffle=True)\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n'
            'for epoch in range(2):\n    for x, y in loader:\n'
            '        loss = torch.nn.functional.mse_loss(model(x), y)\n        opt.zero_grad()\n'
            '        loss.backward()\n        opt.step()\n    with torch.no_grad():\n        pred = model(X_val)\n'
            '        val_loss = torch.nn.functional.mse_loss(pred, y_val).item()\n    print(epoch, val_loss)\n')
    assert not any("val_loss" in k.what for k in plan(text).kept)


def test_a_tensors_scatter_is_no_figure():
    text = ('import torch\nfrom torch.utils.data import DataLoader\ntrain_loader = DataLoader(ds, batch_size=16, '
            'shuffle=True)\nmodel = torch.nn.Linear(4, 3)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n\n\n'
            'def brier(loader):\n    total, n = 0.0, 0\n    with torch.no_grad():\n        for x, y in loader:\n'
            '            p = model(x).softmax(1)\n'
            '            onehot = torch.scatter(torch.zeros_like(p), 1, y.unsqueeze(1), 1.0)\n'
            '            total += ((p - onehot) ** 2).sum().item()\n            n += len(y)\n    return total / n\n\n\n'
            'for x, y in train_loader:\n    opt.zero_grad()\n'
            '    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n'
            'print(brier(train_loader))\n')
    p = plan(text)
    assert not p.refused, p.left


def test_one_helper_for_both_loaders_with_no_argument_telling_them_apart_is_refused_with_that_cause():
    loaders = LOADERS.replace("def _make(self, dataset, shuffle):", "def _make(self, dataset):").replace(
        "shuffle=shuffle)", "shuffle=True)").replace("self._make(train, shuffle=True), self._make(test, shuffle=False)",
                                                     "self._make(train), self._make(test)")
    main = USE.format(head="import torch\nfrom data import Loaders\ntrain_loader, test_loader = Loaders(32).get()")
    plans = settled({"data.py": loaders, "main.py": main})
    said = [x for x in plans["data.py"].left if "both a training and an evaluation loader" in x.what]
    assert said and said[0].blocks, plans["data.py"].left


def test_a_loader_picked_the_other_way_round_under_a_negated_step_is_asked_branch_by_branch():
    picker = PICKER.replace("loader.train_loader if is_train else loader.test_loader",
                            "loader.test_loader if is_train else loader.train_loader").replace(
        "        if is_train:", "        if not is_train:")
    text = settled({"loaders.py": PICKED, "train.py": picker})["loaders.py"].text
    assert "self.train_loader = ddpkit.data_loader(train_set" in text, text
    assert "self.test_loader = DataLoader(test_set" in text, text


def test_a_helper_that_may_return_a_k_fac_optimizer_keeps_its_line():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nfrom optimizers import KFACOptimizer\n\n\n'
            'def get_optimizer(model, name):\n    if name == "kfac":\n        return KFACOptimizer(model, lr=0.1)\n'
            '    return torch.optim.SGD(model.parameters(), lr=0.1)\n\n\nnet = torch.nn.Linear(8, 3)\n'
            'optimizer = get_optimizer(net, "kfac")\nfor x, y in DataLoader(ds, batch_size=16, shuffle=True):\n'
            '    optimizer.zero_grad()\n    torch.nn.functional.cross_entropy(net(x), y).backward()\n'
            '    optimizer.step()\n')
    assert any("an optimizer built on the model itself" in x.what for x in plan(text).left)


def test_truncated_backprop_chunks_each_stepping_get_the_plain_token_line():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nPAD = 0\nloader = DataLoader(ds, batch_size=16, '
            'shuffle=True)\nmodel = torch.nn.Linear(8, 12)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n'
            'crit = torch.nn.CrossEntropyLoss(ignore_index=PAD)\nfor x, y in loader:\n    for t in range(0, 60, 20):\n'
            '        loss = crit(model(x[:, t:t + 20]).reshape(-1, 12), y[:, t:t + 20].reshape(-1))\n'
            '        opt.zero_grad()\n        loss.backward()\n        opt.step()\n')
    said = [x for x in plan(text).left if "CrossEntropyLoss" in x.what]
    assert said and "time steps" not in said[0].what and "batch_count" in said[0].fix, said


@pytest.mark.parametrize("model", [
    "    def init_hidden(self):\n        return torch.zeros(1, batch_size, 16)\n\n"
    "    def forward(self, x):\n        return self.fc(self.rnn(x, self.init_hidden())[0][:, -1])\n",
    "    def forward(self, x):\n        return self.fc(x.view(self.bs, -1))\n"])
def test_a_model_reading_the_batch_size_in_a_helper_method_or_its_init_keeps_the_batch_per_process(model):
    text = ('import torch\nfrom torch.utils.data import DataLoader\nbatch_size = 8\n'
            'loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\n\n\nclass Net(torch.nn.Module):\n'
            '    def __init__(self):\n        super().__init__()\n        self.bs = batch_size\n'
            '        self.rnn = torch.nn.GRU(4, 16, batch_first=True)\n        self.fc = torch.nn.Linear(16, 1)\n\n'
            f'{model}\n\nmodel = Net()\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)\nfor x, y in loader:\n'
            '    opt.zero_grad()\n    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n')
    p = plan(text)
    assert "global_batch_size" not in p.text and any("the model reads batch_size" in x.what for x in p.left)


def test_a_factorys_else_branch_is_the_one_the_test_does_not_hold_for():
    factory = FACTORY.format(train="torch.utils.data.DataLoader(ds, batch_size=1, shuffle=False)").replace(
        "    if phase == 'train':", "    if phase == 'test':").replace(
        "    elif phase == 'test':\n        return torch.utils.data.DataLoader(ds, batch_size=1, shuffle=False)",
        "    else:\n        return torch.utils.data.DataLoader(ds, batch_size=options['batch_size'], shuffle=True)")
    text = settled({"data.py": factory, "main.py": RUNNER})["data.py"].text
    assert "return ddpkit.data_loader(ds, global_batch_size=options['batch_size']" in text, text
    assert "return torch.utils.data.DataLoader(ds, batch_size=1, shuffle=False)" in text, text


def test_a_read_before_the_scripts_own_barrier_is_still_said():
    text = ('import json\nimport ddpkit\n\n\ndef save(loss):\n    with open("res.json", "w") as f:\n'
            '        json.dump({"loss": loss}, f)\n    with open("res.json") as f:\n        best = json.load(f)\n'
            '    ddpkit.barrier()\n    return best\n\n\nfor epoch in range(3):\n    if epoch % 2 == 0:\n'
            '        print(save(epoch))\n')
    assert any("a file is read" in x.what for x in plan(text).left)


def test_a_cuda_switch_of_the_options_named_is_cuda_is_a_device_set_up():
    text = ('import argparse\nimport torch\nfrom torch.utils.data import DataLoader\np = argparse.ArgumentParser()\n'
            'p.add_argument("--is_cuda", action="store_true")\nopt = p.parse_args()\n'
            'device = "cuda" if opt.is_cuda else "cpu"\nmodel = torch.nn.Linear(4, 2).to(device)\n'
            'optimizer = torch.optim.Adam(model.parameters(), lr=0.01)\n'
            'for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n    optimizer.zero_grad()\n'
            '    torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()\n'
            '    optimizer.step()\n')
    p = plan(text)
    assert not p.refused and "ddpkit.init(cpu=not opt.is_cuda)" in p.text, (p.left, p.text)


# review 36, on the fixes of review 35


@pytest.mark.parametrize("pick, step", [("loader.test_loader if is_train else loader.train_loader",
                                         "        if is_train:\n            pass\n        else:\n"),
                                        ("loader.train_loader if is_train else loader.test_loader",
                                         "        if not is_train:\n            pass\n        else:\n")])
def test_a_pick_whose_step_sits_in_an_else_is_read_as_the_else(pick, step):
    picker = PICKER.replace("loader.train_loader if is_train else loader.test_loader", pick).replace(
        "        if is_train:\n", step)
    text = settled({"loaders.py": PICKED, "train.py": picker})["loaders.py"].text
    # (either way the step runs for the training loader: it alone is sharded)
    assert "ddpkit.data_loader(train_set" in text and "= DataLoader(test_set" in text, text


def test_a_noise_helper_that_also_builds_a_fixed_validation_set_draws_alike_on_every_rank():
    from test_convert_twentythird import NOISE
    helper = "\n\ndef noise_sample(n_z, b):\n    return torch.randn(b, n_z)\n\n\nval = noise_sample(4, 64)\n"
    assert "rank_generator" not in plan(NOISE.format(helper=helper)).text


def test_a_librarys_noise_function_is_no_helper_of_the_project():
    from test_convert_twentythird import NOISE
    p = plan(NOISE.format(helper="from skimage.util import random_noise as noise_sample\n"))
    assert not any("another module" in x.what for x in p.left), p.left
