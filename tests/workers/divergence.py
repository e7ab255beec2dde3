"""Replicas that leave each other, and ranks that wait in different collectives (issue 47):
``ddpkit launch --nproc-per-node N divergence.py CASE OUT [CHECK] [HEAL]``.

CASE: clean, flip (rank 1, in hsdp rank 3, flips bit 5 of one weight after step 12's optimizer step), skip
(rank 1 skips step 12's optimizer.step()), desync (rank 1 all_reduces where the others broadcast, at step 5),
desync_outside (the same, but rank 2 waits in a loop of its own), straggle (rank 1 sleeps 3 s before a
collective every rank calls, at step 5). CHECK: check_sync_every ('auto' or K); HEAL: 'no', 'yes' or 'rank0';
END: 'exit' (the script just ends), 'destroy' (it ends with dist.destroy_process_group()) or 'apart' (rank 0 ends
7 s after the others, longer than the exit wait).
Each rank saves its final weights to OUT/rank<R>.pt (hsdp: gathered).
"""
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import ddpkit

case, out = sys.argv[1], sys.argv[2]
check = sys.argv[3] if len(sys.argv) > 3 else "auto"
heal = {"no": False, "yes": True, "rank0": "rank0"}[sys.argv[4] if len(sys.argv) > 4 else "no"]
end = sys.argv[5] if len(sys.argv) > 5 else "exit"
state = ddpkit.init(seed=0, timeout_s=900)
rank = state.rank
hsdp = {"shard_size": 2} if state.mode == "hsdp" else {}  # 2 replicas of 2 shards: rank 3 holds rank 1's shard
victim = 3 if hsdp else 1
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
                             check_sync_every=check if check == "auto" else int(check), heal=heal, **hsdp)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)  # the same batches on every rank: the fault is the only difference
for step in range(40):
    loss = model(torch.randn(8, 16, generator=data)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if not (case == "skip" and rank == 1 and step == 12):
        opt.step()
    if case == "flip" and rank == victim and step == 12:
        with torch.no_grad():  # what a cosmic ray does: one bit of one element (of this rank's shard in hsdp)
            weight = ddpkit.unwrap(model)[0].weight
            weight = weight.to_local() if hsdp else weight
            weight.view(-1).view(torch.int32)[17] ^= 1 << 5
    if case in ("desync", "desync_outside") and step == 5:
        print(f"DESYNC-AT {time.time()}", flush=True)
        if rank == 1:
            dist.all_reduce(torch.ones(1024))
        elif case == "desync_outside" and rank == 2:
            while True:  # stuck in the script's own wait, in no collective
                time.sleep(0.05)
        else:
            dist.broadcast(torch.ones(1024), 0)
    if case == "straggle" and step == 5:
        if rank == 1:
            time.sleep(3)
        dist.all_reduce(torch.ones(4))
torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{out}/rank{rank}.pt")  # hsdp: gathered
print("FINAL", flush=True)
if end == "destroy":
    dist.destroy_process_group()
elif end == "apart" and rank == 0:
    time.sleep(7)
