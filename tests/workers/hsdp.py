"""Worker for the hsdp tests: train, measure the state each rank holds, save a sharded checkpoint; or restore
one in any mode and world size.

``ddpkit launch [--mode hsdp] ... hsdp.py OUT train [SHARD_SIZE]``: rank 0 writes OUT/train-<mode>-<N>.pt (the
full weights after training, a meta-built model's weights, each rank's state bytes); the checkpoint goes to
OUT/ckpt-<mode>-<N>.
``... hsdp.py OUT restore CKPT TAG [SHARD_SIZE]``: rank 0 writes OUT/restore-TAG.pt (the full weights and
optimizer state loaded), and every rank saves them again into OUT/ckpt-restored-TAG.
"""
import sys

import torch
from torch import nn

import ddpkit

GLOBAL_BATCH, STEPS, CLIP = 12, 5, 0.05
out, action = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
state = ddpkit.init(seed=0)
W = state.world_size
options = {"shard": [nn.Linear]}
shape_at = 3 if action == "train" else 5  # the shard size, when given: after the action's own arguments
if len(sys.argv) > shape_at:
    options["shard_size"] = int(sys.argv[shape_at])


def data(n=60):
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def net():  # built as a script builds it: no reseed after init()
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def local_bytes(model, opt):
    """Bytes of parameters, gradients and optimizer state this rank holds (a DTensor: its local shard)."""
    def own(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    total = sum(own(p) + (own(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(own(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())


def full_optimizer(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    got = get_optimizer_state_dict(ddpkit.unwrap(model), opt, options=StateDictOptions(full_state_dict=True))
    return {k: v["momentum_buffer"].clone() for k, v in got["state"].items()}


def cpu(sd):
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


if action == "train":
    model = ddpkit.prepare_model(net(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ddpkit.data_loader(data(), batch_size=GLOBAL_BATCH // W, seed=5)
    batches = iter(loader)
    for _ in range(STEPS):
        x, y = (t.to(state.device) for t in next(batches))
        nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        held = local_bytes(model, opt)  # gradients still held: the peak of a step's training state
        opt.zero_grad()
    ckpt = ddpkit.Checkpointer(f"{out}/ckpt-{state.mode}-{W}", resume=False)
    ckpt.save(STEPS, model=model, optimizer=opt)
    with ddpkit.init_empty():
        empty = net()
    empty = ddpkit.prepare_model(empty, **options)
    result = {"weights": cpu(model.state_dict()), "optimizer": full_optimizer(model, opt),
              "bytes": ddpkit.gather(torch.tensor([held])).tolist(), "empty": cpu(empty.state_dict())}
    inner = ddpkit.unwrap(model)
    first = next(inner.parameters())
    result["placements"] = str(getattr(first, "placements", None))
    result["mesh"] = list(first.device_mesh.shape) if hasattr(first, "device_mesh") else None
    if state.is_main:
        torch.save(result, f"{out}/train-{state.mode}-{W}.pt")
else:
    path, tag = sys.argv[3], sys.argv[4]
    model = ddpkit.prepare_model(net(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = ddpkit.Checkpointer(out + "/elsewhere", resume=False)
    step = ckpt.restore(path, model=model, optimizer=opt)
    result = {"step": step, "weights": cpu(model.state_dict()), "optimizer": full_optimizer(model, opt)}
    ddpkit.Checkpointer(f"{out}/ckpt-restored-{tag}", resume=False).save(step, model=model, optimizer=opt)
    if state.is_main:
        torch.save(result, f"{out}/restore-{tag}.pt")
