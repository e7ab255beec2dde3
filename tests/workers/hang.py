"""Rank 0 calls an all_reduce that rank 1 skips; rank 1 is busy elsewhere. `hang.py TIMEOUT_S`"""
import sys
import time

import torch
import torch.distributed as dist

import ddpkit

state = ddpkit.init(timeout_s=float(sys.argv[1]))


def only_rank0_reduces():
    if state.rank == 0:
        print(f"HANG-START {time.time()}", flush=True)
        dist.all_reduce(torch.ones(1))


def evaluate():
    time.sleep(120)


only_rank0_reduces()
evaluate()
