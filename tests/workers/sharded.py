"""Worker for the fsdp tests: meta-device init, the early-optimizer error, full state dicts, join refused.

``ddpkit launch --mode fsdp --nproc-per-node N sharded.py OUT``; rank 0 writes OUT/sharded<N>.pt.
"""
import sys

import torch
from torch import nn

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=0)


class Scaled(nn.Module):
    """A module with a parameter of its own and no reset_parameters: needs init_fn after init_empty."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.scale = nn.Parameter(torch.empty(7))

    def forward(self, x):
        return self.inner(x) * self.scale


class Causal(nn.Module):
    """A causal-mask buffer (bool) of a module with no reset_parameters: only init_fn can fill it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)))
        self.register_buffer("upper", ~torch.tril(torch.ones(3, 3, dtype=torch.bool)))

    def forward(self, x):
        return self.proj(x).masked_fill(~self.mask[: x.shape[-1]], 0.0)


def init_weights(module):  # nanoGPT's style: model.apply(init_fn)
    if isinstance(module, Causal):  # in place, and by assignment: both are how scripts fill a mask
        module.mask.copy_(torch.tril(torch.ones_like(module.mask)))
        module.upper = ~torch.tril(torch.ones(3, 3, dtype=torch.bool))
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, Scaled):
        nn.init.uniform_(module.scale, 0.5, 1.5)


class MaskedLinear(nn.Linear):
    """A module with reset_parameters, which does not touch its bool mask: only init_fn can fill it."""

    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def scale_residuals(module):  # GPT-2's residual scaling: what reset_parameters drew, changed in place
    if isinstance(module, nn.Linear):
        with torch.no_grad():
            module.weight.mul_(0.5)
            module.bias.clamp_(-0.1, 0.1)


def mlp():
    return nn.Sequential(nn.Linear(5, 9), nn.BatchNorm1d(9), nn.ReLU(), nn.Linear(9, 3))


def built_normally(build, init_fn=None):
    torch.manual_seed(0)
    model = build()
    if init_fn is not None:
        model.apply(init_fn)
    return {k: v.clone() for k, v in model.state_dict().items()}


def built_empty(build, init_fn=None, shard=None):
    torch.manual_seed(0)
    with ddpkit.init_empty():
        model = build()
    assert all(p.is_meta for p in model.parameters())
    prepared = ddpkit.prepare_model(model, init_fn=init_fn, shard=shard)
    return prepared, prepared.state_dict()


results = {"empty": {}}
for name, build, init_fn, shard in [("mlp", mlp, None, [nn.Linear]), ("mlp_root", mlp, None, None),
                                    ("scaled", Scaled, init_weights, [nn.Linear]),
                                    ("causal_mask", Causal, init_weights, [nn.Linear]),
                                    ("scaled_in_place", mlp, scale_residuals, [nn.Linear])]:
    _, full = built_empty(build, init_fn, shard)
    results["empty"][name] = (built_normally(build, init_fn), full)

try:  # a meta module with a parameter of its own and no reset_parameters
    built_empty(Scaled)
    results["no_init"] = None
except ValueError as exc:
    results["no_init"] = str(exc)
try:  # a buffer its module's reset_parameters does not write
    built_empty(MaskedLinear)
    results["reset_misses"] = None
except ValueError as exc:
    results["reset_misses"] = str(exc)

early = mlp()
early_opt = torch.optim.SGD(early.parameters(), lr=0.1)
model = ddpkit.prepare_model(early, shard=[nn.Linear])
model(torch.randn(4, 5).to(state.device)).sum().backward()
try:
    early_opt.step()
    results["early_optimizer"] = None
except RuntimeError as exc:
    results["early_optimizer"] = str(exc)

saved = model.state_dict()  # full tensors, on every rank
opt = torch.optim.SGD(model.parameters(), lr=0.5)
opt.step()  # the gradients of the forward above
changed = model.state_dict()
prefix = "module." if ddpkit.unwrap(model) is not model else ""  # ddpkit's wrappers take a plain-torch DDP file
model.load_state_dict({f"{prefix}{k}": v for k, v in saved.items()})
restored = model.state_dict()
results["round_trip"] = {"changed": any(not torch.equal(saved[k], changed[k]) for k in saved),
                         "restored": all(torch.equal(saved[k], restored[k]) for k in saved),
                         "plain_keys": sorted(saved) == sorted(mlp().state_dict())}
results["unwrap_is_sharded"] = type(ddpkit.unwrap(model).state_dict()["0.weight"]).__name__
try:
    with ddpkit.join(model):
        pass
    results["join"] = None
except ValueError as exc:
    results["join"] = str(exc)
if state.is_main:
    torch.save(results, f"{sys.argv[1]}/sharded{state.world_size}.pt")
