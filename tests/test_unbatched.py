"""An LSTM fed a loader's 2-D ``(batch, features)`` rows reads them as one sequence: at N processes each rank
trains on another sequence (ML-LSTM, the fifteenth held-out set: verify FAILed and nothing said why). Said once,
at the first training forward, and not for a batched 3-D input."""
from conftest import launch, ok

SCRIPT = '''import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit

ddpkit.init(seed=0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        if "--batched" in sys.argv:
            x = x.unsqueeze(1)
        h, _ = self.lstm(x)
        return self.out(h.reshape(-1, 8))


model = ddpkit.prepare_model(Net())
torch.save(ddpkit.unwrap(model), "initial.pt")  # (a whole model saved before the first step still pickles)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
for x, y in ddpkit.data_loader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)),
                               global_batch_size=8):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
ddpkit.print("done")
'''


def test_a_two_dimensional_batch_to_an_lstm_is_said_once_and_a_batched_one_is_not(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    r = ok(launch(tmp_path / "train.py", timeout=120, cwd=tmp_path))
    said = [line for line in r.stderr.splitlines() if "got a 2-D input" in line]
    assert len(said) == 1 and "'lstm' (LSTM) got a 2-D input (4, 4)" in said[0], r.stderr[-3000:]
    assert "one sequence of 4 steps" in said[0], said
    r = ok(launch(tmp_path / "train.py", "--batched", timeout=120, cwd=tmp_path))
    assert "got a 2-D input" not in r.stderr, r.stderr[-3000:]
