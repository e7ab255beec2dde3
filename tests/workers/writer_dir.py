"""Every rank asks ``ddpkit.summary_writer()`` (no log_dir given) where it writes, then writes there, as SimCLR
keeps its log file in ``writer.log_dir``: rank 0's folder on every rank (it was a function on the others).

    ddpkit launch --nproc-per-node 2 tests/workers/writer_dir.py OUT
"""
import os
import sys

import ddpkit

state = ddpkit.init()
os.chdir(sys.argv[1])  # SummaryWriter's default folder is runs/<date>_<host> under the working directory
if state.is_main:  # rank 0 alone makes one more writer first: the others' are still matched to rank 0's
    ddpkit.summary_writer(comment="_debug").close()
writer = ddpkit.summary_writer(comment="_exp")
second = ddpkit.summary_writer("given")
if state.rank == 1:  # pytorch-semseg copies its config into the log_dir it gave: the folder is there on every rank
    with open(os.path.join(ddpkit.summary_writer("rank1_given").file_writer.get_logdir(), "config.yml"), "w") as f:
        f.write("x: 1\n")
ddpkit.barrier()
with open(os.path.join(writer.log_dir, f"rank{state.rank}.txt"), "w") as f:
    f.write(f"{writer.get_logdir()} {second.log_dir}")
ddpkit.barrier()
import torch.distributed as dist  # noqa: E402

dist.destroy_process_group()
assert writer.log_dir.endswith("_exp")  # read once: still there once the group is gone
writer.close()
