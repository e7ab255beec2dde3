"""What the twenty-fourth held-out set and its run-up showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from test_convert_heldout import HEAD_LOOP, below, convert  # noqa: E402


@pytest.mark.parametrize("peek", [
    "if arch == 'densenet':\n    n = model.classifier.in_features\nelse:\n"
    "    n = next(l for l in model.classifier.children() if isinstance(l, nn.Linear)).in_features\n",
    "n = [l for l in model.classifier.modules() if isinstance(l, nn.Linear)][0].in_features\n",
    "n = list(model.classifier.children())[-1].weight.shape[1]\n",
])
def test_a_new_head_sized_by_walking_the_old_one_comes_before_the_wrap(peek):
    """The fifth extra script of set 23 (a course's flower classifier): the old head's input size read by walking
    its children (``next(l for l in model.classifier.children() ...).in_features``) in an ``if``, then a new head.
    The walk counted as a use: the wrap stayed at the build, the head landed on the wrapper and every rank stopped."""
    text = convert("model = Net()\n" + peek + "model.classifier = nn.Linear(n, 2)\n", HEAD_LOOP).text
    assert text.count("prepare_model") == 1 and "\nmodel = ddpkit.prepare_model(model)\n" in text, text
    assert below(text, "model.classifier = nn.Linear", "model = ddpkit.prepare_model(model)"), text


def test_a_walk_of_the_models_children_that_is_no_size_still_keeps_the_wrap_above_it():
    result = convert("model = Net()\nlayers = list(model.children())\nmodel.fc = nn.Linear(512, 2)\n", HEAD_LOOP)
    assert [x.line for x in result.left] == [6], result.left


DICT_ALIAS = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Runner:
    def __init__(self):
        self.loaders, self.sets = self.build()
        self.net = torch.nn.Linear(4, 3)
        self.opt = torch.optim.Adam(self.net.parameters())

    def build(self):
        ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
        loaders = {
            "train": DataLoader(ds, batch_size=8, shuffle=True),
            "valid": DataLoader(ds, batch_size=8),
        }
        return loaders, {"train": ds}

    def fit(self):
        for epoch in range(3):
            train_loader = self.loaders["train"]
            for x, y in train_loader:
                loss = torch.nn.functional.cross_entropy(self.net(x), y)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            with torch.no_grad():
                valid_loader = self.loaders["valid"]
                hits = sum((self.net(x).argmax(1) == y).sum().item() for x, y in valid_loader)
            print(epoch, hits / 40)


Runner().fit()
'''


def test_a_dict_of_split_loaders_read_through_an_alias_in_a_method_converts():
    """The fifth extra script of set 23: a method returns the loaders in a dict by split (beside the datasets), and
    the training method binds ``train_loader = self.loaders['train']`` before its loop: refused as loaders "built
    inside an expression", though the same dict read without the alias converted."""
    from ddpkit.commands.convert.plan import plan

    result = plan(DICT_ALIAS)
    assert not [x for x in result.left if x.blocks], result.left
    assert result.text.count("ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)") == 1, result.text
    assert '"valid": DataLoader(ds, batch_size=8)' in result.text, result.text


NETS = '''import torch


class Base(torch.nn.Module):
    def save(self, path="last.pt"):
        torch.save(self.state_dict(), path)


class Small(Base):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
'''


@pytest.mark.parametrize("build", [
    "from nets import Small\nmodel = Small()\n",
    "import nets\nmodel = getattr(nets, 'Small')()\n",
    "import nets\nmodel = getattr(nets, args.arch)()\n",
])
def test_a_model_class_whose_base_saves_in_an_unread_module_is_said(tmp_path, build):
    """Set 23's graph project (d/s05): ``model = getattr(models, opt.model)(opt)``, each model deriving from a base
    class whose ``save()`` runs ``torch.save``; the script calls ``model.save()`` each epoch. Converted alone it
    exited 0 with nothing said, and every rank wrote the one checkpoint file."""
    from ddpkit.commands.convert import unread

    (tmp_path / "nets.py").write_text(NETS)
    script = tmp_path / "train.py"
    script.write_text(build + "model.save()\n")
    said = unread.writers(str(script), ["nets.py"], script.read_text())
    assert said and said[0].startswith("Base (nets.py:6, save(...)) writes a file"), said


def test_getattr_of_a_computed_name_on_no_module_reads_no_class(tmp_path):
    from ddpkit.commands.convert import unread

    (tmp_path / "nets.py").write_text(NETS)
    script = tmp_path / "train.py"
    script.write_text("for k in vars(args):\n    print(k, getattr(args, k))\n")
    assert unread.writers(str(script), ["nets.py"], script.read_text()) == []


HANDMADE = '''import torch
import ddpkit
from torch.utils.data import DataLoader, TensorDataset


def unroll(model, x, y):
    loss = 0
    for t in range(y.size(1)):
        loss += torch.nn.functional.mse_loss(model(x)[:, t], y[:, t])
    return loss


data = TensorDataset(torch.randn(64, 6), torch.randn(64, 3))
loader = {loader}
model = torch.nn.Linear(6, 3)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    recent = []
    total = 0.0
    for x, y in loader:
        opt.zero_grad()
        loss = unroll(model, x, y)
        recent.append(loss.item())
        total += loss.item()
        loss.backward()
        opt.step()
    print(epoch, sum(recent) / len(recent), total)
'''


def test_a_hand_made_training_loader_gets_what_a_converted_one_gets():
    """Set 23's chatbot (c/s04) after its named fix: the training loader written by hand as
    ``ddpkit.data_loader(..., global_batch_size=16)``, the rest as it was. Convert then said nothing of the loop's
    per-step loss list or its sums (the plain DataLoader form said the list is this rank's and reduced the sum):
    the printed average was rank 0's, unsaid."""
    from ddpkit.commands.convert.plan import plan

    plain = plan(HANDMADE.format(loader="DataLoader(data, batch_size=16, shuffle=True)"))
    by_hand = plan(HANDMADE.format(loader="ddpkit.data_loader(data, global_batch_size=16, shuffle=True)"))
    said = sorted((x.line, x.what) for x in plain.kept + plain.left)
    assert said and sorted((x.line, x.what) for x in by_hand.kept + by_hand.left) == said, (said, by_hand.kept)
    assert by_hand.text.count("ddpkit.reduce") == plain.text.count("ddpkit.reduce"), by_hand.text
    again = plan(by_hand.text)  # (its own output: nothing new)
    assert again.text == by_hand.text and not again.left, again.text


def test_one_helper_for_both_loaders_bound_to_names_before_the_return_is_refused_with_that_cause():
    """Review 36: ``train_loader = self._make(train); test_loader = self._make(test); return train_loader,
    test_loader`` (the tuple of the calls themselves was refused right): the test loader was sharded for
    training and its sum reduced over padded shards, nothing said."""
    from test_convert_twentythird import LOADERS, USE, _settled

    loaders = LOADERS.replace("def _make(self, dataset, shuffle):", "def _make(self, dataset):").replace(
        "shuffle=shuffle)", "shuffle=True)").replace(
        "        return self._make(train, shuffle=True), self._make(test, shuffle=False)\n",
        "        train_loader = self._make(train)\n        test_loader = self._make(test)\n"
        "        return train_loader, test_loader\n")
    assert "return train_loader, test_loader" in loaders
    main = USE.format(head="import torch\nfrom data import Loaders\ntrain_loader, test_loader = Loaders(32).get()")
    plans = _settled({"data.py": loaders, "main.py": main})
    said = [x for x in plans["data.py"].left if "both a training and an evaluation loader" in x.what]
    assert said and said[0].blocks, plans["data.py"].left


STAGES = {
    "stages.py": "import importlib\n\nstep = importlib.import_module('fit')\nfor stage in range(2):\n    step.main()\n",
    "fit.py": '''import torch
from torch.utils.data import DataLoader, TensorDataset

import store


def main():
    net = torch.nn.Linear(4, 1)
    store.restore(net, "last.pt")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    store.keep(net, "last.pt")


if __name__ == "__main__":
    main()
''',
    "store.py": '''import os

import torch


def keep(net, path):
    torch.save(net.state_dict(), path)


def restore(net, path):
    if os.path.exists(path):
        net.load_state_dict(torch.load(path))
''',
}


def test_a_module_run_through_importlib_may_run_its_main_again():
    """Review 36: a sweep running ``fit.main()`` stage after stage through ``importlib.import_module("fit")``, each
    stage restoring the last one's save: no file imported fit.py by name, so its ``main()`` was taken to run once and
    the save-then-restore barrier line was dropped (a rank could restore a half-written file)."""
    from test_convert_twentythird import _settled

    plans = _settled(STAGES)
    said = [x for x in plans["store.py"].left if "before rank 0 has written it" in x.what]
    assert said, [(x.line, x.what) for x in plans["store.py"].left + plans["store.py"].kept]


ONE_LOOP = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def run_epoch(model, loader, optimiser=None):
    hits = seen = 0
    for x, y in loader:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        if optimiser is not None:
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        hits += (out.argmax(1) == y).sum().item()
        seen += y.numel()
    return hits / seen


model = torch.nn.Linear(6, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.3)
train_loader = DataLoader(TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,))), batch_size=8, shuffle=True)
dev_loader = DataLoader(TensorDataset(torch.randn(24, 6), torch.randint(0, 3, (24,))), batch_size=8)
best = 0.0
for epoch in range(20):
    run_epoch(model, train_loader, opt)
    acc = run_epoch(model, dev_loader{dev})
    if acc <= best:
        break
    best = acc
