"""Worker for single-purpose gloo checks: ``ddpkit launch --nproc-per-node 2 misc.py CASE OUT``.

CASE is one of: syncbn_seeds (saves OUT/rank<R>.pt), unused, unused_later, desync, desync_nan, diverged, tiny,
global_batch, boom (each should fail clearly), sleep (writes OUT/pid<R> and sleeps, for signal tests).
"""
import random
import sys

import torch
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.strategies.syncbn import convert_sync_batchnorm

case, out_dir = sys.argv[1], sys.argv[2]
if case in ("abort_after_shutdown", "late_end_then_abort", "p2p_then_abort"):  # before init: atexit runs it later
    import atexit
    import os

    atexit.register(lambda: os.abort() if os.environ.get("RANK") == "1" else None)
elif case == "slow_final_save_then_abort":  # rank 0 aborts in teardown after a final save longer than the exit wait
    import atexit
    import os

    atexit.register(lambda: os.abort() if os.environ.get("RANK") == "0" else None)
torch.set_num_threads(1)
state = ddpkit.init(seed=42)
rank, W = state.rank, state.world_size


class Noise(Dataset):
    """Each item is a random draw made inside the DataLoader worker: shows the worker's seed."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.rand(1).item(), random.random()


def syncbn_seeds():
    sizes = [3, 5, 4][:W]  # unequal per-rank batches
    g = torch.Generator().manual_seed(7)
    full = torch.randn(sum(sizes), 4, 5, generator=g) * 3 + 1  # (N, C, L): BatchNorm1d with a length dim
    upstream = torch.randn(sum(sizes), 4, 5, generator=g)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    bn = nn.BatchNorm1d(4, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2, 4))
        bn.bias.copy_(torch.linspace(-1, 1, 4))
    sync = convert_sync_batchnorm(bn, torch.device("cpu"))
    x = full[mine].clone().requires_grad_(True)
    y = sync(x)
    # A loss whose global value is the sum over ranks: gradients are then the global ones.
    (y * upstream[mine]).sum().backward()
    torch.distributed.all_reduce(sync.weight.grad)
    torch.distributed.all_reduce(sync.bias.grad)
    sync.eval()
    same = convert_sync_batchnorm(nn.BatchNorm1d(4, momentum=0.3), torch.device("cpu"))
    same(full)  # the same batch on every rank (a fixed noise for samples, in train mode): one batch, not N copies
    binary = convert_sync_batchnorm(nn.BatchNorm1d(1, momentum=0.3), torch.device("cpu"))
    binary(torch.tensor([[0.0], [1.0], [0.0], [1.0]]).roll(rank, 0))  # other samples, the same statistics
    return {"replicated_running_var": same.running_var.clone(), "binary_running_var": binary.running_var.clone(),
            "y": y.detach(), "dx": x.grad, "dw": sync.weight.grad, "db": sync.bias.grad,
            "running_mean": sync.running_mean.clone(), "running_var": sync.running_var.clone(),
            "eval_y": sync(full[mine]).detach(), "sizes": sizes, "full": full, "upstream": upstream,
            "rng": torch.rand(3), "py_rng": random.random(),
            "workers": [v for batch in ddpkit.data_loader(Noise(), 2, num_workers=1) for v in zip(*batch)]}


if case == "syncbn_seeds":
    torch.save(syncbn_seeds(), f"{out_dir}/rank{rank}.pt")
elif case in ("unused", "desync", "desync_nan", "diverged"):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x) if case == "unused" else self.used(x) + self.spare(x)

    model = ddpkit.prepare_model(TwoHeads(), check_sync_every=0 if case == "unused" else 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(2, 4)
        if case == "diverged" and rank == 1:
            x[0, 0] = float("nan")  # one bad sample: the all-reduced gradient carries it to every rank
        model(x).sum().backward()
        print(f"STEP {step} backward done", flush=True)
        opt.step()
        if case in ("desync", "desync_nan") and rank == 1:
            with torch.no_grad():  # a rank-dependent update outside backward
                model.module.spare.bias.add_(1.0 if case == "desync" else float("nan"))
elif case == "unused_later":  # a head used in step 0 only (a discriminator's extra head in its own step)
    class Extra(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.extra = nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x, extra=False):
            return self.used(x) + (self.extra(x) if extra else 0)

    model = ddpkit.prepare_model(Extra())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.randn(2, 4), extra=step == 0).sum().backward()
        print(f"STEP {step} backward done", flush=True)
        opt.step()
elif case == "init_after_wrap":  # DCGAN's order: wrap, then model.apply(init) under init(seed=)'s per-rank seed
    def weights_init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)

    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    model.apply(weights_init)
    with torch.no_grad():
        model(torch.randn(2, 4))  # an evaluation forward: no check (their number may differ between ranks)
    print("EVAL done", flush=True)
    model(torch.randn(2, 4)).sum().backward()
    print("STEP 0 backward done", flush=True)
elif case == "start_alike":  # issue 44 review: ranks that start alike pass the first-step check
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wide = nn.Linear(512, 512)  # big enough for a parallel sum: its float sum follows the threads
            self.expert = nn.Linear(512, 1)  # DDP is told to ignore it: a per-rank expert by design
            self.mask = nn.Parameter(torch.full((4,), float("-inf")), requires_grad=False)  # -inf by design

        def forward(self, x):
            return self.expert(self.wide(x)) + self.mask.exp().sum()

    torch.manual_seed(0)
    net = Net()
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["expert.weight",
                                                                                          "expert.bias"])
    torch.manual_seed(1000 + rank)
    net.expert.reset_parameters()
    torch.set_num_threads(1 if rank == 0 else 2)  # nodes with different core counts run different thread counts
    model = ddpkit.prepare_model(net)
    model(torch.randn(2, 512)).sum().backward()
    print("START-ALIKE OK", flush=True)
elif case == "init_in_join":  # uneven data: the whole loop inside ddpkit.join, an init after the wrap
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    nn.init.normal_(model.module[0].weight)  # init(seed=42) seeds each rank its own
    with ddpkit.join(model):
        model(torch.randn(2, 4)).sum().backward()
        print("STEP 0 backward done", flush=True)
elif case == "bn_local":  # plain BatchNorm (not synced) under check_sync_every: no false desync
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model = ddpkit.prepare_model(net, sync_batchnorm=False, check_sync_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 4) + rank).sum().backward()  # ranks see different data: local statistics differ
        opt.step()
    print("BN-LOCAL OK", flush=True)
elif case == "compiled":  # torch.compile around a prepared DDP model: no graph break or recompile from ddpkit
    from torch._dynamo.utils import compilation_time_metrics, counters

    model = torch.compile(ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(8):
        opt.zero_grad()
        model(torch.randn(4, 4)).sum().backward()
        opt.step()
    if rank == 0:
        import json

        print("COMPILED " + json.dumps({"breaks": list(counters["graph_break"]),
                                        "compiles": len(compilation_time_metrics["_compile.compile_inner"])}))
elif case == "compile_option":  # prepare_model(compile=...) and a model compiled before prepare_model
    import json

    from torch._dynamo.utils import counters

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(4, 4, generator=g)).sum().backward()
            opt.step()
        return model.state_dict()

    eager = train(ddpkit.prepare_model(net()))
    option = ddpkit.prepare_model(net(), compile={"backend": "eager"})
    before = ddpkit.prepare_model(torch.compile(net(), backend="eager"))
    results = {"option": train(option), "before": train(before)}
    if rank == 0:
        print("COMPILE " + json.dumps({
            "max_diff": max((eager[k] - r[k]).abs().max().item() for r in results.values() for k in eager),
            "keys": sorted(results["before"]) == sorted(eager),
            "compiled_inside": [ddpkit.unwrap(m)._compiled_call_impl is not None for m in (option, before)],
            "wrapper": type(before).__name__, "breaks": list(counters["graph_break"])}))
elif case == "abort_after_shutdown":  # rank 1 aborts in teardown, as gloo's destructor now and then does
    torch.distributed.all_reduce(torch.ones(1))
elif case == "p2p_then_abort":  # 3 ranks: gloo counts rank 0's two sends, each peer's one recv: counts apart
    import time

    t = torch.zeros(4)
    if rank == 0:
        for peer in range(1, W):
            torch.distributed.send(torch.ones(4), peer)
    else:
        torch.distributed.recv(t, 0)
    torch.distributed.all_reduce(t)
    if rank == 0:
        time.sleep(1.0)  # the others are at their exit first, with a count under rank 0's: no peer waits for them
elif case == "late_end_then_abort":  # rank 1 is at its exit 1.5 s before rank 0, which computes, in no collective
    import time

    torch.distributed.all_reduce(torch.ones(1))
    if rank == 0:
        time.sleep(1.5)
elif case == "slow_final_save_then_abort":  # rank 0 alone writes a last checkpoint, longer than the exit wait
    import time

    from ddpkit.core import process
    from ddpkit.runtime import leaving
    torch.distributed.all_reduce(torch.ones(1))
    if rank == 0:
        process.on_shutdown(lambda: (time.sleep(leaving.EXIT_WAIT_S + 1), print("rank 0 saved", flush=True)))
elif case == "destroy_then_threads":  # the script destroys its group, then shuts ddpkit down itself
    import threading
    import time

    torch.distributed.all_reduce(torch.ones(1))
    torch.distributed.destroy_process_group()
    ddpkit.shutdown()
    print("AT-ONCE", sorted(t.name for t in threading.enumerate()), flush=True)  # shutdown() waited for them
    time.sleep(0.3)
    print("THREADS", sorted(t.name for t in threading.enumerate()), flush=True)
elif case == "abort_before_shutdown":  # rank 1 aborts before the final barrier: a real failure
    torch.distributed.all_reduce(torch.ones(1))
    if rank == 1:
        import os

        os.abort()
elif case == "tiny":
    ddpkit.data_loader([1], batch_size=1)
elif case == "global_batch":
    ddpkit.data_loader(list(range(10)), global_batch_size=5)
elif case == "boom":  # rank 1 raises while rank 0 waits in a collective
    if rank == 1:
        import time

        print(f"RAISED-AT {time.time()}", file=sys.stderr, flush=True)
        raise ValueError("bad batch on rank 1")
    torch.distributed.all_reduce(torch.ones(1))
elif case == "sleep":  # for signal tests: record the pid, then wait
    import os
    import time

    with open(f"{out_dir}/pid{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
