# Style: argparse + python -m torch.distributed.launch (the pre-torchrun recipe).
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)  # expect: DDP012
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

dist.init_process_group(backend="nccl", rank=args.local_rank, world_size=2)  # expect: DDP009 DDP013
model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU())
model = DDP(model.cuda(args.local_rank), device_ids=[args.local_rank])  # expect: DDP005
train_set = datasets.CIFAR10("data", train=True, transform=transforms.ToTensor())
val_set = datasets.CIFAR10("data", train=False, transform=transforms.ToTensor())
sampler = DistributedSampler(train_set)  # expect: DDP001
loader = DataLoader(train_set, batch_size=64, sampler=sampler, shuffle=True)  # expect: DDP002
val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set))  # expect: DDP001 DDP003
writer = SummaryWriter("runs")  # expect: DDP006
for epoch in range(args.epochs):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        loss.backward()
    torch.save(model.state_dict(), f"ckpt_{epoch}.pt")  # expect: DDP007
