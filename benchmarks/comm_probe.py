"""Where the time of a communication-bound DDP step goes on this machine (the table in docs/performance.md).

``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/comm_probe.py``
Prints the median step (ms) of the 33 MB-gradient MLP under each setting, 3 interleaved repetitions, then
the cost of the primitives the compression hooks are made of, on 8.4 M floats.
"""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddpkit.strategies.comm import _bf16_allreduce_hook, skip_hook

WIDTH, N = 2048, 8_400_000
GV = {"gradient_as_bucket_view": True}
SETTINGS = {"default": ({}, None), "no_comm": (GV, skip_hook), "grad_view": (GV, None),
            "grad_view+static": ({**GV, "static_graph": True}, None),
            "grad_view+5mb": ({**GV, "bucket_cap_mb": 5}, None),
            "grad_view+bf16": (GV, _bf16_allreduce_hook), "grad_view+fp16": (GV, default_hooks.fp16_compress_hook)}


def step_ms(ddp_kwargs, hook, steps=25, warmup=5):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    model = nn.parallel.DistributedDataParallel(net, **ddp_kwargs)
    if hook:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for _ in range(steps):
        x, y = torch.randn(8, WIDTH, generator=data), torch.randint(0, 10, (8,), generator=data)
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return sorted(times[warmup:])[(steps - warmup) // 2] * 1e3


def primitive_ms(fn, reps=8):
    fn()
    dist.barrier()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {name: [] for name in SETTINGS}
    for _ in range(3):  # interleaved repetitions
        for name, (kwargs, hook) in SETTINGS.items():
            results[name].append(step_ms(kwargs, hook))
    x = torch.randn(N)
    half, bf16 = x.half(), x.bfloat16()
    parts = [torch.empty(N, dtype=torch.half) for _ in range(dist.get_world_size())]
    prims = {"all_reduce fp32": lambda: dist.all_reduce(x), "all_reduce bf16": lambda: dist.all_reduce(bf16),
             "all_reduce fp16": lambda: dist.all_reduce(half), "all_gather fp16": lambda: dist.all_gather(parts, half),
             "cast to bf16": lambda: x.bfloat16(), "cast to fp16": lambda: x.half(),
             "sum two fp16 in fp32": lambda: parts[0].float().add_(parts[1].float())}
    prim_results = {name: primitive_ms(fn) for name, fn in prims.items()}
    if dist.get_rank() == 0:
        for name, values in results.items():
            print(f"step {name:18s} " + " ".join(f"{v:6.1f}" for v in values) + " ms")
        for name, value in prim_results.items():
            print(f"{name:23s} {value:6.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
