"""Worker for the cross-rank helpers: ``ddpkit launch --nproc-per-node 2 control.py CASE OUT`` (or plain python).

CASE: values (broadcast / gather_object round trips and refusals, collectives' edges: a 0-d gather, a flag's
max, tensors that differ across ranks; then an early stop decided by rank 1 only),
first (main_process_first ordering), first_raises (rank 0 raises inside main_process_first).
"""
import json
import os
import sys
import time

import torch

import ddpkit

case, out_dir = sys.argv[1], sys.argv[2]
state = ddpkit.init()
rank, world = state.rank, state.world_size


class Point:  # picklable, not JSON: must be refused, never unpickled
    x = 1


def refused(call, error=TypeError):
    try:
        call()
    except error as exc:
        return str(exc)
    return None


if case == "values":
    record = {
        "config": ddpkit.broadcast({"lr": 0.1, "tags": ["a", None, True], "n": 3} if rank == 0 else None),
        "from_last": ddpkit.broadcast(f"rank {rank}", src=world - 1),
        "tensor": ddpkit.broadcast(torch.arange(6.0).reshape(2, 3) * (rank + 1) if rank == 0 else None).tolist(),
        "gathered": ddpkit.gather_object({"rank": rank, "loss": 0.5 * rank}),
        "refused_broadcast": refused(lambda: ddpkit.broadcast(Point() if rank == 0 else None)),
        "refused_gather": refused(lambda: ddpkit.gather_object(Point() if rank == world - 1 else rank)),
        "gather_0d": ddpkit.gather(torch.tensor(0.5 * rank)).tolist(),
        "flag_max": ddpkit.reduce(rank == world - 1, "max"), "flag_min": ddpkit.reduce(True, "min"),
        "flag_sum": ddpkit.reduce(True),
        "reduce_dtypes": refused(lambda: ddpkit.reduce(torch.ones(3) if rank == 0 else torch.ones(3).long()),
                                 ValueError),
        "gather_shapes": refused(lambda: ddpkit.gather(torch.zeros(2, 3 if rank == 0 else 4)), ValueError),
        "gather_rows": ddpkit.gather(torch.full((rank + 1, 2), rank)).tolist(),  # rows may differ in number
        # 9 dims, the 9th differing on the last rank (a fixed-size header would miss it, and gloo aborts)
        "gather_9d": refused(lambda: ddpkit.gather(torch.ones(2, *[1] * 7, 3 if rank == world - 1 else 2)),
                             ValueError),
        "reduce_9d": refused(lambda: ddpkit.reduce(torch.ones(*[1] * 8, 3 if rank == world - 1 else 2)), ValueError),
        "gather_9d_same": list(ddpkit.gather(torch.ones(rank + 1, *[1] * 7, 2)).shape),
        "after": ddpkit.broadcast("still in step" if rank == 0 else None),  # nobody was left behind
    }
    stopped_at = None
    for step in range(100):
        wants_to_stop = rank == world - 1 and step == 3  # only the last rank decides
        if ddpkit.any_rank(wants_to_stop):
            stopped_at = step
            break
    record["stopped_at"], record["all"] = stopped_at, ddpkit.all_ranks(rank >= 0)
    with open(os.path.join(out_dir, f"values{rank}.json"), "w") as f:
        json.dump(record, f)
elif case == "first":
    marker = os.path.join(out_dir, "prepared")
    with ddpkit.main_process_first():
        if rank == 0:
            time.sleep(1.0)  # slow preparation: the others must wait for it
            with open(marker, "w") as f:
                f.write("ready")
        seen = os.path.exists(marker)
    with open(os.path.join(out_dir, f"first{rank}.json"), "w") as f:
        json.dump({"seen": seen}, f)
elif case == "first_raises":
    with ddpkit.main_process_first():
        if rank == 0:
            raise ValueError("download failed on rank 0")
    print("RELEASED", rank, flush=True)
