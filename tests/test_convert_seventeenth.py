"""What the sixteenth set left and the seventeenth held-out set showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

# a detector's criterion in the model's file: summed terms over the positives the step matched, divided by their count
POSITIVES = '''import torch
from torch import nn


class BoxLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.L1Loss()

    def forward(self, scores, classes):
        positive = classes != 0
        n_pos = positive.sum(dim=1)
        conf = nn.functional.cross_entropy(scores.flatten(0, 1), classes.flatten(), reduction="none")
        total = conf.sum() / n_pos.sum().float()
        return total
'''

MASKED_LOOP = '''import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(6, 6)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(32, 6), (torch.rand(32, 6) > 0.5).float(), torch.randn(32, 6))
for x, valid, t in DataLoader(data, batch_size=8, shuffle=True):
    opt.zero_grad()
    loss = (((model(x) - t) ** 2) * valid).sum() / valid.sum()
    acc = ((model(x) > 0) == (t > 0)).float().sum() / valid.sum()
    loss.backward()
    opt.step()
'''


def test_a_criterion_dividing_by_the_positives_it_matched_is_listed():
    """sgrvinod's SSD MultiBoxLoss: ``(hard_neg.sum() + pos.sum()) / n_positives.sum().float()``: each rank's sum
    over its own count (verify FAILed 7e-2, convert said nothing)."""
    p = plan(POSITIVES)
    assert [x.line for x in p.left] == [14], p.left
    assert "divided by a count its step takes of the batch (n_pos.sum().float())" in p.left[0].what, p.left
    assert "ddpkit.reduce(n_pos.sum().float(), op='mean')" in p.left[0].fix, p.left


def test_a_loss_over_a_mask_the_batch_brings_is_listed_and_an_accuracy_beside_it_is_not():
    p = plan(MASKED_LOOP)
    said = [x for x in p.left if "a count its step takes" in x.what]
    assert [x.line for x in said] == [9], p.left


@pytest.mark.parametrize("divisor", ["x.size(0)", "len(t)", "8", "len(loader.dataset)"])
def test_a_loss_divided_by_a_batch_size_is_not_a_count_of_a_mask(divisor):
    p = plan(MASKED_LOOP.replace("/ valid.sum()\n    acc", f"/ {divisor}\n    acc"))
    assert not [x for x in p.left if "a count its step takes" in x.what], p.left


def test_an_evaluation_under_no_grad_dividing_by_a_count_is_not_listed():
    p = plan(MASKED_LOOP + '''with torch.no_grad():
    for x, valid, t in DataLoader(data, batch_size=8):
        val_loss = (((model(x) - t) ** 2) * valid).sum() / valid.sum()
''')
    assert [x.line for x in p.left if "a count its step takes" in x.what] == [9], p.left


AVERAGED_LIST = '''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

use_amp = False
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters())
criterion = torch.nn.MSELoss()
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
for epoch in range(2):
    train_loss = []
    for x, y in loader:
        opt.zero_grad()
        if use_amp:
            with torch.autocast("cpu"):
                loss = criterion(model(x), y)
                train_loss.append(loss.item())
        else:
            loss = criterion(model(x), y)
            train_loss.append(loss.item())
        loss.backward()
        opt.step()
    train_loss = np.average(train_loss)
    print("Epoch: {} Train Loss: {:.7f}".format(epoch + 1, train_loss))
'''


def test_an_np_average_of_the_training_loops_list_is_averaged_across_ranks():
    """iTransformer (Time-Series-Library's Exp): ``train_loss = np.average(train_loss)`` of a list each step appends
    to (in the ``else`` of ``if use_amp``): printed as rank 0's mean, nothing said."""
    p = plan(AVERAGED_LIST)
    lines = p.text.splitlines()
    at = lines.index("    train_loss = np.average(train_loss)")
    assert lines[at + 1] == "    train_loss = ddpkit.reduce(train_loss, op='mean')", p.text


def test_a_split_the_factory_keeps_whole_is_not_said_to_see_a_shard():
    """iTransformer (and FEDformer before it): ``vali_data, vali_loader = self._get_data(flag='val')`` handed to
    ``self.vali(vali_data, vali_loader, criterion)``, as the test split is, through the same method: the factory
    keeps the 'val' split a whole DataLoader (``if flag == 'train' else DataLoader``), yet the experiment was told
    vali_loader "sees this rank's shard only"."""
    from test_convert_eleventh import EXPERIMENT, FORECAST

    from ddpkit.commands.convert.crossing import settle

    experiment = EXPERIMENT.replace('_, vali_loader = self._get_data(flag="val")',
                                    'vali_data, vali_loader = self._get_data(flag="val")\n'
                                    '        test_data, test_loader = self._get_data(flag="test")')
    experiment = experiment.replace("def vali(self, vali_loader):", "def vali(self, vali_data, vali_loader):")
    experiment = experiment.replace('print("epoch", epoch, "vali", self.vali(vali_loader))',
                                    'print("epoch", epoch, "vali", self.vali(vali_data, vali_loader), '
                                    '"test", self.vali(test_data, test_loader))')
    assert experiment.count("vali_data") == 3 and experiment.count("test_loader") == 2
    files = dict(FORECAST, **{"exp/exp_main.py": experiment})
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert ") if flag == 'train' else" in done["data_provider/data_factory.py"].text
    said = [item.what for item in done["exp/exp_main.py"].left]
    assert not any("shard only" in w for w in said), said
