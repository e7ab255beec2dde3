"""Script shapes that ``ddpkit verify`` met in public scripts (issue 26), one per ``--case``.

- seq: a small Transformer encoder and a 2-layer LSTM, both with dropout given as floats (not Dropout
  modules), trained by a Trainer-style loop that re-creates its iterator on StopIteration: must PASS.
- attn: a Transformer encoder trained with AdamW. Softmax ignores a constant added to every key, so the key
  part of ``in_proj_bias`` has an exactly-zero gradient whose float noise differs between 1 process and N;
  AdamW's first steps move a weight by about lr whatever its gradient's size: must PASS, saying so.
- global: ``data_loader(global_batch_size=16)``: must PASS (the one-process run must not scale it again).
- noise: a VAE-style sampling noise drawn in forward (torch.randn_like): must PASS, by the re-run with the draws
  matched (verify/matched.py).
- noisefirst: noise drawn before the step's first forward, as a GAN draws z: must PASS the same way.
- noisenp: the VAE's noise drawn from numpy, which verify cannot match: cannot compare exactly, saying that a
  one-process re-run with other draws is as far from the first.
- noisebug: the same noise 100x smaller, and rank 1's loss 10x (a rank-dependent scale): must FAIL, beyond what
  the draws make.
- noisekl: the VAE's noise, and a second term weighted by the batch's own size over the data's (a KL weight of
  ``x.size(0) / len(data)``, halved per rank): within what other draws make, yet apart with the draws matched,
  in float64 too: must FAIL, decided by the matched re-run (it was "cannot compare exactly", held-out set 25).
- noisesum: the VAE's noise and a loss summed over the batch (DDP averages the ranks' halves): must FAIL, the
  step-1 gradients a factor of 2 apart with the draws matched (it was "cannot compare exactly", held-out set 28).
- augpy / augnp: a Dataset whose ``__getitem__`` augments each sample with Python's ``random`` (in this process) /
  numpy's global generator (in a loader worker): a random flip and scale, as public scripts write by hand: cannot
  compare exactly, not a FAIL.
- augown / augseeded: the same augmentation drawn from a generator of the dataset's own, seeded by the OS in a
  loader worker (``np.random.default_rng()``, as albumentations' ``Compose`` without ``seed=``) / with a fixed seed
  in this process (``default_rng(0)``: its draws follow the order of the fetches): sample i differs when fetched
  twice alike, so no run matches another: cannot compare exactly, naming that dataset, not a FAIL.
- augtorch: the augmentation drawn from torch's generator in this process (torchvision's RandomHorizontalFlip
  draws ``torch.rand(1)``) and a GAN's z drawn in the step: the re-run with the step's draws matched must leave
  the fetch's draws alone (it made each rank's samples alike, a FAIL or "cannot compare"): must PASS.
- handshard: batches sharded by hand (no ddpkit loader), as an LSTM LM's batchified columns: verify refuses.
- noprepare: a ddpkit loader, but the model is not prepared: verify refuses.
- badbytes: prints bytes that are not UTF-8, then fails: verify shows the output's tail, no UnicodeDecodeError.
- gan: two prepared models, the first (G) trained with reduction='sum' (broken), the second (D) correctly:
  must FAIL at G's weights (only the last prepared model used to be compared: a false PASS).
- manual: a hand-written update (``q -= 0.1 * q.grad``, no torch.optim): must PASS capped at K batches.
- phases: a 2-step warm-up optimizer, then another for 5 epochs: the cap must stop at K main steps.
- bnplain: BatchNorm without sync (a real difference) and an eval on a plain DataLoader (whose iter() draws
  a seed from the global generator): the FAIL must name rank-dependent code, not random draws.
- exit: a short loop, then os._exit(0) (no shutdown hooks): verify refuses, saying the weights were never
  written (not "prepared no model").

    ddpkit verify tests/workers/verify_cases.py --case seq
"""
import argparse
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True, choices=["seq", "attn", "global", "noise", "handshard", "noprepare",
                                                     "badbytes", "gan", "manual", "phases", "bnplain", "exit",
                                                     "accum8", "peekbn", "noisebug", "noisefirst", "noisenp", "noisekl",
                                                     "noisesum",
                                                     "augpy",
                                                     "augnp", "augown", "augseeded", "augtorch"])
