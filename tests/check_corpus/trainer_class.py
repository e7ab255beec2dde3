# Style: PyTorch's DDP tutorial shape, a Trainer class whose writes sit in methods and functions that are only
# called under a rank condition (fine), and one collective that is only called there too (a hang).
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def save_checkpoint(state, path):
    torch.save(state, path)  # its only call site is guarded: one writer


class Trainer:
    def __init__(self, model, loader, gpu_id, save_every):
        self.gpu_id = gpu_id
        self.model = DDP(model.to(gpu_id), device_ids=[gpu_id])
        self.loader, self.save_every = loader, save_every
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def _save_checkpoint(self, epoch):
        torch.save(self.model.module.state_dict(), f"checkpoint-{epoch}.pt")  # guarded by its only caller

    def _wait_for_others(self):
        dist.barrier()  # expect: DDP008

    def train(self, epochs):
        for epoch in range(epochs):
            self.loader.sampler.set_epoch(epoch)
            for x, y in self.loader:
                self.opt.zero_grad()
                nn.functional.mse_loss(self.model(x.to(self.gpu_id)), y.to(self.gpu_id)).backward()
                self.opt.step()
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_checkpoint(epoch)
                self._wait_for_others()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, ngpus_per_node = dist.get_rank(), torch.cuda.device_count()
    data = TensorDataset(torch.randn(512, 10), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
    trainer = Trainer(nn.Linear(10, 1), loader, local_rank, save_every=2)
    trainer.train(10)
    if rank % ngpus_per_node == 0:
        save_checkpoint(trainer.model.module.state_dict(), "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
