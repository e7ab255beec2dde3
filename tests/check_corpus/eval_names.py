# Style: a hand-written DDP retrieval model: which datasets count as evaluation data is read from whole words of
# their names (val, valid, validation, eval, test), not from letters inside other words.
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
retrieval_set = TensorDataset(torch.randn(512, 8))  # "retrieval" holds "val": still training data
interval_set = TensorDataset(torch.randn(512, 8))
val_set = TensorDataset(torch.randn(100, 8))
testset = TensorDataset(torch.randn(100, 8))
train_sampler = DistributedSampler(retrieval_set, shuffle=False)
interval_sampler = DistributedSampler(dataset=interval_set, shuffle=False)
val_sampler = DistributedSampler(dataset=val_set, shuffle=False)  # expect: DDP003
test_sampler = DistributedSampler(testset, shuffle=False)  # expect: DDP003
last_sampler = DistributedSampler(dataset=val_set, shuffle=False, drop_last=True)  # expect: DDP019
eval_loader = DataLoader(val_set, sampler=last_sampler)
state = torch.load("init.pt", "cpu")  # map_location given positionally: fine
weights = torch.load("weights.pt", torch.device("cpu"), weights_only=True)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
model.module.load_state_dict(state)
dist.destroy_process_group()