args = parser.parse_args()
torch.set_num_threads(1)
state = ddpkit.init()
g = torch.Generator().manual_seed(0)
if args.case == "badbytes":
    sys.stdout.buffer.write(b"loss 0.5 \xff\xfe caf\xe9\n")
    sys.stdout.flush()
    raise SystemExit("the data file is broken")


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.encoder = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.3, batch_first=True)
        self.lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.4, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        out, _ = self.lstm(self.encoder(self.embed(x)))
        return self.head(out[:, -1])


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.encoder = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x * 3))[:, -1])


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(4, 4), nn.Linear(2, 1)

    def forward(self, x):
        mu, logvar = self.enc(x.mean(1)).chunk(2, dim=1)
        noise = torch.randn_like(mu) * (0.01 if args.case == "noisebug" else 1.0)
        if args.case == "noisenp":
            import numpy as np

            noise = torch.from_numpy(np.random.standard_normal(tuple(mu.shape))).float()
        z = mu + noise * (0.5 * logvar).exp()  # the reparameterisation trick's noise
        return self.dec(z)


data = TensorDataset(torch.randn(64, 3, 4, generator=g), torch.randn(64, 1, generator=g))


class Augmented(torch.utils.data.Dataset):
    """Each sample flipped along its sequence half the time and scaled, drawn from Python's or numpy's generator."""

    def __init__(self, base):
        self.base = base
        if args.case in ("augown", "augseeded"):
            import numpy as np

            self.rng = np.random.default_rng(0 if args.case == "augseeded" else None)  # None: the OS seeds it

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        if args.case == "augpy":
            import random

            flip, scale = random.random() < 0.5, random.uniform(0.8, 1.2)
        elif args.case == "augtorch":
            flip, scale = torch.rand(1).item() < 0.5, float(torch.empty(1).uniform_(0.8, 1.2))
        elif args.case in ("augown", "augseeded"):
            flip, scale = self.rng.random() < 0.5, float(self.rng.uniform(0.8, 1.2))
        else:
            import numpy as np

            flip, scale = np.random.rand() < 0.5, float(np.random.uniform(0.8, 1.2))
        return (x.flip(0) if flip else x) * scale, y


if args.case in ("augpy", "augnp", "augown", "augseeded", "augtorch"):
    data = Augmented(data)
# shapes of a second review (issue 26.2), and of held-out set 22
if args.case in ("gan", "manual", "phases", "bnplain", "exit", "accum8", "peekbn"):
    import verify_shapes  # noqa: E402 (next to this file)
    verify_shapes.run(args.case, data, state)
    raise SystemExit(0)
net = {"noise": Noisy, "noisebug": Noisy, "noisenp": Noisy, "noisekl": Noisy, "noisesum": Noisy,
       "attn": Attn}.get(args.case, Seq)()
model = net if args.case == "noprepare" else ddpkit.prepare_model(net)
opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if args.case == "attn"
       else torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(x, y):
    if args.case in ("noisefirst", "augtorch"):  # drawn before the step's first forward, as a GAN draws z
        x = x + torch.randn_like(x)
    loss = nn.functional.mse_loss(model(x), y) * (1 + 9 * state.rank if args.case == "noisebug" else 1)
    if args.case == "noisesum":  # summed over the batch, as a VAE's ELBO often is: a per-rank batch halves it
        loss = nn.functional.mse_loss(model(x), y, reduction="sum")
    if args.case == "noisekl":  # a weight of the batch's share of the data: a per-rank batch halves it
        loss = loss + x.size(0) / len(data) * 0.5 * sum(p.pow(2).sum() for p in model.parameters())
    opt.zero_grad()
    loss.backward()
    opt.step()


if args.case == "handshard":  # every rank takes its own columns of the whole tensor, as batchify() does
    xs, ys = data.tensors
    for _epoch in range(2):
        for start in range(0, 64, 16):
            rows = slice(start + state.rank * 8 // state.world_size, start + (state.rank + 1) * 8 // state.world_size)
            train_step(xs[rows], ys[rows])
elif args.case == "global":
    for _epoch in range(2):
        for x, y in ddpkit.data_loader(data, global_batch_size=16):
            train_step(x, y)
else:  # a Trainer's endless loop: it stops at its own max_iters, verify's cap must stop it earlier and cleanly
    # augpy draws in this process, augnp in a loader worker (whose seeds are per rank)
    workers = {"augpy": 0, "augnp": 1, "augown": 1, "augtorch": 0}
    loader = ddpkit.data_loader(data, batch_size=8, **({"num_workers": workers[args.case]}
                                                       if args.case in workers else {}))
    it = iter(loader)
    for _ in range(1000):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        train_step(x, y)
