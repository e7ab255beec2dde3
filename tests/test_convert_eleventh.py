"""What the experiment classes of the time-series forecasting repositories, and the eleventh held-out set
(docs/convert.md), showed ``ddpkit convert`` owes public scripts: each a case written in our own words after the
pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

BASIC = '''import torch
from torch import nn


class Exp_Basic(object):
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cpu")
        self.model = self._build_model().to(self.device)

    def _build_model(self):
        raise NotImplementedError
'''

MAIN = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from exp.exp_basic import Exp_Basic


class Exp_Main(Exp_Basic):
    def _build_model(self):
        return nn.Linear(8, 1)

    def train(self):
        loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4, shuffle=True)
        opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(self.model(x.to(self.device)), y).backward()
            opt.step()
'''


def test_a_model_its_base_class_builds_in_another_module_is_wrapped_there():
    """Time-Series-Library's ``Exp_Main(Exp_Basic)``: the optimizer over ``self.model`` in the subclass, the model
    built by ``Exp_Basic.__init__`` in exp/exp_basic.py. Refused as "where it is built was not found"."""
    files = {"exp/exp_basic.py": BASIC, "exp/exp_main.py": MAIN, "exp/__init__.py": ""}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done["exp/exp_basic.py"].text
    assert not done["exp/exp_main.py"].left, done["exp/exp_main.py"].left
    assert any("a base class builds" in k.what for k in done["exp/exp_main.py"].kept)
    alone = plan(MAIN)  # converted alone: said, with the module to convert with it
    assert any("Exp_Basic, a base class imported from exp.exp_basic" in item.what for item in alone.left), alone.left


def test_a_model_a_base_class_of_the_same_file_builds_is_wrapped_in_it():
    one = BASIC.replace("from torch import nn\n", "from torch import nn\nfrom torch.utils.data import DataLoader, "
                        "TensorDataset\n") + MAIN.split("import Exp_Basic\n")[1]
    done = plan(one)
    assert done.text.count("ddpkit.prepare_model(") == 1, done.text
    assert "self.model = ddpkit.prepare_model(self._build_model())" in done.text and not done.left, done.left
