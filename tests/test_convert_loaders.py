"""Training loaders in the shapes the third held-out set showed (issue 44), read as "batches fed by hand" before:
a DataLoader subclass of the script's own (refused now with its true cause and a fix that converts), and torch's
names through ``from torch.utils.data import *`` (converted). In process, on small scripts."""
import textwrap

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

SUBCLASS = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class BaseLoader(DataLoader):
    def __init__(self, ds, batch_size, shuffle=True):
        super().__init__(ds, batch_size=batch_size, shuffle=shuffle)


class MnistLoader(BaseLoader):
    pass


ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = MnistLoader(ds, 8)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_a_dataloader_subclass_is_refused_for_what_it_is_with_a_fix_that_converts():
    result = plan(textwrap.dedent(SUBCLASS))
    assert result.refused, result.text
    said = [x for x in result.left if x.blocks]
    assert len(said) == 1 and "loader = MnistLoader(...), a subclass of DataLoader" in said[0].what, said
    assert "fed by hand" not in said[0].what and said[0].line == 17, said
    assert "ddpkit.data_loader(dataset, global_batch_size=B" in said[0].fix
    fixed = plan(textwrap.dedent(SUBCLASS).replace("loader = MnistLoader(ds, 8)",
                                                   "loader = ddpkit.data_loader(ds, global_batch_size=8)")
                 .replace("import torch\n", "import torch\nimport ddpkit\n", 1))
    assert not fixed.refused and "model = ddpkit.prepare_model(nn.Linear(4, 1))" in fixed.text, fixed.left


@pytest.mark.parametrize("imports", ["from torch.utils.data import *\nfrom torch.optim import *\n",
                                     "from torch.utils.data import *\nfrom torch.optim import SGD\n"])
def test_torch_names_through_a_star_import_convert(imports):
    source = ("import torch\nfrom torch import nn\n" + imports +
              "ds = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
              "loader = DataLoader(ds, batch_size=8, shuffle=True)\nmodel = nn.Linear(4, 1)\n"
              "opt = SGD(model.parameters(), lr=0.1)\nfor x, y in loader:\n    opt.zero_grad()\n"
              "    nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n")
    result = plan(source)
    assert not result.refused and not result.left, result.left
    assert "loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=True)" in result.text, result.text
    assert "model = ddpkit.prepare_model(nn.Linear(4, 1))" in result.text, result.text
