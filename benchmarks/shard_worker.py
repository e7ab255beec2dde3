"""One sharded-memory run: an MLP of --depth x --width^2 parameters trained with Adam, written seven ways.

``torchrun --standalone --nproc-per-node N shard_worker.py --impl fsdp|ddp|hsdp|raw-fsdp2|raw-hsdp|accelerate|fabric``
(fsdp / ddp / hsdp are ddpkit's modes, hsdp with ``prepare_model(..., shard_size=--shard-size)``; raw-fsdp2 is
fully_shard by hand with the same block policy: one group per Linear, then the root; raw-hsdp the same on the
2-D mesh ``init_device_mesh("cpu", (N // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))``, with
SUM reductions forced as ddpkit forces them on gloo). Rank 0 prints one JSON line: the training state each rank
holds after a step (parameters + gradients + optimizer state, local shards, tensor accounting; max over ranks),
peak RSS (max over ranks) and the median step time (slowest rank per step), or the error a peer gives.
"""
import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True,
               choices=["fsdp", "ddp", "hsdp", "raw-fsdp2", "raw-hsdp", "accelerate", "fabric"])
p.add_argument("--width", type=int, default=2048)
p.add_argument("--depth", type=int, default=12, help="12 x 2048^2: 50M parameters")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--shard-size", type=int, default=2, help="hsdp / raw-hsdp: processes per model copy")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)


def mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.depth)])


def local_bytes(tensors):
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def setup():
    if args.impl in ("fsdp", "ddp", "hsdp"):
        import ddpkit

        ddpkit.init(args.impl)
        hybrid = {"shard_size": args.shard_size} if args.impl == "hsdp" else {}  # mesh (N // shard_size, shard_size)
        model = ddpkit.prepare_model(mlp(), shard=[nn.Linear], **hybrid)  # shard= is ignored in ddp
        return model, torch.optim.Adam(model.parameters(), lr=1e-4), lambda loss: loss.backward()
    if args.impl in ("raw-fsdp2", "raw-hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        dist.init_process_group("gloo")
        mesh = None  # raw-fsdp2: fully_shard's default, one dimension over every rank
        if args.impl == "raw-hsdp":
            mesh = init_device_mesh("cpu", (dist.get_world_size() // args.shard_size, args.shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        model = mlp()
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if args.impl == "raw-hsdp":  # what ddpkit's hsdp sets on gloo (torch issue #162338): SUM, then divide
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4), lambda loss: loss.backward()
    if args.impl == "accelerate":
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = accelerator.prepare(mlp())
        return model, accelerator.prepare(torch.optim.Adam(model.parameters(), lr=1e-4)), accelerator.backward
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import FSDPStrategy

    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                    strategy=FSDPStrategy(process_group_backend="gloo"))
    fabric.launch()
    model = fabric.setup_module(mlp())
    return model, fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-4)), fabric.backward


try:
    model, opt, backward = setup()
except Exception as exc:  # a peer that does not shard on CPU: record what it says
    print("BENCH " + json.dumps({"impl": args.impl, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}))
    raise SystemExit(0) from None
times, state = [], 0
x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
for _ in range(args.steps):
    start = time.perf_counter()
    loss = nn.functional.mse_loss(model(x), y)
    backward(loss)
    opt.step()
    times.append(time.perf_counter() - start)
    params = list(model.parameters())  # the state held at its peak: gradients and optimizer state both alive
    optim = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    state = max(state, local_bytes(params) + local_bytes([q.grad for q in params]) + local_bytes(optim))
    opt.zero_grad()
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
stats = torch.tensor(times + [rss_mb, state / 2**20], dtype=torch.float64)
everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, stats)
if dist.get_rank() == 0:
    per_step = torch.stack(everyone)[:, : len(times)].max(0).values[args.warmup:]
    print("BENCH " + json.dumps({
        "impl": args.impl, "median_ms": per_step.median().item() * 1e3,
        "params_m": args.depth * (args.width ** 2 + args.width) / 1e6,
        "rss_mb": max(e[len(times)].item() for e in everyone),
        "state_mb": max(e[len(times) + 1].item() for e in everyone)}), flush=True)
dist.barrier()