'''


@pytest.mark.parametrize("dev", [", None", "", ", optimiser=None"])
def test_an_evaluation_through_the_training_function_handed_no_optimizer_is_said(dev):
    """Set 24's seq2seq (c/s03): ``run_epoch(model, dev_loader, None)``, whose step runs under ``if optimiser is
    not None:``. The dev loader was sharded as a training loader with nothing said, and the early stop on each
    rank's half of the dev set sent the ranks out of the epoch loop at different epochs."""
    from ddpkit.commands.convert.plan import plan

    result = plan(ONE_LOOP.format(dev=dev))
    said = [x for x in result.left if x.line == 22 and "step switched off" in x.what]
    assert said, [(x.line, x.what) for x in result.left]


PHASES = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def fit(net, loaders, opt, epochs=2):
    for epoch in range(epochs):
        for phase in ("train", "val"):
            net.train(phase == "train")
            loss_sum, right = 0.0, 0
            for x, y in loaders[phase]:
                opt.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    out = net(x)
                    loss = torch.nn.functional.cross_entropy(out, y)
                    if phase == "train":
                        loss.backward()
                        opt.step()
                loss_sum += loss.item() * x.size(0)
                right += (out.argmax(1) == y).sum().item()
            print(epoch, phase, loss_sum / len(loaders[phase].dataset), right / len(loaders[phase].dataset))


tr = TensorDataset(torch.randn(48, 5), torch.randint(0, 2, (48,)))
va = TensorDataset(torch.randn(20, 5), torch.randint(0, 2, (20,)))
train_loader = DataLoader(tr, batch_size=8, shuffle=True)
val_loader = DataLoader(va, batch_size=8)
loaders = {"train": train_loader, "val": val_loader}
net = torch.nn.Linear(5, 2)
fit(net, loaders, torch.optim.Adam(net.parameters()))
'''


