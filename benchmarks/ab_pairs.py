"""Pairs of blocks, on and off in turn, in one warm job: what benchmarks/phase_ab.py and guard_ab.py measure with.

``block(on)`` runs one block and returns (the slower rank's wall seconds, this rank's CPU seconds). The order
within a pair alternates, so a slow phase of the machine hits both sides alike. Example::

    wall, cpu, last_off = pairs(block, 40)   # per pair: on / off ratios; the last "off" block's (wall, cpu)
"""
import torch
import torch.distributed as dist


def slowest(seconds):
    """The largest of every rank's ``seconds`` (a block lasts as long as its slowest rank)."""
    value = torch.tensor([seconds], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def pairs(block, count):
    block(False), block(True)  # warm-up: caches, the allocator, what either side does only once
    wall_ratios, cpu_ratios, got = [], [], {}
    for pair in range(count):
        order = (True, False) if pair % 2 else (False, True)
        got = {on: block(on) for on in order}
        wall_ratios.append(got[True][0] / got[False][0])
        cpu_ratios.append(got[True][1] / got[False][1])
    return wall_ratios, cpu_ratios, got[False]
