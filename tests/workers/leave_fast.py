"""One rank leaves while its peer trains forever: ``ddpkit launch --nproc-per-node 2 leave_fast.py HOW``.

HOW: ``sys_exit`` (rank 1 calls ``sys.exit(3)``), ``raise`` (an uncaught ValueError), ``sigkill`` (rank 1 SIGKILLs
itself), ``clean`` (rank 1 returns, exit 0); a second argument: a folder where rank 1 logs each step through an
object in a reference cycle, never closed (a failing rank's teardown must not lose what it buffered). Rank 0 trains
a DDP step after step and never stops on its own, so the job's end is the launcher's doing. Rank 1 prints ``LEAVING-
AT <wall time>`` just before it goes, and ``SHUTDOWN-DONE-AT <wall time>`` once ddpkit's at-exit shutdown returned
(atexit runs handlers last in, first out: this one, registered before ``ddpkit.init()``, runs after ddpkit's).
"""
import atexit
import os
import signal
import sys
import time

import torch

import ddpkit

how = sys.argv[1]
torch.set_num_threads(1)
atexit.register(lambda: print(f"SHUTDOWN-DONE-AT {time.time()}", file=sys.stderr, flush=True))
state = ddpkit.init(seed=0, timeout_s=60)  # a regression hangs for 60 s, not the default 15 min


class Log:
    def __init__(self, path):
        self.file = open(path, "w")  # never closed, as scripts do
        self.say = self.write  # self -> bound method -> self: a cycle only the teardown frees

    def write(self, line):
        self.file.write(line + "\n")


log = Log(f"{sys.argv[2]}/rank{state.rank}.log") if len(sys.argv) > 2 else None
if sys.argv[2:] == ["again"]:
    torch.distributed.all_reduce(torch.ones(1))
    ddpkit.shutdown()
    state = ddpkit.init(seed=0, timeout_s=60)
model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while True:
    if step == 20 and state.rank == 1:
        print(f"LEAVING-AT {time.time()}", file=sys.stderr, flush=True)
        if how == "sys_exit":
            sys.exit(3)
        if how == "raise":
            raise ValueError("bad batch on rank 1")
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        break
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    if log is not None:
        log.say(f"step {step}")
    step += 1
