"""One benchmarked training run: the same MLP, data and DDP settings, written four ways.

``torchrun --standalone --nproc-per-node 2 step_worker.py --impl raw|ddpkit|accelerate|fabric [options]``
Rank 0 prints one JSON line: per-step times (max over ranks) after warm-up (median, p90, mean), the wall time
of the first completed step, peak RSS (max over ranks) and the final loss. A step is timed from the batch in
hand to the optimizer step's end; ``--time-fetch``: from the request of the batch.
"""
import time

SCRIPT_STARTED_AT = time.time()  # before any import: the launcher's share of start-up ends here

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--impl", required=True, choices=["raw", "ddpkit", "accelerate", "fabric"])
p.add_argument("--width", type=int, default=512)
p.add_argument("--depth", type=int, default=3)
p.add_argument("--batch", type=int, default=64, help="per process")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--bucket-mb", type=float, default=None)
p.add_argument("--grad-view", action="store_true")
p.add_argument("--static-graph", action="store_true")
p.add_argument("--compression", default=None)
p.add_argument("--compile", action="store_true", help="ddpkit: prepare_model(compile=True) (inductor)")
p.add_argument("--time-fetch", action="store_true",
               help="start each step's timer before next(batches): the loader's hand-out is timed too")
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)


def mlp():
    layers = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.width, 10))


world = int(os.environ.get("WORLD_SIZE", "1"))
data = TensorDataset(torch.randn(args.batch * world * (args.steps + 1), args.width),
                     torch.randint(0, 10, (args.batch * world * (args.steps + 1),)))
ddp_opts = {"gradient_as_bucket_view": args.grad_view, "static_graph": args.static_graph}
if args.bucket_mb:
    ddp_opts["bucket_cap_mb"] = args.bucket_mb

if args.impl == "raw":
    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(mlp(), **ddp_opts)
    loader = DataLoader(data, batch_size=args.batch, sampler=DistributedSampler(data, seed=0))
    loader.sampler.set_epoch(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backward = lambda loss: loss.backward()  # noqa: E731
elif args.impl == "ddpkit":
    import ddpkit

    ddpkit.init()
    comm = ddpkit.CommConfig(bucket_mb=args.bucket_mb, gradient_as_bucket_view=args.grad_view,
                             static_graph=args.static_graph, compression=args.compression)
    model = ddpkit.prepare_model(mlp(), comm=comm, compile=args.compile)
    loader = ddpkit.data_loader(data, batch_size=args.batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    backward = lambda loss: loss.backward()  # noqa: E731
elif args.impl == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**ddp_opts)])
    model, opt, loader = accelerator.prepare(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.01),
                                             DataLoader(data, batch_size=args.batch, shuffle=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = accelerator.prepare(opt)
    backward = accelerator.backward
else:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    fabric = Fabric(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo", **ddp_opts))
    fabric.launch()
    model, opt = fabric.setup(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.01))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=args.batch, shuffle=True))
    backward = fabric.backward

times, first_step_at, loss = [], None, None
batches = iter(loader)
for _step in range(args.steps):
    start = time.perf_counter()  # re-taken below unless --time-fetch: the figures of every other part exclude it
    x, y = next(batches)
    if not args.time_fetch:
        start = time.perf_counter()
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    backward(loss)
    opt.step()
    times.append(time.perf_counter() - start)
    if first_step_at is None:
        first_step_at = time.time()
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
stats = torch.tensor(times + [rss_mb, loss.item()], dtype=torch.float64)
everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, stats)
if dist.get_rank() == 0:
    per_step = torch.stack(everyone)[:, : len(times)].max(0).values[args.warmup:]  # slowest rank sets the pace
    print("BENCH " + json.dumps({
        "impl": args.impl, "median_ms": per_step.median().item() * 1e3,
        "p90_ms": per_step.quantile(0.9).item() * 1e3, "mean_ms": per_step.mean().item() * 1e3,
        "first_step_at": first_step_at,
        "script_started_at": SCRIPT_STARTED_AT,
        "rss_mb": max(e[len(times)].item() for e in everyone),
        "final_loss": sum(e[len(times) + 1].item() for e in everyone) / len(everyone)}), flush=True)
dist.barrier()
dist.destroy_process_group()
