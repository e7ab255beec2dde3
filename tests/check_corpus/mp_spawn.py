# Style: torch.multiprocessing.spawn, one process per GPU, with an evaluation that forgets to reduce.
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def worker(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train_set = TensorDataset(torch.randn(512, 8), torch.randint(0, 3, (512,)))
    test_set = TensorDataset(torch.randn(100, 8), torch.randint(0, 3, (100,)))
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = DistributedDataParallel(nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch} loss {loss.item():.3f}")  # expect: DDP017
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f}")  # rank 0 only: fine
        print(f"[rank {rank}] epoch {epoch} local loss {loss.item():.3f}")  # names its rank: per-rank on purpose
    shard = torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size))
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=50):
            correct += (model(x).argmax(1) == y).sum().item()
    accuracy = correct / len(test_set)  # expect: DDP018
    total = torch.tensor([correct])
    dist.all_reduce(total)
    reduced_accuracy = total.item() / len(test_set)  # reduced first: fine
    if rank == 0:
        print(f"accuracy {accuracy:.3f} / {reduced_accuracy:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2,), nprocs=2)
