"""A CIFAR-style ResNet trained with SGD (lr 0.1, momentum 0.9, weight decay), as public CIFAR repositories write
it: residual blocks of conv + BatchNorm, an option-A shortcut (a strided slice padded with zero channels). Correct
as converted, yet in float32 its 2-process weights end ~6e-5 from one process's after 5 steps, beyond verify's
tolerance (2e-3 with 32 x 32 images and 9 blocks): the one-process BatchNorm sums 32 x 16 x 16 values a channel
in float32, the synchronised one merges the ranks' statistics in float64, and 9 BatchNorm layers at lr 0.1 grow
that rounding. In float64 the runs agree to ~1e-15.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

torch.set_num_threads(1)
ddpkit.init(seed=0)


class Block(nn.Module):
    def __init__(self, planes_in: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(planes_in, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad = planes - planes_in

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        shortcut = F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad // 2, self.pad // 2)) if self.pad else x
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.layers = nn.Sequential(Block(16, 16, 1), Block(16, 16, 1), Block(16, 32, 2), Block(32, 32, 1))
        self.fc = nn.Linear(32, 10)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x):
        x = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(512, 3, 16, 16, generator=g), torch.randint(0, 10, (512,), generator=g))
model = ddpkit.prepare_model(ResNet())
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
for x, y in ddpkit.data_loader(data, batch_size=32, shuffle=True):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
