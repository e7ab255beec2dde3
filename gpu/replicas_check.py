"""The replica checks' GPU half (issue 47), for ``gpu/check.py``: one process in a real NCCL group on one GPU.

NCCL allows no two ranks on one GPU, so with one GPU the group has one rank; every collective the checks and the
repair issue still goes through NCCL, which refuses a CPU tensor (the CPU suite's device guard checks the same
rule on gloo). What it proves and measures:

- the fingerprint of weights on the GPU equals the CPU's of the same bits, and one flipped bit changes it;
- ``Replicas.check`` (one all_gather), ``compare`` (broadcast + all_gather) and ``heal`` (broadcasts of weights,
  Adam's state with its CPU ``step`` tensor, the hyperparameters) run over NCCL;
- the desync watch reads the NCCL group's collective sequence number, and it moves with each collective;
- what a check costs on a GPT-2-small-sized model (124M parameters) against its training step, and the cadence
  the 0.1 % budget then picks.

    python gpu/replicas_check.py     # prints one JSON line; exit 1 on a failed proof (--cpu: a smoke run)
"""
import json
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.runtime import desync
from ddpkit.strategies import replica_repair, replicas


def timed(fn, reps):
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


class Block(nn.Module):
    """GPT-2 small's block shapes (attention's weights, not its math: the cost measured is the weights')."""

    def __init__(self, width):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.fc, self.out = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x)).chunk(3, dim=-1)[0])
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def gpt2_sized(width=768, vocab=50304):
    """~124M parameters at the default sizes: an embedding, 12 blocks, a final norm."""
    return nn.Sequential(nn.Embedding(vocab, width), *[Block(width) for _ in range(12)], nn.LayerNorm(width))


def main(cpu):
    """``cpu``: the same proofs on gloo and a small model (a smoke run where no GPU is)."""
    out, failed = {}, []
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=None if cpu else device)
        torch.manual_seed(0)
        net = (gpt2_sized(64, 1000) if cpu else gpt2_sized()).to(device)
        model = nn.parallel.DistributedDataParallel(net, device_ids=None if cpu else [0])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cpu)
        watch = replicas.Replicas(net, None)  # the default cadence, 'auto'
        out["parameters_m"] = round(sum(p.numel() for p in net.parameters()) / 1e6, 1)

        tokens = torch.randint(0, 1000, (8, 1024), device=device)

        def step():
            loss = model(tokens).float().pow(2).mean()  # the blocks apply to the embeddings in turn
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        step_s = timed(step, 10)
        seen = [0]

        def check():
            seen[0] += 1
            watch.check(seen[0])

        check_s = timed(check, 20)
        out["fingerprint_ms"] = round(timed(lambda: replicas._fingerprint(watch.tensors), 20) * 1e3, 3)
        out["step_ms"], out["check_ms"] = round(step_s * 1e3, 2), round(check_s * 1e3, 3)
        out["check_every_at_budget"] = replicas.next_every(check_s, step_s)
        out["check_share_at_that_cadence"] = round(check_s / (out["check_every_at_budget"] * step_s), 5)

        on_gpu = replicas._fingerprint(watch.tensors)
        on_cpu = replicas._fingerprint([t.cpu() for t in watch.tensors])
        if not torch.equal(on_gpu.cpu(), on_cpu):
            failed.append("the GPU's fingerprint differs from the CPU's of the same weights")
        first = watch.tensors[1]
        with torch.no_grad():
            first.view(-1).view(torch.int32)[17] ^= 1 << 5
        if torch.equal(replicas._fingerprint(watch.tensors).cpu(), on_cpu):
            failed.append("a flipped bit left the fingerprint unchanged")
        detail = replica_repair.compare(first, 0, None, [opt])
        if detail[0][0] != 0:  # one rank: its own broadcast is the reference
            failed.append(f"compare against itself found {detail[0][0]} differing elements")

        found = replica_repair.Finding(seen[0], seen[0], [0], [[0]], [0], 0, [watch.names[1]])
        watch.optimizers[opt] = True
        replica_repair.heal(watch, found, [first])  # NCCL broadcasts: weights, AdamW state (CPU step), lr
        out["heal"] = f"ran over {dist.get_backend()}"

        group = dist.distributed_c10d._get_default_group()
        look = desync.Watch(0, 1, dist.distributed_c10d._get_default_store(), group, 3.0, print)
        before = look._state()
        dist.all_reduce(torch.ones(4, device=device))
        after = look._state()
        if before is None or after is None or after["seq"] <= before["seq"]:
            failed.append(f"the desync watch read no moving NCCL sequence number ({before} -> {after})")
        out["desync_seq"] = [None if s is None else s["seq"] for s in (before, after)]
        dist.destroy_process_group()
    out["failed"] = failed
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main("--cpu" in sys.argv))
