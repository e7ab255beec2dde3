"""What the twenty-third held-out set and its run-up showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from test_convert_twentysecond import LOADERS as ONE_LOADER  # noqa: E402  (its class, whose get() returns one)

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402


def _settled(files):
    return settle(list(files), lambda rel, c: plan(files[rel], crossing=c))


# one helper builds both loaders (``_make``) and a method returns the two calls as a tuple; the entry trains on the
# first and sums a test error over the second, divided by the test set's size
LOADERS = ONE_LOADER.split("    def get(self):")[0] + '''    def get(self):
        train = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        test = TensorDataset(torch.randn(67, 8), torch.randn(67, 1))
        return self._make(train, shuffle=True), self._make(test, shuffle=False)
'''
USE = '''{head}
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for x, y in train_loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
total = 0.0
with torch.no_grad():
    for x, y in test_loader:
        total += torch.nn.functional.mse_loss(model(x), y, reduction="sum").item()
print(total / len(test_loader.dataset))
'''
SPLIT = ("ddpkit.data_loader(dataset, global_batch_size=self.batch_size, shuffle=shuffle) if shuffle else "
         "DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle)")


def test_one_helper_returning_the_training_and_a_test_loader_from_another_module_splits_by_its_argument():
    main = USE.format(head="import torch\nfrom data import Loaders\ntrain_loader, test_loader = Loaders(32).get()")
    plans = _settled({"data.py": LOADERS, "main.py": main})
    assert not plans["data.py"].refused and not plans["main.py"].refused, plans["data.py"].left
    assert SPLIT in plans["data.py"].text, plans["data.py"].text
    # (the test loader stays whole: each rank sums every sample, so nothing is reduced)
    assert "ddpkit.reduce" not in plans["main.py"].text, plans["main.py"].text


def test_the_same_helper_in_one_file_splits_and_leaves_the_test_sum_alone():
    text = LOADERS + USE.format(head="train_loader, test_loader = Loaders(32).get()")
    p = plan(text)
    assert not p.refused, (p.left, p.kept)
    assert SPLIT in p.text and "ddpkit.reduce" not in p.text, p.text


def test_two_calls_of_a_loader_function_bound_in_one_tuple_are_read():
    head = ('import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n'
            'def make(ds, shuffle):\n    return DataLoader(ds, batch_size=32, shuffle=shuffle)\n\n\n'
            'train = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))\n'
            'test = TensorDataset(torch.randn(67, 8), torch.randn(67, 1))\n'
            'train_loader, test_loader = make(train, shuffle=True), make(test, shuffle=False)')
    p = plan(USE.format(head=head))
    assert not p.refused, (p.left, p.kept)
    assert ("ddpkit.data_loader(ds, global_batch_size=32, shuffle=shuffle) if shuffle else "
            "DataLoader(ds, batch_size=32, shuffle=shuffle)") in p.text, p.text


# a data class keeps its DataLoader and a generator method yields its batches one by one, reshaped; the entry (and
# a step method of a third module) trains on ``data.batches()``
DATA = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Data:
    def __init__(self, m):
        self.dataloader = DataLoader(TensorDataset(torch.rand(256, 1, 4, 4), torch.zeros(256)), batch_size=m,
                                     shuffle=True)

    def batches(self):
        for img, _ in self.dataloader:
            yield img.view(img.size(0), -1)
'''
ALGO = '''class Algo:
    def optimize(self, model, opt, x):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
'''
GENERATED = '''import torch
from data import Data
from algo import Algo  # (the step of a third module, in one case)

model = torch.nn.Linear(16, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data, algo = Data(32), Algo()
for epoch in range(2):
    for x in data.batches():
        {step}
'''


@pytest.mark.parametrize("step", ["loss = algo.optimize(model, opt, x)",
                                  "opt.zero_grad()\n        model(x).pow(2).mean().backward()\n        opt.step()"])
def test_a_loop_over_what_another_modules_generator_yields_from_its_loader_is_fed_by_that_loader(step):
    files = {"data.py": DATA, "main.py": GENERATED.format(step=step)}
    plans = _settled({**files, "algo.py": ALGO} if "algo." in step else files)
    assert not any(p.refused for p in plans.values()), [(p.left, p.kept) for p in plans.values()]
    assert "ddpkit.data_loader(TensorDataset" in plans["data.py"].text, plans["data.py"].text
    main = plans["main.py"]
    assert any("data.batches()" in k.what for k in main.kept) and not main.left, (main.left, main.kept)


def test_a_loss_a_step_function_returns_shown_after_the_loop_is_said_to_be_rank_zeros():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=32, '
            'shuffle=True)\n\n\ndef step(model, opt, x):\n    loss = model(x).pow(2).mean()\n    opt.zero_grad()\n'
            '    loss.backward()\n    opt.step()\n    return loss\n\n\nmodel = torch.nn.Linear(16, 1)\n'
            'opt = torch.optim.Adam(model.parameters(), lr=1e-3)\nfor epoch in range(2):\n    for x, _ in loader:\n'
            '        loss = step(model, opt, x)\n    print(f"epoch {epoch} loss {loss.item():.4f}")\n')
    p = plan(text)
    assert any("the step's loss" in k.what and k.line == 19 for k in p.kept), (p.left, p.kept)


SCORES = '''import torch
from torch.utils.data import DataLoader
loader = DataLoader(ds, batch_size=8, shuffle=True)
val_loader = DataLoader(vs, batch_size=8)
D = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid())
opt = torch.optim.Adam(D.parameters(), lr=1e-3)
for epoch in range(2):
    for x, y in loader:
        out = D(x)
        loss = torch.nn.functional.binary_cross_entropy(out, y)
        D_x = out.mean().item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        for xv, yv in val_loader:
            val_out = D(xv)
            val_score = val_out.mean().item()
    print(loss.item(), D_x, val_score)
'''


def test_a_score_of_the_models_outputs_shown_beside_the_loss_is_said_to_be_rank_zeros_not_an_evaluations():
    p = plan(SCORES)
    said = [k.what for k in p.kept if k.line == 19 and "the step's loss" in k.what]
    assert len(said) == 1 and "D_x, of the model's outputs" in said[0], (p.kept, p.left)
    assert "val_score" not in said[0]  # (the evaluation's own line says its last batch's score)


def test_an_evaluation_that_draws_each_batch_into_a_figure_keeps_its_loader_whole():
    text = ('import torch\nimport matplotlib.pyplot as plt\nfrom torch.utils.data import DataLoader\n'
            'train_loader = DataLoader(tr, batch_size=16, shuffle=True)\n'
            'test_loader = DataLoader(te, batch_size=1000)\n'
            'model = torch.nn.Linear(4, 4)\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)\n'
            'for x, _ in train_loader:\n    opt.zero_grad()\n    torch.nn.functional.mse_loss(model(x), x).backward()\n'
            '    opt.step()\nfor img, label in test_loader:\n    out = model(img).detach().numpy()\n'
            '    plt.scatter(out[:, 0], out[:, 1], c=label.numpy())\n    plt.show()\n')
    p = plan(text)
    assert "test_loader = DataLoader(te, batch_size=1000)" in p.text, p.text
    assert any("a figure of its batches" in k.what for k in p.kept), p.kept


# one function trains or validates, picking its loader from a data object's attributes by a conditional expression
PICKER = '''import torch
from loaders import Loader


def run(model, opt, loader, is_train):
    data_loader = loader.train_loader if is_train else loader.test_loader
    total = 0.0
    for i, (x, y) in enumerate(data_loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        total += loss.item()
        if is_train:
            opt.zero_grad()
            loss.backward()
            opt.step()
    return total / (i + 1)


loader = Loader(16)
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    print(run(model, opt, loader, True), run(model, opt, loader, False))
'''
PICKED = '''from torch.utils.data import DataLoader


class Loader:
    def __init__(self, batch_size):
        self.train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
        self.test_loader = DataLoader(test_set, batch_size=batch_size, shuffle=False)
'''


def test_a_loader_picked_from_a_data_objects_attributes_by_a_conditional_is_asked_branch_by_branch():
    plans = _settled({"loaders.py": PICKED, "train.py": PICKER})
    assert not any(p.refused for p in plans.values()), [(p.left, p.kept) for p in plans.values()]
    text = plans["loaders.py"].text
    assert "self.train_loader = ddpkit.data_loader(train_set" in text, text
    assert "self.test_loader = DataLoader(test_set" in text, text  # (validated whole by every rank)


LOCAL_BATCH = '''import torch
from torch.utils.data import DataLoader
loader = DataLoader(ds, batch_size=16, shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total = 0
for i, (x,) in enumerate(loader):
    batch_size = x.size(0)
    target = torch.ones(batch_size, 1)
    loss = torch.nn.functional.mse_loss(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.item() / batch_size
print(total / (i + 1))
'''


def test_a_sum_of_the_loss_over_the_batchs_own_size_is_not_averaged_as_a_mean_and_is_listed():
    p = plan(LOCAL_BATCH)
    assert "ddpkit.reduce(total" not in p.text, p.text  # (averaged, it showed twice one process's at 2)
    assert any("divided by the batch's own size" in x.what and x.line == 15 for x in p.left), p.left


def test_a_tensor_sized_by_the_batchs_own_size_in_another_modules_loop_is_not_said_sized_by_its_own():
    loop = LOCAL_BATCH.replace("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=16, "
                               "shuffle=True)\n", "from loaders import loader\n")
    plans = _settled({"loaders.py": "from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=16, "
                                    "shuffle=True)\n", "train.py": loop})
    assert not any("a batch size of its own" in x.what for x in plans["train.py"].left), plans["train.py"].left


def test_a_write_the_scripts_own_barrier_follows_in_its_function_is_not_said_unwaited():
    # (marinepal's ``save()``: a results file read, updated and written, then ``ddpkit.barrier()``; run under an if)
    text = ('import json\nimport ddpkit\n\n\ndef save(loss):\n    res = load("res.json")\n    res["loss"] = loss\n'
            '    with open("res.json", "w") as f:\n        json.dump(res, f)\n    ddpkit.barrier()\n\n\n'
            'def load(p):\n    with open(p) as f:\n        return json.load(f)\n\n\n'
            'for epoch in range(3):\n    if epoch % 2 == 0:\n        save(epoch)\n')
    p = plan(text)
    assert not any("a file is read" in x.what for x in p.left), p.left


def test_a_loop_that_collects_predictions_in_a_method_called_after_model_eval_is_an_evaluation():
    text = ('import torch\nfrom torch.utils.data import DataLoader\n\n\nclass Trainer:\n    def __init__(self):\n'
            '        self.train_dl = DataLoader(tr, batch_size=8, shuffle=True)\n'
            '        self.test_dl = DataLoader(te, batch_size=8)\n        self.model = torch.nn.Linear(8, 3)\n'
            '        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)\n\n    def train(self):\n'
            '        for x, y in self.train_dl:\n            self.opt.zero_grad()\n'
            '            torch.nn.functional.cross_entropy(self.model(x), y).backward()\n            self.opt.step()\n'
            '        self.model.eval()\n        print(self.metrics())\n\n    def metrics(self):\n'
            '        preds, targets = [], []\n        for x, y in self.test_dl:\n'
            '            preds += self.model(x).argmax(1).tolist()\n            targets += y.tolist()\n'
            '        return sum(p == t for p, t in zip(preds, targets)) / len(targets)\n\n    def test(self):\n'
            '        self.model.eval()\n        correct = 0\n        for x, y in self.test_dl:\n'
            '            correct += (self.model(x).argmax(1) == y).sum().item()\n        print(correct)\n\n\n'
            't = Trainer()\nt.train()\nt.test()\n')
    p = plan(text)
    assert not p.refused, p.left
    assert "self.test_dl = DataLoader(te, batch_size=8)" in p.text, p.text


def test_a_method_called_after_model_train_is_not_taken_for_an_evaluation():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=8)\n'
            'model = torch.nn.Linear(8, 3)\n\n\ndef collect():\n    for x, y in loader:\n        model(x)\n\n\n'
            'def run():\n    model.eval()\n    model.train()\n    collect()\n\n\nrun()\n')
    from ddpkit.commands.convert.roles import evaluates
    from ddpkit.commands.convert.scan import parse, scan
    facts = scan(parse(text))
    assert not evaluates(facts, facts.loops[-1])


def test_torch_load_in_a_method_beside_a_load_method_is_not_a_call_of_it():
    # (ILSVRC's Trainer: ``load()`` runs only from ``__init__`` on resume, before ``fit()`` saves; ``torch.load``
    # inside it was taken for a call of ``Trainer.load`` itself, so the read seemed to run after the saves)
    text = ('import os\nimport torch\nfrom torch.utils.data import DataLoader\n\n\nclass Trainer:\n'
            '    def __init__(self, model, resume=None):\n        self.model = model\n'
            '        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)\n        self.best = float("inf")\n'
            '        if resume and os.path.isfile(resume):\n            self.load(resume)\n\n'
            '    def fit(self, dl, epochs):\n        for epoch in range(epochs):\n            for x, y in dl:\n'
            '                self.opt.zero_grad()\n'
            '                loss = torch.nn.functional.mse_loss(self.model(x), y)\n'
            '                loss.backward()\n                self.opt.step()\n'
            '            if loss.item() < self.best:\n'
            '                self.best = loss.item()\n                self.save("best.pth")\n\n'
            '    def save(self, path):\n        torch.save({"model": self.model.state_dict()}, path)\n\n'
            '    def load(self, path):\n        ckpt = torch.load(path)\n'
            '        self.model.load_state_dict(ckpt["model"])\n\n\n'
            'if __name__ == "__main__":\n    dl = DataLoader(ds, batch_size=8, shuffle=True)\n'
            '    Trainer(torch.nn.Linear(8, 1), resume=None).fit(dl, 2)\n')
    p = plan(text)
    assert not any("a file is read" in x.what for x in p.left), p.left


def test_a_forward_that_reshapes_by_the_module_level_batch_size_keeps_the_batch_per_process():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nbatch_size = 8\n'
            'loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\n\n\nclass Net(torch.nn.Module):\n'
            '    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(8, 1)\n\n'
            '    def forward(self, x):\n        return self.fc(x.view(batch_size, -1))\n\n\nmodel = Net()\n'
            'opt = torch.optim.Adam(model.parameters(), lr=1e-2)\nfor x, y in loader:\n    opt.zero_grad()\n'
            '    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n')
    p = plan(text)
    assert "global_batch_size" not in p.text, p.text  # (each rank's B/N rows cannot be viewed as B)
    assert any("the model reads batch_size at line 13" in x.what for x in p.left), p.left


def test_an_optimizer_a_method_of_the_script_builds_with_torch_is_not_taken_for_one_built_on_the_model():
    text = ('import torch\nfrom torch.utils.data import DataLoader\n\n\nclass Runner:\n'
            '    def build_optimizer(self, net):\n        return torch.optim.SGD(net.parameters(), lr=0.1)\n\n'
            '    def run(self):\n        train_dl = DataLoader(ds, batch_size=16, shuffle=True)\n'
            '        net = torch.nn.Linear(8, 3)\n        opt = self.build_optimizer(net)\n'
            '        for x, y in train_dl:\n            loss = torch.nn.functional.cross_entropy(net(x), y)\n'
            '            opt.zero_grad()\n            loss.backward()\n            opt.step()\n\n\nRunner().run()\n')
    p = plan(text)
    assert not any("an optimizer built on the model itself" in x.what for x in p.left), p.left


def test_a_save_and_a_load_of_a_path_made_from_their_parameters_in_two_functions_are_said_apart():
    # (ChatBotCHS's util.py: ``save_vocab(d, saved_dir)`` writes ``saved_dir / 'vocab.dict'``, ``load_vocab(saved_dir)``
    # reads it; no function of the file runs both: no "inside an if or a loop" to fix there)
    util = ('import pickle\n\n\ndef save_vocab(d, saved_dir):\n    with open(saved_dir / "vocab.dict", "wb") as f:\n'
            '        pickle.dump(d, f)\n\n\ndef load_vocab(saved_dir):\n'
            '    with open(saved_dir / "vocab.dict", "rb") as f:\n        return pickle.load(f)\n')
    p = plan(util + 'import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(8, 1)\n'
             'opt = torch.optim.SGD(model.parameters(), lr=0.1)\n'
             'for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n    model(x).mean().backward()\n'
             '    opt.step()\n')
    assert not any("a file is read" in x.what for x in p.left), p.left
    assert any("a function apart from save_vocab()" in k.what for k in p.kept), p.kept


def test_a_token_mean_added_up_over_time_steps_is_listed_with_a_per_step_count_not_one_batch_count():
    # (the chatbot tutorial's decoder loss: ``loss += criterion(out[:, t], y[:, t])`` for each time step; one
    # batch_count weighs a single mean, so its advice left verify FAILing; the per-step count passes it)
    text = ('import torch\nfrom torch.utils.data import DataLoader\nPAD = 0\n'
            'loader = DataLoader(ds, batch_size=16, shuffle=True)\nmodel = torch.nn.Linear(8, 72)\n'
            'opt = torch.optim.SGD(model.parameters(), lr=0.1)\ncrit = torch.nn.CrossEntropyLoss(ignore_index=PAD)\n'
            'for x, y in loader:\n    opt.zero_grad()\n    out = model(x).view(-1, 6, 12)\n    loss = 0\n'
            '    for t in range(6):\n        loss += crit(out[:, t], y[:, t])\n    loss.backward()\n    opt.step()\n')
    p = plan(text)
    said = [x for x in p.left if "CrossEntropyLoss" in x.what]
    assert len(said) == 1 and "time steps of the loop at line 12" in said[0].what, p.left
    assert "counts = ddpkit.reduce((labels != PAD).sum(0))" in said[0].fix and "batch_count" not in said[0].fix


def test_a_batch_size_handed_to_another_modules_loader_as_a_dict_entry_and_read_by_the_loop_stays_per_process():
    # (DeepConvGAN: ``image_loader(batch_size=cfg['batch_size'])``, then ``torch.ones((cfg['batch_size'], 1))``)
    loaders = ('from torch.utils.data import DataLoader\n\n\ndef image_loader(batch_size):\n'
               '    return DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True)\n')
    train = ('import torch\nfrom loaders import image_loader\n\n\ndef train(cfg):\n'
             '    loader = image_loader(batch_size=cfg["batch_size"])\n    model = torch.nn.Linear(4, 1)\n'
             '    opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n    real = torch.ones((cfg["batch_size"], 1))\n'
             '    for (x,) in loader:\n        opt.zero_grad()\n'
             '        torch.nn.functional.mse_loss(model(x), real).backward()\n        opt.step()\n\n\n'
             'train({"batch_size": 16})\n')
    plans = _settled({"loaders.py": loaders, "train.py": train})
    assert "global_batch_size" not in plans["loaders.py"].text, plans["loaders.py"].text
    assert any("kept per process" in x.what for x in plans["loaders.py"].left), plans["loaders.py"].left


def test_a_tensor_made_before_the_loop_and_cut_to_the_batch_in_it_does_not_keep_the_batch_per_process():
    # (the named fix for denoise_autoencoder's noise made once with batch_size: ``noise[:x.size(0)]`` each step)
    text = ('import torch\nfrom torch.utils.data import DataLoader\nbatch_size = 8\n'
            'loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\nmodel = torch.nn.Linear(4, 4)\n'
            'opt = torch.optim.Adam(model.parameters(), lr=1e-2)\nnoise = torch.rand(batch_size, 4)\n'
            'for (x,) in loader:\n    x_noisy = x + 0.1 * noise[:x.size(0)]\n    opt.zero_grad()\n'
            '    torch.nn.functional.mse_loss(model(x_noisy), x).backward()\n    opt.step()\n')
    p = plan(text)
    assert "global_batch_size=batch_size" in p.text and not p.left, p.left


# a factory returns one DataLoader a branch of its phase string; the entry trains on the 'train' one through a
# runner's attribute
FACTORY = '''import torch


def create_dataloader(phase, **options):
    if phase == 'train':
        return {train}
    elif phase == 'test':
        return torch.utils.data.DataLoader(ds, batch_size=1, shuffle=False)
'''
RUNNER = '''import torch
from data import create_dataloader


class Trainer:
    def __init__(self, net, opt, train_dl):
        self.net, self.opt, self.train_dl = net, opt, train_dl

    def fit(self):
        for x, y in self.train_dl:
            self.opt.zero_grad()
            torch.nn.functional.cross_entropy(self.net(x), y).backward()
            self.opt.step()


class Runner:
    def run(self):
        train_dl = create_dataloader('train', batch_size=16)
        net = torch.nn.Linear(8, 3)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        Trainer(net, opt, train_dl).fit()


Runner().run()
'''


def test_a_factory_branch_the_asked_phase_never_reaches_is_not_made_a_training_loader():
    train = "torch.utils.data.DataLoader(ds, batch_size=options['batch_size'], shuffle=True)"
    plans = _settled({"data.py": FACTORY.format(train=train), "main.py": RUNNER})
    text = plans["data.py"].text
    assert "return ddpkit.data_loader(ds, global_batch_size=options['batch_size']" in text, text
    assert "return torch.utils.data.DataLoader(ds, batch_size=1, shuffle=False)" in text, text


def test_a_training_loader_made_by_hand_where_it_is_built_feeds_the_loop_of_another_module():
    # (the fix a line named, applied: the entry's loop is fed, nothing left to do there)
    train = "ddpkit.data_loader(ds, global_batch_size=options['batch_size'], shuffle=True)"
    factory = FACTORY.format(train=train).split("    elif")[0]  # (the train branch alone, as the named fix wrote it)
    plans = _settled({"data.py": "import ddpkit\n" + factory, "main.py": RUNNER})
    assert not plans["main.py"].left, plans["main.py"].left
    assert any("self.train_dl is a ddpkit.data_loader" in k.why for k in plans["main.py"].kept), plans["main.py"].kept


def test_a_device_name_taken_from_a_tensor_in_forward_is_no_device_set_up():
    text = ('import torch\nfrom torch.utils.data import DataLoader\n\n\nclass Net(torch.nn.Module):\n'
            '    def __init__(self):\n        super().__init__()\n        self.fc = torch.nn.Linear(4, 2)\n\n'
            '    def forward(self, x):\n        dv = "cuda" if x.is_cuda else "cpu"\n'
            '        return self.fc(x) * torch.ones(x.shape[0], 1, device=dv)\n\n\n'
            'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")\nmodel = Net().to(device)\n'
            'opt = torch.optim.Adam(model.parameters(), lr=0.01)\n'
            'for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n'
            '    torch.nn.functional.cross_entropy(model(x.to(device)), y).backward()\n    opt.step()\n')
    p = plan(text)
    assert 'dv = "cuda" if x.is_cuda else "cpu"' in p.text and p.text.count("ddpkit.init(") == 1, p.text


def test_a_file_written_then_read_through_another_modules_function_is_waited_for():
    # (ChatBotCHS's preprocessing: ``vocab.dict`` written by rank 0, then ``load_vocab(...)`` of util.py reads it:
    # rank 1 read it before it existed, FileNotFoundError in 2 runs of 3)
    util = ('import pickle\n\n\ndef load_vocab(d):\n    with open(d + "/vocab.dict", "rb") as f:\n'
            '        return pickle.load(f)\n')
    main = ('import pickle\nimport torch\nfrom torch.utils.data import DataLoader\nfrom util import load_vocab\n\n'
            'with open("vocab.dict", "wb") as f:\n    pickle.dump({"[PAD]": 0}, f)\nvocab = load_vocab(".")\n'
            'model = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n'
            'for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n    model(x).mean().backward()\n    opt.step()\n')
    text = _settled({"util.py": util, "main.py": main})["main.py"].text
    assert "        pickle.dump({\"[PAD]\": 0}, f)\nddpkit.barrier()\nvocab = load_vocab(\".\")" in text, text


def test_an_entry_no_file_imports_runs_its_main_once_whatever_another_file_calls_main():
    # (DiscoGAN: trainer.py's ``load_model()`` runs from ``__init__`` on resume, its saves in ``train()``; main.py's
    # ``main()`` builds the Trainer, then trains; models.py's ``self.main(x)`` made ``main`` seem called elsewhere,
    # so a second Trainer seemed possible after the saves: four false barrier lines)
    trainer = ('import torch\n\n\nclass Trainer:\n    def __init__(self, model, loader, load_path=None):\n'
               '        self.model, self.loader = model, loader\n'
               '        self.opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n        if load_path:\n'
               '            self.load_model(load_path)\n\n    def load_model(self, path):\n'
               '        self.model.load_state_dict(torch.load(path))\n\n    def train(self):\n'
               '        for step, (x,) in enumerate(self.loader):\n            self.opt.zero_grad()\n'
               '            self.model(x).mean().backward()\n            self.opt.step()\n'
               '            if step % 10 == 9:\n                torch.save(self.model.state_dict(), f"G_{step}.pth")\n')
    models = ('import torch\n\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n'
              '        self.fc = torch.nn.Linear(4, 1)\n\n    def main(self, x):\n        return self.fc(x)\n\n'
              '    def forward(self, x):\n        return self.main(x)\n')
    main = ('from torch.utils.data import DataLoader\nfrom models import Net\nfrom trainer import Trainer\n\n\n'
            'def main():\n    loader = DataLoader(ds, batch_size=8, shuffle=True)\n'
            '    trainer = Trainer(Net(), loader)\n    trainer.train()\n\n\nif __name__ == "__main__":\n    main()\n')
    plans = _settled({"trainer.py": trainer, "models.py": models, "main.py": main})
    assert not any("a file is read" in x.what for x in plans["trainer.py"].left), plans["trainer.py"].left


def test_a_token_mean_added_up_over_time_steps_in_a_helper_the_loop_calls_gets_the_per_step_count():
    # (ChatBotCHS's ``train_decode_step``: the time loop in a helper, its loss returned to the training loop)
    text = ('import torch\nfrom torch.utils.data import DataLoader\nPAD = 0\n'
            'crit = torch.nn.CrossEntropyLoss(ignore_index=PAD)\n\n\ndef decode(model, x, y):\n'
            '    out = model(x).view(-1, 6, 12)\n    loss = 0\n    for t in range(6):\n'
            '        loss += crit(out[:, t], y[:, t])\n    return loss\n\n\n'
            'loader = DataLoader(ds, batch_size=16, shuffle=True)\nmodel = torch.nn.Linear(8, 72)\n'
            'opt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n    opt.zero_grad()\n'
            '    loss = decode(model, x, y)\n    loss.backward()\n    opt.step()\n')
    said = [x for x in plan(text).left if "CrossEntropyLoss" in x.what]
    assert said and "time steps of the loop at line 10" in said[0].what, said


def test_a_loop_collecting_predictions_two_calls_below_model_eval_is_an_evaluation():
    # (marinepal's ``get_metrics()``, called by ``save()``, which ``train()`` calls after ``self.model.eval()``)
    from ddpkit.commands.convert.roles import evaluates
    from ddpkit.commands.convert.scan import parse, scan
    text = ('class T:\n    def train(self):\n        self.model.eval()\n        self.save()\n\n'
            '    def save(self):\n        print(self.metrics())\n\n    def metrics(self):\n        preds = []\n'
            '        for x, y in self.test_dl:\n            preds += self.model(x).argmax(1).tolist()\n'
            '        return preds\n')
    facts = scan(parse(text))
    assert evaluates(facts, facts.loops[-1])


def test_a_factory_in_a_packages_init_is_asked_there():
    # (yakunpku's ``datasets/__init__.py``: ``from datasets import create_dataloader`` reads the package's init)
    train = "torch.utils.data.DataLoader(ds, batch_size=options['batch_size'], shuffle=True)"
    plans = _settled({"data/__init__.py": FACTORY.format(train=train), "main.py": RUNNER})
    text = plans["data/__init__.py"].text
    assert "return ddpkit.data_loader(ds, global_batch_size=options['batch_size']" in text, text
    assert not plans["main.py"].left, plans["main.py"].left


NOISE = '''import torch
from torch.utils.data import DataLoader
{helper}
torch.manual_seed(1123)
loader = DataLoader(ds, batch_size=16, shuffle=True)
netG = torch.nn.Linear(4, 8)
netD = torch.nn.Linear(8, 1)
optG = torch.optim.Adam(netG.parameters(), lr=2e-4)
for x, _ in loader:
    noise = noise_sample(4, x.size(0))
    optG.zero_grad()
    netD(netG(noise)).mean().backward()
    optG.step()
'''


def test_noise_a_helper_returns_to_the_loop_is_drawn_from_the_ranks_generator():
    # (InfoGAN's ``noise_sample()`` in utils.py: each rank drew the same z, torch seeded alike)
    helper = "\n\ndef noise_sample(n_z, b):\n    return torch.randn(b, n_z)\n\n"
    p = plan(NOISE.format(helper=helper))
    assert "return torch.randn(b, n_z, generator=ddpkit.rank_generator())" in p.text, p.text


def test_noise_an_imported_helper_returns_is_listed():
    p = _settled({"noise_utils.py": "import torch\n\n\ndef noise_sample(n_z, b):\n    return torch.randn(b, n_z)\n",
                  "main.py": NOISE.format(helper="from noise_utils import noise_sample\n")})["main.py"]
    assert any("noise_sample() of another module" in x.what for x in p.left), p.left


def test_loaders_returned_inside_a_dict_of_tuples_no_file_line_calls_stay_whole():
    # (a recommender's ``get_train_test()`` returning ``{"dataloaders": (train_dl, test_dl)}``: its shuffled test
    # loader became a sharded training one, the entry's error ratio from half the test set, unsaid)
    loaders = ('from torch.utils.data import DataLoader\n\n\ndef get_train_test():\n'
               '    train_dl = DataLoader(tr, batch_size=8, shuffle=True)\n'
               '    test_dl = DataLoader(te, batch_size=8, shuffle=True)\n'
               '    return {"datasets": (tr, te), "dataloaders": (train_dl, test_dl)}\n')
    main = ('import torch\nfrom torch.utils.data import DataLoader\nfrom loaders import get_train_test\n'
            'split = get_train_test()\ntest_dl = split["dataloaders"][1]\n'
            'train_dl = DataLoader(split["datasets"][0], batch_size=8, shuffle=True)\n'
            'model = torch.nn.Linear(4, 1)\nopt = torch.optim.Adam(model.parameters(), lr=1e-2)\n'
            'for x, y in train_dl:\n    opt.zero_grad()\n    torch.nn.functional.mse_loss(model(x), y).backward()\n'
            '    opt.step()\nerrors = []\nwith torch.no_grad():\n    for x, y in test_dl:\n'
            '        errors.append(int(((model(x) - y).abs() > 0.5).sum()))\nprint(sum(errors) / (8 * len(errors)))\n')
    text = _settled({"loaders.py": loaders, "main.py": main})["loaders.py"].text
    assert "ddpkit.data_loader" not in text, text


def test_a_figure_saved_on_a_line_of_several_statements_is_listed():
    text = ('import torch\nimport matplotlib.pyplot as plt\nfrom torch.utils.data import DataLoader\n'
            'model = torch.nn.Linear(4, 1)\nopt = torch.optim.Adam(model.parameters(), lr=1e-3)\n'
            'for x, y in DataLoader(ds, batch_size=16, shuffle=True):\n    opt.zero_grad()\n'
            '    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n'
            'fig, ax = plt.subplots(); ax.plot([1, 2]); fig.savefig("curves.png")\n')
    assert any("savefig(...) inside a larger statement" in x.what for x in plan(text).left)


def test_a_question_rank_0_asks_and_broadcasts_is_not_listed_again():
    text = ('import torch\nimport ddpkit\nfrom torch.utils.data import DataLoader\n'
            'name = str(ddpkit.broadcast(input("name: ") if ddpkit.init().is_main else None))\n'
            'model = torch.nn.Linear(4, 1)\nopt = torch.optim.Adam(model.parameters(), lr=0.01)\n'
            'for x, y in DataLoader(ds, batch_size=16, shuffle=True):\n    opt.zero_grad()\n'
            '    torch.nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n')
    assert not any("input()" in x.what for x in plan(text).left)


def test_a_tensor_cut_to_the_batch_through_a_name_does_not_keep_the_batch_per_process():
    text = ('import torch\nfrom torch.utils.data import DataLoader\nbatch_size = 8\n'
            'loader = DataLoader(ds, batch_size=batch_size, shuffle=True)\nmodel = torch.nn.Linear(4, 4)\n'
            'opt = torch.optim.Adam(model.parameters(), lr=1e-2)\nreal = torch.ones(batch_size, 4)\n'
            'for (x,) in loader:\n    b = x.size(0)\n    opt.zero_grad()\n'
            '    torch.nn.functional.mse_loss(model(x), real[:b]).backward()\n    opt.step()\n')
    p = plan(text)
    assert "global_batch_size=batch_size" in p.text and not p.left, p.left
