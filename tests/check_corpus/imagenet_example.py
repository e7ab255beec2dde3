# Style: the shape of PyTorch's ImageNet example (examples/imagenet/main.py): mp.spawn or torchrun, an evaluation
# DistributedSampler with drop_last=True whose remainder validate() evaluates through a Subset of
# val_loader.dataset, meters all-reduced, checkpoints written by one rank. Right as written: nothing to report.
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import Subset
from torchvision import datasets, models, transforms

parser = argparse.ArgumentParser()
parser.add_argument("--world-size", default=-1, type=int)
parser.add_argument("--rank", default=-1, type=int)
parser.add_argument("--dist-url", default="env://")
parser.add_argument("--dist-backend", default="nccl")
parser.add_argument("--gpu", default=None, type=int)
parser.add_argument("--multiprocessing-distributed", action="store_true")
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("-b", "--batch-size", default=256, type=int)


class AverageMeter:
    def __init__(self, name):
        self.name, self.sum, self.count, self.avg = name, 0.0, 0, 0.0

    def update(self, val, n=1):
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        total = torch.tensor([self.sum, self.count], dtype=torch.float32, device=device)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count


def main():
    args = parser.parse_args()
    if args.dist_url == "env://" and args.world_size == -1:
        args.world_size = int(os.environ["WORLD_SIZE"])
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus_per_node = torch.cuda.device_count()
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(args.gpu, ngpus_per_node, args)


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if args.distributed:
        if args.dist_url == "env://" and args.rank == -1:
            args.rank = int(os.environ["RANK"])
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    model = models.resnet18()
    torch.cuda.set_device(args.gpu)
    model.cuda(args.gpu)
    args.batch_size = int(args.batch_size / ngpus_per_node)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    criterion = nn.CrossEntropyLoss().cuda(args.gpu)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    train_dataset = datasets.FakeData(1281167, (3, 224, 224), 1000, transforms.ToTensor())
    val_dataset = datasets.FakeData(50000, (3, 224, 224), 1000, transforms.ToTensor())
    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    else:
        train_sampler = None
        val_sampler = None
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               shuffle=(train_sampler is None), sampler=train_sampler)
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                                             sampler=val_sampler)
    best_acc1 = 0
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, args)
        acc1 = validate(val_loader, model, criterion, args)
        best_acc1 = max(acc1, best_acc1)
        if not args.multiprocessing_distributed or (args.multiprocessing_distributed
                                                    and args.rank % ngpus_per_node == 0):
            save_checkpoint({"epoch": epoch + 1, "state_dict": model.state_dict(), "best_acc1": best_acc1})


def train(train_loader, model, criterion, optimizer, args):
    model.train()
    for images, target in train_loader:
        images, target = images.cuda(args.gpu, non_blocking=True), target.cuda(args.gpu, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def validate(val_loader, model, criterion, args):
    def run_validate(loader):
        with torch.no_grad():
            for images, target in loader:
                images, target = images.cuda(args.gpu, non_blocking=True), target.cuda(args.gpu, non_blocking=True)
                output = model(images)
                losses.update(criterion(output, target).item(), images.size(0))
                top1.update((output.argmax(1) == target).float().mean().item() * 100, images.size(0))

    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.eval()
    run_validate(val_loader)
    if args.distributed:
        top1.all_reduce()
        losses.all_reduce()
    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(val_loader.dataset,
                                 range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)))
        aux_val_loader = torch.utils.data.DataLoader(aux_val_dataset, batch_size=args.batch_size, shuffle=False)
        run_validate(aux_val_loader)
    return top1.avg


def save_checkpoint(state, filename="checkpoint.pth.tar"):
    torch.save(state, filename)


if __name__ == "__main__":
    main()
