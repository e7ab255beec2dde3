"""A script that launches itself: ``python selflaunch.py OUT --spawn`` runs main on 2 processes through
ddpkit.spawn; ``ddpkit launch --nproc-per-node 2 selflaunch.py OUT`` runs it the usual way. Rank 0 writes
OUT/<how>.pt (the final weights). ``--fail`` makes rank 1 raise."""
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.launcher.spawn import SpawnError


def main(out, how, fail=False):
    torch.set_num_threads(1)
    state = ddpkit.init(seed=0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in ddpkit.data_loader(data, batch_size=8, seed=1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fail and state.rank == 1:
            raise ValueError("planned failure on rank 1")
    weights = model.state_dict()
    if state.is_main:
        torch.save(weights, f"{out}/{how}.pt")
    ddpkit.print("trained")
    return {"rank": state.rank, "world_size": state.world_size, "mode": state.mode}


if __name__ == "__main__":
    out, spawned, fail = sys.argv[1], "--spawn" in sys.argv, "--fail" in sys.argv
    if not spawned:
        main(out, "launch")
        sys.exit(0)
    try:
        print("RESULT " + json.dumps(ddpkit.spawn(main, out, "spawn", nproc_per_node=2, fail=fail)), flush=True)
    except SpawnError as exc:
        print(f"SPAWN-ERROR exit={exc.exit_code}\n{exc}", flush=True)
        sys.exit(exc.exit_code)