def test_named_loaders_put_in_a_dict_by_phase_get_the_phase_loops_sums_reduced():
    """Set 24's lesson series (b/s02): the transfer-learning tutorial's loop over ``dataloaders[phase]``, the loaders
    bound to names first and then put in the dict. The training loader was sharded by its name's role, the phase
    loop never found: its sums stayed each rank's (the printed train loss and accuracy about half, the best epoch
    picked per rank), and the val loader was said to have no loop in this file."""
    from ddpkit.commands.convert.plan import plan

    result = plan(PHASES)
    assert "ddpkit.data_loader(tr, global_batch_size=8, shuffle=True)" in result.text, result.text
    assert "val_loader = DataLoader(va, batch_size=8)" in result.text, result.text
    assert "loss_sum = ddpkit.reduce(loss_sum) if phase == 'train' else loss_sum" in result.text, result.text
    assert not [x for x in result.kept if "whose loop is not in this file" in x.what], result.kept


BEST = '''import torch
import ddpkit
from torch.utils.data import DataLoader, TensorDataset


def train(net, loader, epochs):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    best = None
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        if best is None or epoch % 2 == 0:
            torch.save(net.state_dict(), "best.pth")
        ddpkit.barrier()


loader = DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=8, shuffle=True)
net = torch.nn.Linear(3, 1)
train(net, loader, 3)
net.load_state_dict(torch.load("best.pth"))
'''


def test_the_scripts_own_barrier_after_a_branched_save_in_a_training_function_is_seen():
    """Set 24's CIFAR recipe (a/s01) after its named fix: ``ddpkit.barrier()`` in the epoch loop right after the
    best model's guarded save, the read after the training function returns; convert still said "put
    ddpkit.barrier() after the save" (it saw a script's own barrier after other writes, not after torch.save)."""
    from ddpkit.commands.convert.plan import plan

    result = plan(BEST)
    assert not [x for x in result.left if "barrier" in x.what + x.fix], [(x.line, x.what) for x in result.left]
    unwaited = plan(BEST.replace("        ddpkit.barrier()\n", ""))  # (waited for before the read: set 25's c/s06)
    assert not unwaited.left and "train(net, loader, 3)\nddpkit.barrier()\nnet.load_state_dict(" in unwaited.text


