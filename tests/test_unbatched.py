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


TIME_MAJOR = '''import sys
import torch
from torch import nn
from torch.utils.data import TensorDataset
import ddpkit

ddpkit.init(seed=0)


class Net(nn.Module):  # closeheat's text generator: (batch, seq) ids, embedded, into an LSTM left time-major
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.lstm = nn.LSTM(4, 8)
        self.out = nn.Linear(8, 10)

    def forward(self, x):
        e = self.embedding(x)
        if "--time-major" in sys.argv:  # (seq, batch, features): what batch_first=False reads
            e = e.transpose(0, 1)
        h, _ = self.lstm(input=e) if "--keyword" in sys.argv else self.lstm(e)
        return self.out(h)


model = ddpkit.prepare_model(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
for (x,) in ddpkit.data_loader(TensorDataset(torch.randint(0, 10, (24, 3), generator=g)), global_batch_size=12):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
ddpkit.print("done")
'''


def test_a_batch_major_input_to_a_time_major_lstm_is_said_once_and_a_time_major_one_is_not(tmp_path):
    """closeheat's LSTM tutorial (sixteenth set): (batch, seq) ids embedded and handed to nn.LSTM without
    batch_first: the recurrence runs across the batch's samples, each rank's share at N processes (verify FAILed,
    nothing said why). The loader's batch per process (6) on the time axis, not on the batch axis: said."""
    (tmp_path / "train.py").write_text(TIME_MAJOR)
    r = ok(launch(tmp_path / "train.py", "--keyword", timeout=120, cwd=tmp_path))  # (``self.lstm(input=e)``)
    said = [line for line in r.stderr.splitlines() if "batch_first=False) got" in line]
    assert len(said) == 1 and "'lstm' (LSTM, batch_first=False) got (6, 3, 4)" in said[0], r.stderr[-3000:]
    assert "6 is the training loader's batch per process" in said[0], said
    r = ok(launch(tmp_path / "train.py", "--time-major", timeout=120, cwd=tmp_path))
    assert "batch_first=False) got" not in r.stderr and "done" in r.stdout, r.stderr[-3000:]


def test_the_batch_on_the_time_axis_is_told_by_the_last_training_loader():
    """Reviews: a sequence length that is a multiple of the batch is said (review 23: the common case); the batch
    size of a sweep's earlier run is forgotten (the last loader's only)."""
    import torch
    from torch import nn

    from ddpkit.core import process
    from ddpkit.strategies.unbatched import _batch_as_time

    lstm, proc = nn.LSTM(4, 8), process.current()
    before = proc.train_batch
    try:
        proc.train_batch = 4
        assert _batch_as_time(lstm, torch.zeros(4, 3, 4)) and _batch_as_time(lstm, torch.zeros(4, 32, 4))
        assert not _batch_as_time(lstm, torch.zeros(4, 4, 4))  # (the same size on both axes: nothing told)
        assert not _batch_as_time(nn.LSTM(4, 8, batch_first=True), torch.zeros(4, 3, 4))
        proc.train_batch = 6  # (a second run of a sweep: 4 no longer counts)
        assert not _batch_as_time(lstm, torch.zeros(4, 3, 4)) and _batch_as_time(lstm, torch.zeros(6, 4, 4))
    finally:
        proc.train_batch = before


def test_verify_names_the_rnn_note_under_its_fail(tmp_path):
    """closeheat's re-run: verify FAILed, rightly, and its cause line listed generic causes while the N-process run
    had said what is wrong; the note now follows the FAIL."""
    import sys

    from conftest import run_cmd

    (tmp_path / "train.py").write_text(TIME_MAJOR)
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "2", "train.py"], timeout=400,
                cwd=str(tmp_path))
    assert r.returncode != 0 and "FAIL" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "the 2-process run said: ddpkit: 'lstm' (LSTM, batch_first=False) got (6, 3, 4)" in r.stdout, r.stdout
