"""How one rank ends while its peer trains: ``ddpkit launch --nproc-per-node 2 exits.py CASE OUT``.

CASE: ``sys_exit`` / ``os_exit`` (rank 1 leaves with code 3 mid-training, rank 0 waits in DDP's all-reduce),
``user_timeout`` (rank 1 raises the TimeoutError a slow download raises; rank 0 sleeps and writes
OUT/got-sigusr1 if a SIGUSR1 reaches it), ``fail_once`` (rank 1 raises on the first attempt only, the
restarted group finishes), ``before_init`` (rank 1 raises before ``ddpkit.init``).
"""
import os
import signal
import sys
import time

import torch

import ddpkit

case, out_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
if case == "before_init" and os.environ["RANK"] == "1":
    raise ValueError("bad config on rank 1, before init")
state = ddpkit.init(seed=0, timeout_s=60)  # a regression hangs for 60 s, not the default 15 min
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def train(steps: int, leave_at: int = -1) -> None:
    model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if step == leave_at and state.rank == 1:
            print(f"LEAVING-AT {time.time()}", file=sys.stderr, flush=True)
            if case == "os_exit":
                sys.stderr.flush()
                os._exit(3)
            sys.exit(3)
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()


if case in ("sys_exit", "os_exit"):
    train(steps=50, leave_at=2)
elif case == "user_timeout":
    if state.rank == 1:
        time.sleep(1)  # rank 0's handler is in place by then
        raise TimeoutError("read timed out fetching s3://bucket/shard-00017.tar")
    signal.signal(signal.SIGUSR1, lambda *_: open(os.path.join(out_dir, "got-sigusr1"), "w").close())
    time.sleep(30)
elif case == "fail_once":
    train(steps=3)
    if attempt == 0 and state.rank == 1:
        raise ValueError(f"rank 1 fails on attempt {attempt}")
    torch.distributed.barrier()
    print(f"DONE attempt {attempt}", flush=True)
elif case == "before_init":
    train(steps=2)