METER = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm


class AvgMeter:
    def __init__(self):
        self.total, self.n, self.avg = 0.0, 0, 0.0

    def add(self, value, n=1):
        self.total += value * n
        self.n += n
        self.avg = self.total / self.n


net = torch.nn.Linear(5, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 5), torch.randint(0, 2, (64,))), batch_size=16, shuffle=True)
for epoch in range(2):
    meter = AvgMeter()
    bar = tqdm(loader)
    for x, y in bar:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        meter.add(loss.item(), x.size(0))
        bar.set_postfix({"loss": meter.avg})
print(meter.avg)
'''


def test_a_meter_fed_by_add_and_shown_in_the_bar_is_said_and_its_mean_after_the_loop_reduced():
    """Set 24's CIFAR recipe (a/s01): ``loss_meter.add(loss.item(), n)`` each step (an ``AvgMeter``, fed by ``add``
    rather than ``update``) shown in the bar's postfix: rank 0's running share on screen, nothing said."""
    from ddpkit.commands.convert.plan import plan

    result = plan(METER)
    assert [x.line for x in result.kept if "shows the meter meter" in x.what] == [28], result.kept
    assert "ddpkit.reduce(meter.avg, op='mean')" in result.text, result.text


STEPS = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

net = torch.nn.Linear(6, 1)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
crit = torch.nn.MSELoss()


def step(x, y):
    opt.zero_grad()
    {loss}
    loss.backward()
    opt.step()
    return loss.item()


loader = DataLoader(TensorDataset(torch.randn(64, 6), torch.randn(64, 1)), batch_size=16, shuffle=True)
for epoch in range(2):
    history = []
    for x, y in loader:
        history.append(step(x, y))
    print(epoch, np.array(history).mean())
'''


def test_a_list_of_what_a_training_step_returns_is_averaged_step_by_step():
    """Set 24's LSGAN (a/s02): ``d_loss.append(self.train_discriminator(...))``, the step returning
    ``loss.item()``: the epoch's mean loss was printed from rank 0's halves, only "printed once" said (the same
    list filled with ``loss.item()`` in the loop itself was averaged across ranks)."""
    from ddpkit.commands.convert.plan import plan

    result = plan(STEPS.format(loss="loss = crit(net(x), y)"))
    assert "history = ddpkit.reduce(torch.tensor(history, dtype=torch.float64), op='mean').tolist()" in \
        result.text, result.text


def test_a_list_of_a_training_steps_loss_of_unknown_reduction_is_said():
    from ddpkit.commands.convert.plan import plan

    result = plan(STEPS.format(loss="real, fake = crit(net(x), y), crit(net(-x), y)\n    loss = real + fake"))
    assert "ddpkit.reduce(torch.tensor(history" not in result.text, result.text
    assert [x.line for x in result.kept if "history keeps this rank's loss step by step" in x.what] == [23], \
        [(x.line, x.what) for x in result.kept]


CLEAN = '''import os
import shutil
import torch
from torch.utils.data import DataLoader, TensorDataset

os.makedirs("run", exist_ok=True)
net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for x, y in DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
torch.save(net.state_dict(), "run/net.pth")
copy = torch.nn.Linear(4, 2)
copy.load_state_dict(torch.load("run/net.pth"))
if os.path.exists("run"):
    shutil.rmtree("run")
    print("removed")
'''


def test_a_clean_up_after_the_reads_waits_for_every_rank_before_and_after():
    """Set 24's lesson 14 (b/s05): the folder read back, then removed under ``if os.path.exists(d):`` with a print
    beside the removal. Convert guarded the removal, listed a barrier "after it", and rank 0 removed the folder
    while rank 1 still loaded from it (FileNotFoundError): the named fix did not help."""
    from ddpkit.commands.convert.plan import plan

    result = plan(CLEAN)
    lines = result.text.splitlines()
    at = lines.index('if os.path.exists("run"):')
    assert lines[at - 1] == "ddpkit.barrier()" and lines[at + 1] == "    if ddpkit.init().is_main:", result.text
    assert lines[at + 4] == "ddpkit.barrier()", result.text
    assert not [x for x in result.left if "rmtree" in x.what], result.left


