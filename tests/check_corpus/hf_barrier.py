# Style: a Hugging Face example script (the run_glue.py generation): local_rank -1 means "not distributed", the
# first process downloads and caches while the others wait at a barrier, then rank 0 joins that same barrier
# to release them. Every rank calls barrier() once: right as written, nothing to report.
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def load_and_cache_examples(local_rank, cache, evaluate=False):
    if local_rank not in [-1, 0] and not evaluate:
        torch.distributed.barrier()  # only the first process builds the cache; the others use it
    if os.path.exists(cache):
        features = torch.load(cache, "cpu")
    else:
        features = torch.randn(256, 16)
        if local_rank in [-1, 0]:
            torch.save(features, cache)
    if local_rank == 0 and not evaluate:
        torch.distributed.barrier()  # the cache is written: release the others
    return TensorDataset(features, torch.randint(0, 2, (len(features),)))


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if local_rank == -1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.distributed.init_process_group(backend="nccl")
    if local_rank not in [-1, 0]:
        torch.distributed.barrier()  # the first process downloads the model and vocabulary
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    if local_rank == 0:
        torch.distributed.barrier()
    model.to(device)
    train_dataset = load_and_cache_examples(local_rank, "cached_train")
    train_sampler = RandomSampler(train_dataset) if local_rank == -1 else DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, sampler=train_sampler, batch_size=32)
    if local_rank != -1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    tb_writer = SummaryWriter() if local_rank in [-1, 0] else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    for epoch in range(3):
        if local_rank != -1:
            train_sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(train_loader):
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if local_rank in [-1, 0] and step % 50 == 0:
                tb_writer.add_scalar("loss", loss.item(), step)
                print(f"step {step} loss {loss.item():.4f}")
    if local_rank in [-1, 0]:
        torch.save(model.state_dict(), "pytorch_model.bin")


if __name__ == "__main__":
    main()
