"""Training datasets built on every rank, the ways scripts build them.

``same_data.py CASE``: ``unseeded`` draws its samples at random with no seed; ``split`` splits a seeded dataset
with an unseeded ``random_split``; ``init_seed`` draws them after ``ddpkit.init(seed=0)`` (its streams differ per
rank); ``seeded`` seeds torch first and ``seeded_split`` gives the split a generator: both train, the same on
every rank; ``concat`` joins two seeded parts; ``texts`` is a Dataset of its own holding a list of texts that
python's ``random.shuffle`` shuffled with no seed (character-based-cnn's unseeded ``DataFrame.sample(frac=1)``),
``texts_sorted`` the same list in order.
"""
import random
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, TensorDataset, random_split

import ddpkit

case = sys.argv[1]
torch.set_num_threads(1)
ddpkit.init(seed=0 if case == "init_seed" else None)
if case == "seeded":
    torch.manual_seed(0)
if case in ("unseeded", "init_seed", "seeded"):  # drawn from torch's global generator
    data = TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
else:  # the same on every rank: its own generator (as a dataset read from files is)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
if case == "split":  # torch's global generator: seeded differently in each process
    data, _ = random_split(data, [48, 16])
elif case == "seeded_split":
    data, _ = random_split(data, [48, 16], generator=torch.Generator().manual_seed(1))
elif case == "concat":
    data = ConcatDataset([data, data])
elif case.startswith("texts"):
    class Texts(torch.utils.data.Dataset):
        def __init__(self, texts, labels):
            self.texts, self.labels = texts, labels

        def __len__(self):
            return len(self.texts)

        def __getitem__(self, i):
            return torch.tensor([float(ord(c)) for c in self.texts[i][:6]]), self.labels[i]

    pairs = [(f"text {i:03d}", i % 3) for i in range(64)]
    if case == "texts":
        random.shuffle(pairs)  # python's generator: seeded from the OS in each process
    data = Texts([t for t, _ in pairs], [y for _, y in pairs])
model = ddpkit.prepare_model(torch.nn.Linear(6, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in ddpkit.data_loader(data, batch_size=8):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
print("trained")