HANDED_CRITERION = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def fit(net, loader, opt, criterion, epochs=2):
    for epoch in range(epochs):
        running = 0.0
        for x, y in loader:
            opt.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            opt.step()
            running += loss.item()
        running = running / len(loader)
        print(epoch, running)


net = torch.nn.Linear(4, 2)
data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8, shuffle=True)
fit(net, data, torch.optim.Adam(net.parameters()), {criterion})
'''


@pytest.mark.parametrize("criterion, averaged", [
    ("torch.nn.CrossEntropyLoss()", True),
    ("torch.nn.CrossEntropyLoss(reduction='sum')", False),
])
def test_a_criterion_handed_to_the_training_function_is_read_where_it_is_made(criterion, averaged):
    """Set 24's LSTM lesson and course project (b/s03, b/s04): ``train_loss / len(train_loader)`` in a training
    function whose criterion is a parameter was only named ("cannot tell what it adds up"); the same lines with the
    criterion bound at the top were averaged across ranks."""
    from ddpkit.commands.convert.plan import plan

    result = plan(HANDED_CRITERION.format(criterion=criterion))
    assert ("running = ddpkit.reduce(running, op='mean')" in result.text) == averaged, result.text


TWO_SAVES = '''import torch
from torch.utils.data import DataLoader, TensorDataset

net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)


def train(epochs):
    for epoch in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        if epoch == 1:
            torch.save(net.state_dict(), "best.pth")
        torch.save(net.state_dict(), "last.pth")


train(3)
net.load_state_dict(torch.load("best.pth"))
'''


def test_a_save_of_another_file_than_the_one_read_owes_no_barrier():
    """Set 24's CIFAR recipe (a/s01): the latest checkpoint saved each epoch beside the best one, only
    ``best.pth`` read after training; both saves were said to need a barrier ("maybe the one saved here")."""
    from ddpkit.commands.convert.plan import plan

    result = plan(TWO_SAVES)  # (best.pth waited for before its read, which every rank reaches: set 25's c/s06)
    assert not result.left and result.text.count("ddpkit.barrier()") == 1, result.text
    assert "train(3)\nddpkit.barrier()\nnet.load_state_dict(" in result.text, result.text


PREDICT = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def predict(net, data):
    loader = DataLoader(data, batch_size=len(data), shuffle=False)
    with torch.no_grad():
        for x, _ in loader:
            return net(x).argmax(1)


net = torch.nn.Linear(6, 3)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
train = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
for x, y in DataLoader(train, batch_size=8, shuffle=True):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
print(len(predict(net, TensorDataset(torch.randn(50, 6), torch.zeros(50)))))
'''


def test_an_evaluation_that_returns_from_inside_its_loop_keeps_its_loader_whole():
    """Set 24's Fashion-MNIST project (c/s05): ``predict()`` loads the whole test set as one batch and returns its
    argmax from inside the loop; made a sharded ``train=False`` loader, rank 0 wrote 25 of the 50 predictions."""
    from ddpkit.commands.convert.plan import plan

    result = plan(PREDICT)
    assert "loader = DataLoader(data, batch_size=len(data), shuffle=False)" in result.text, result.text
    assert [x.line for x in result.kept if "returns from inside the loop" in x.what], result.kept


WRAPPED_LOSS = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Runner:
    def __init__(self, net):
        self.net, self.loss_function = net, torch.nn.functional.cross_entropy

    def fit(self, opt, data):
        return fit(self.net, opt, data, self.loss_function)


def fit(net, opt, data, loss_function):
    running, seen = 0.0, 0
    for x, y in DataLoader(data, batch_size=16, shuffle=True):
        opt.zero_grad()
        loss = loss_function(net(x), y)
        loss.backward()
        opt.step()
        running += loss.item()
        seen += y.size(0)
    return running / seen


net = torch.nn.Linear(8, 3)
print(Runner(net).fit(torch.optim.SGD(net.parameters(), lr=0.1), TensorDataset(torch.randn(64, 8),
                                                                                torch.randint(0, 3, (64,)))))
'''


def test_a_loss_function_kept_on_the_object_and_handed_in_is_a_batch_mean():
    """Set 24's Fashion-MNIST project (c/s05): ``self.loss_function = F.nll_loss`` handed to the training
    function, whose ``running_loss += loss.item()`` was then summed across ranks as a sample sum (the printed loss
    twice one process's)."""
    from ddpkit.commands.convert.plan import plan

    result = plan(WRAPPED_LOSS)
    assert "running = ddpkit.reduce(running, op='mean')" in result.text, result.text


PICKLED = '''import joblib
import torch


