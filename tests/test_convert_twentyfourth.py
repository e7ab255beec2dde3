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
