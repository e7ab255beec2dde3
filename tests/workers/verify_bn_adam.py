"""A BatchNorm CNN trained with Adam, as public CIFAR scripts write it: each conv keeps its bias right before its
BatchNorm (a weight whose exact gradient is 0: float noise that Adam turns into lr-sized steps).

``verify_bn_adam.py [--local-bn] [--own-adam] [--own-dataset] [--forward-call] [--pad]``: ``--local-bn`` keeps each
rank's own BatchNorm statistics (``sync_batchnorm=False``), a real difference from one process that verify must
still FAIL; ``--own-adam`` steps a subclass of Adam and saves the whole model first (verify's float64 hooks must
pickle); ``--l1-bn`` adds network-slimming's L1 subgradient to every ``nn.BatchNorm2d`` weight's gradient after
backward (found by ``isinstance`` on the prepared model); ``--forward-call`` calls ``model.forward(x)``;
``--mask-float`` makes a float32 tensor in the model's forward that meets its output in a ``bmm``;
``--own-dataset`` serves the samples, randomly flipped, from a Dataset class of the script's (ddpkit's loader then
fetches them in worker processes, as network-slimming's did); ``--pad`` zero-pads the first BatchNorm's output
before a 1x1 conv and a second BatchNorm + ReLU (DeepLabV3+'s MobileNetV2: the padded border's BatchNorm output is
a rounding error's sign at step 1, which decides its ReLU, in float64 too).
"""
import os
import sys
import tempfile

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
ddpkit.init(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(128, 3, 8, 8, generator=g), torch.randint(0, 10, (128,), generator=g))
if "--own-dataset" in sys.argv:
    class Images(torch.utils.data.Dataset):
        def __init__(self, tensors):
            self.x, self.y = tensors

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):  # a random flip, as a CIFAR script's transform makes it
            return (self.x[i].flip(-1) if torch.rand(()) < 0.5 else self.x[i]), self.y[i]

    data = Images(data.tensors)
net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                    nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(), nn.Linear(16, 10))
if "--pad" in sys.argv:
    class Pad(nn.Module):
        def forward(self, x):
            return nn.functional.pad(x, (1, 1, 1, 1))

    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), Pad(),
                        nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(16, 10))
if "--mask-float" in sys.argv:
    class Centred(nn.Module):  # a float32 tensor made in forward meets the model's own in a bmm (R-BERT's masks)
        def __init__(self, body):
            super().__init__()
            self.body = body

        def forward(self, x):
            out = self.body(x)
            weights = torch.ones(out.shape[0], 1, out.shape[1]).float() / out.shape[1]
            return out - torch.bmm(weights, out.unsqueeze(2)).squeeze(2)

    net = Centred(net)
model = ddpkit.prepare_model(net, sync_batchnorm="--local-bn" not in sys.argv)
if "--own-adam" in sys.argv:
    class OwnAdam(torch.optim.Adam):
        pass

    opt = OwnAdam(model.parameters(), lr=1e-3)
    torch.save(ddpkit.unwrap(model), os.path.join(tempfile.mkdtemp(), "initial.pt"))
else:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for x, y in ddpkit.data_loader(data, batch_size=16):
    # --forward-call: ``model.forward(x)``, as old scripts write it (the model's own hooks do not run)
    loss = nn.functional.cross_entropy(model.forward(x) if "--forward-call" in sys.argv else model(x), y)
    opt.zero_grad()
    loss.backward()
    if "--l1-bn" in sys.argv:
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.grad.data.add_(1e-2 * torch.sign(m.weight.data))
    opt.step()