def load_data():
    return joblib.load("loader.pkl")


loader = load_data()
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
'''


def test_a_loader_loaded_from_a_file_is_refused_with_that_cause():
    """Set 24's LSGAN (a/s02): its DataLoader pickled by another script and ``joblib.load``-ed in a helper; the
    refusal said "fed by hand" and sent the user to build a Dataset."""
    from ddpkit.commands.convert.plan import plan

    result = plan(PICKLED)
    said = [x for x in result.left if x.blocks]
    assert len(said) == 1 and "loaded from a file (joblib.load at line 6)" in said[0].what and \
        "DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=True)" in said[0].fix, said


def test_a_copy_written_deeper_than_the_project_says_what_finds_paths_from_its_own_file(tmp_path):
    """Set 24's LSTM lesson (b/s03): ``-o ddp_out`` inside src/ moved ``__file__`` one folder down and the data
    two folders above it was not found (FileNotFoundError at launch), nothing said."""
    import subprocess
    import sys

    src = tmp_path / "src"
    src.mkdir()
    (src / "data.py").write_text("import os\nROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n")
    (src / "main.py").write_text("import data\nprint(data.ROOT)\n")
    done = subprocess.run([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", "ddp_out", "main.py"],
                          cwd=src, capture_output=True, text=True)
    assert "data.py makes paths from __file__ (line 2)" in done.stderr, done.stderr
    beside = subprocess.run([sys.executable, "-m", "ddpkit", "convert", "--imports", "-o", "../src_ddp", "main.py"],
                            cwd=src, capture_output=True, text=True)
    assert "__file__" not in beside.stderr, beside.stderr


DX = '''import torch
from torch.utils.data import DataLoader, TensorDataset

net = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Sigmoid())
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
crit = torch.nn.BCELoss()
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)).float()), batch_size=16, shuffle=True)
for i, (x, y) in enumerate(loader):
    net.zero_grad()
    out = net(x).view(-1)
    err = crit(out, y)
    err.backward()
    D_x = out.mean().item()
    opt.step()
    print("[%d] loss %.4f D(x) %.4f" % (i, err.item(), D_x))
'''


def test_a_score_of_the_models_output_reshaped_is_said_beside_the_loss():
    """Set 24's DCGAN (b/s01): ``output = netD(real).view(-1)`` then ``D_x = output.mean().item()`` printed beside
    the losses; the kept line named the losses only (a model's output read through ``.view`` was not followed)."""
    from ddpkit.commands.convert.plan import plan

    said = [x.what for x in plan(DX).kept if x.line == 15]
    assert said and "D_x, of the model's outputs on the batch" in said[0], said


def test_a_phase_dicts_val_loader_also_tested_by_its_own_name_stays_whole():
    """The after-fix re-run of set 24: the val loader put in the phase dict was also looped by a last test under
    its own name, so it was sharded (``train=False``) while the phase loop reduced its sums for 'train' only: the
    val loss and accuracy printed about half. It now stays whole, for the phase loop and the test alike."""
    from ddpkit.commands.convert.plan import plan

    tail = "hits = 0\nwith torch.no_grad():\n    for x, y in val_loader:\n" \
        "        hits += (net(x).argmax(1) == y).sum().item()\nprint(hits / len(va))\n"
    result = plan(PHASES + tail)
    assert "val_loader = DataLoader(va, batch_size=8)" in result.text, result.text
    assert "loss_sum = ddpkit.reduce(loss_sum) if phase == 'train' else loss_sum" in result.text, result.text
    assert "hits = ddpkit.reduce(hits)" not in result.text, result.text


def test_a_list_of_a_steps_returns_appended_in_a_try_is_averaged():
    """The after-fix re-run of set 24 (LSGAN): ``l = step(x, y)`` then ``try: losses.append(l)``: the append inside
    the ``try`` was no step's own, so the list stayed rank 0's, unsaid."""
    from ddpkit.commands.convert.plan import plan

    source = STEPS.format(loss="loss = crit(net(x), y)").replace(
        "        history.append(step(x, y))\n",
        "        value = step(x, y)\n        try:\n            history.append(value)\n        except ValueError:\n"
        "            pass\n")
    assert "history = ddpkit.reduce(torch.tensor(history" in plan(source).text
