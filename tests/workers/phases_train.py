"""A DDP loop whose one rank is slow on purpose: PHASES_SLOW=data:R sleeps in rank R's __getitem__,
compute:R in rank R's forward, all slows every rank's data alike; PHASES_STEPS batches of 4 in all.
PHASES_STREAM=1: the samples as a stream.
PHASES_BN=1: a BatchNorm (SyncBatchNorm once prepared), whose forward waits for the peers.
PHASES_TB=DIR: a ddpkit.summary_writer there (the report's scalars go to it).
optimizer:R sleeps in rank R's optimizer step; PHASES_LOG=1 logs ddpkit.reduce(loss.item(), "mean") every step.
Prints the default group's collective count at the end (rank 0), so a test can compare it with the report off."""
import os
import time

import torch
import torch.distributed as dist

import ddpkit

SLOW = os.environ.get("PHASES_SLOW", "")
KIND, _, WHO = SLOW.partition(":")
RANK = int(os.environ.get("RANK", "0"))
SLEEP = float(os.environ.get("PHASES_SLEEP", "0.005"))
STEPS = int(os.environ.get("PHASES_STEPS", "40"))


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4 * STEPS * int(os.environ["WORLD_SIZE"])

    def __getitem__(self, i):
        if (KIND == "data" and RANK == int(WHO)) or KIND == "all":
            time.sleep(SLEEP)
        return torch.full((8,), float(i % 7)), torch.tensor([float(i % 3)])


class Stream(torch.utils.data.IterableDataset):
    """The same samples as a stream (PHASES_STREAM=1): ddpkit's stream loader, whose ranks agree per window."""

    def __iter__(self):
        data = Data()
        return (data[i] for i in range(len(data)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        norm = [torch.nn.BatchNorm1d(32)] if os.environ.get("PHASES_BN") else []  # SyncBatchNorm once prepared
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), *norm, torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x):
        if KIND == "compute" and RANK == int(WHO):
            time.sleep(4 * SLEEP)  # a slow device, as far as the step can tell
        return self.body(x)


device = ddpkit.init(seed=0).device
writer = ddpkit.summary_writer(os.environ["PHASES_TB"]) if os.environ.get("PHASES_TB") else None
model = ddpkit.prepare_model(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if KIND == "optimizer" and RANK == int(WHO):
    opt.register_step_pre_hook(lambda *args: time.sleep(4 * SLEEP))
# no loader workers unless asked: with workers, equally slow loaders on every rank settle with one rank waiting in
# data and the other in comm (its workers prefetch meanwhile), which the report names (docs/phases.md)
# a stream unshuffled: a shuffle buffer would read its first 1000 samples (all of them here) at the first fetch,
# inside the first window, which the report leaves out as warm-up
stream = os.environ.get("PHASES_STREAM")
loader = ddpkit.data_loader(Stream() if stream else Data(), batch_size=4, shuffle=False if stream else None,
                            num_workers=int(os.environ.get("PHASES_WORKERS", "0")))
for x, y in loader:
    x, y = x.to(device), y.to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if os.environ.get("PHASES_LOG"):
        ddpkit.reduce(loss.item(), "mean")  # the others wait here for a rank slow after its backward
if writer is not None:
    writer.close()
if RANK == 0:
    # one process (a GPU machine's check, nproc 1) has no group: no collective
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group() if dist.is_initialized() else 0
    print(f"collectives={seq}", flush=True)
ddpkit.shutdown()
