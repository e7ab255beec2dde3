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
