"""Worker: a prepared model keeps the user's methods and attributes (issue 26 item 3), and
``ddpkit.accumulate`` (gradient accumulation). ``python first_hour.py CASE OUT`` or under ``ddpkit launch``.

CASE ``methods``: asserts here, in whatever mode the launch chose, and writes OUT/methods-rank<R>.json.
CASE ``accumulate``: trains with ``ddpkit.accumulate`` and saves OUT/accumulate-<mode>.pt on rank 0.
"""
import json
import os
import sys

import torch
from torch import nn

import ddpkit

torch.set_num_threads(1)
case, out_dir = sys.argv[1], sys.argv[2]
state = ddpkit.init(seed=3)


class WordLM(nn.Module):
    """The shapes of public scripts: word_language_model's init_hidden, a VAE's decode, minGPT's
    configure_optimizers, plain attributes read in forward."""

    def __init__(self, ntoken=7, nhid=4):
        super().__init__()
        self.ntoken, self.nhid, self.temperature = ntoken, nhid, 1.0
        self.encoder = nn.Embedding(ntoken, nhid)
        self.rnn = nn.LSTM(nhid, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid)

    def decode(self, z):
        return self.decoder(z) / self.temperature

    def configure_optimizers(self, lr=0.1):
        return torch.optim.SGD(self.parameters(), lr=lr)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return self.decode(out), hidden


def is_dtensor(t):
    return type(t).__name__ == "DTensor"


