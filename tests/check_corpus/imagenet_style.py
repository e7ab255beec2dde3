# Style: torch's ImageNet example: drop_last evaluation sampler plus an auxiliary loader for the remainder
# (fine), and a second model whose evaluation sampler drops its tail without evaluating it (a finding).
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("gloo")
world_size = dist.get_world_size()
val_dataset = TensorDataset(torch.randn(101, 8), torch.randint(0, 3, (101,)))
val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
val_loader = DataLoader(val_dataset, batch_size=16, sampler=val_sampler)
covered = len(val_sampler) * world_size
aux_val_loader = DataLoader(Subset(val_dataset, range(covered, len(val_dataset))), batch_size=16)
test_dataset = TensorDataset(torch.randn(57, 8), torch.randint(0, 3, (57,)))
test_sampler = DistributedSampler(test_dataset, shuffle=False, drop_last=True)  # expect: DDP019
test_loader = DataLoader(test_dataset, batch_size=16, sampler=test_sampler)
model = DistributedDataParallel(nn.Linear(8, 3))
with torch.no_grad():
    for loader in (val_loader, aux_val_loader, test_loader):
        for x, y in loader:
            model(x)
dist.destroy_process_group()
