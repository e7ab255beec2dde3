"""What the fourteenth held-out set's scripts showed ``ddpkit convert`` owes public scripts (docs/convert.md):
each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

DEVICE_BUILT = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--device", type=int, default=0)
args = parser.parse_args()
device = {device}
model = nn.Linear(4, 2).to(device)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8, shuffle=True)
for x, y in loader:
    loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("device", [
    'torch.device("cuda:" + str(args.device)) if torch.cuda.is_available() else torch.device("cpu")',
    'torch.device("cuda:%d" % args.device if torch.cuda.is_available() else "cpu")',
])
def test_a_device_string_built_from_the_gpu_index_is_read_as_the_accelerator(device):
    p = plan(DEVICE_BUILT.format(device=device))
    assert not p.left, p.left
    assert "state = ddpkit.init()\ndevice = state.device\n" in p.text, p.text
    assert "ddpkit.prepare_model(nn.Linear(4, 2))" in p.text