def methods():
    model = ddpkit.prepare_model(WordLM())
    plain = WordLM()
    plain.load_state_dict(model.state_dict())  # rank 0's weights, which every rank's wrapper holds
    facts = {"mode": state.mode, "ntoken": model.ntoken}
    hidden = model.init_hidden(3)
    facts["hidden"] = [list(h.shape) for h in hidden]
    assert not any(is_dtensor(h) for h in hidden), [type(h) for h in hidden]
    # the same data on every rank: the averaged gradients are the local ones, those of the plain model
    x, z = torch.arange(15).reshape(5, 3) % 7, torch.linspace(-1, 1, 12).reshape(3, 4)
    for net in (model, plain):  # one loss through a method called on the wrapper (first: fsdp reshards after
        decoded = net.decode(z)  # it, and the backward gathers again) and through forward
        out, _ = net(x, net.init_hidden(3))
        (out.square().mean() + decoded.square().mean()).backward()
    facts["forward"] = list(out.shape)
    grads = [p.grad.full_tensor() if is_dtensor(p.grad) else p.grad for p in ddpkit.unwrap(model).parameters()]
    facts["grads_equal"] = all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, plain.parameters()))
    # the methods leave fsdp's parameters sharded: an optimizer built now holds the shards
    facts["sharded_after"] = all(is_dtensor(p) for p in model.parameters())
    try:
        opt = model.configure_optimizers()
        facts["optimizer"] = [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    except RuntimeError as exc:
        facts["optimizer"] = str(exc)
    opt = ddpkit.unwrap(model).configure_optimizers()  # the plain module: always the trained tensors
    facts["unwrap_optimizer"] = [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    model.temperature = 2.0  # the module's attribute: the module's forward sees it
    facts["temperature"] = [ddpkit.unwrap(model).temperature, model.temperature]
    model.note = "mine"  # a name neither has: the wrapper's, read back through it
    facts["note"] = [model.note, hasattr(ddpkit.unwrap(model), "note") and model is not ddpkit.unwrap(model)]
    facts["own"] = {"module": getattr(model, "module", None) is ddpkit.unwrap(model),
                    "no_sync": hasattr(model, "no_sync"), "keys": sorted(model.state_dict())[:2]}
    try:
        model.init_hiddn(3)
    except AttributeError as exc:
        facts["missing"] = str(exc)
    facts["guards"] = guards()
    # ``head = model[-1]`` of a prepared nn.Sequential (fine-tune the head): the module's item, in every mode
    seq = ddpkit.prepare_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    facts["item"] = seq[-1] is ddpkit.unwrap(seq)[-1] and isinstance(seq[0], nn.Linear)
    with open(os.path.join(out_dir, f"methods-rank{state.rank}.json"), "w") as f:
        json.dump(facts, f)


class Probe(nn.Module):
    """Methods a reviewer found that leave fsdp's gathered parameters in the user's hands."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(5, 4), nn.Linear(4, 2)
        self.logger = "mine"  # DDP's own name too

    def forward(self, idx):
        return self.fc(self.emb(idx))

    def view(self, how):  # a view of the gathered parameter: its storage is freed by the reshard
        w = self.emb.weight
        return {"detach": lambda: w.detach(), "data": lambda: w.data, "row": lambda: w[0], "T": lambda: w.T}[how]()

    def copy(self):
        return self.emb.weight.detach().clone()

    def fails(self):
        self.fc(self.emb(torch.zeros(1, dtype=torch.long)))
        raise ValueError("k > 4")

    def rows(self):
        yield from self.emb.weight

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is the fact
        return f"{type(exc).__name__}: {exc}"
    return None


def guards():
    """Each case: the error (or None), and whether the parameters are sharded after it (fsdp)."""
    import copy
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ddpkit.prepare_model(Probe())
    facts = {"shadowed": [str(w.message) for w in caught if "own attribute" in str(w.message)]}
    if state.mode == "ddp":  # DDP's __setstate__ sets its C++ logger after the state is restored
        facts["copied_logger"] = copy.deepcopy(model).module.logger
    def sharded():
        return all(is_dtensor(p) for p in model.parameters()) if state.mode == "fsdp" else True
    facts.update({how: _error(lambda how=how: model.view(how).sum().item()) for how in ("detach", "data", "row", "T")})
    facts["copy"] = _error(lambda: model.copy().sum().item())
    facts["fails"] = [_error(model.fails), sharded()]
    facts["rows"] = [_error(lambda: list(model.rows())), sharded()]
    with torch.no_grad():  # a sanity-check forward before the optimizer: fsdp's root stays gathered after it
        model(torch.zeros(2, dtype=torch.long))
    facts["after_forward"] = sharded()
    facts["opt_wrapper"] = _error(model.configure_optimizers)
    opt = ddpkit.unwrap(model).configure_optimizers()
    before = model.state_dict()["fc.weight"].clone()
    model(torch.zeros(2, dtype=torch.long)).square().sum().backward()
    opt.step()
    facts["unwrap_trains"] = not torch.equal(before, model.state_dict()["fc.weight"])
    facts["replace"] = _error(lambda: setattr(model, "fc", nn.Linear(4, 3)))
    facts["add"] = _error(lambda: setattr(model, "head", nn.Linear(4, 3)))
    facts["param"] = _error(lambda: setattr(model, "scale", nn.Parameter(torch.ones(1))))
    return facts


def samples(n=40):
    g = torch.Generator().manual_seed(123)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def accumulate(steps=4, epochs=2):
    """40 samples, a global micro-batch of 4 (2 per process): 10 micro-steps an epoch, groups of 4, 4 and 2.
    One process instead takes batches of 16 (16, 16, 8): the same samples in each update."""
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), shard=[nn.Linear])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one = state.world_size == 1
    loader = ddpkit.data_loader(samples(), batch_size=16 if one else 16 // state.world_size // steps, seed=5)
    handle = torch.compile(model)
    synced, flags = [], []  # per backward: did it reduce gradients; did accumulate say it syncs
    if state.mode == "ddp":  # torch's all-reduce, counted
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting(process_group, bucket):
            calls.append(1)
            return allreduce_hook(process_group, bucket)

        calls = []
        model.register_comm_hook(None, counting)
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            if one:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                continue
            before = len(calls) if state.mode == "ddp" else 0
            # a torch.compile handle (lazy: nothing compiles unless called) must skip the reduction as well
            with ddpkit.accumulate(handle, i, steps=steps, total=len(loader)) as micro:
                (nn.functional.cross_entropy(model(x), y) / micro.size).backward()
            flags.append(micro.sync)
            if state.mode == "ddp":
                synced.append(len(calls) > before)
            else:  # fsdp: the sharded gradient appears only when a reduce-scatter ran (zero_grad sets None)
                synced.append(all(p.grad is not None for p in model.parameters()))
            if micro.sync:
                opt.step()
                opt.zero_grad()
    weights = model.state_dict()
    if state.is_main:
        torch.save({"weights": weights, "synced": synced, "flags": flags},
                   os.path.join(out_dir, f"accumulate-{state.mode}.pt"))


if case == "methods":
    methods()
elif case == "accumulate":
    accumulate()
ddpkit.shutdown()
