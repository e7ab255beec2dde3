"""Worker: a model built the way a script builds it, right after ``ddpkit.init(seed=0)`` (no reseed).

``python init_paths.py OUT BUILD [--tie] [--init-fn] [--early-optimizer]`` (alone, or under ``ddpkit launch``):
BUILD is ``normal`` or ``empty`` (inside ``ddpkit.init_empty()``); ``--tie`` shares the head's weight with the
embedding (a GPT); ``--init-fn`` re-initialises every Linear orthogonally (a structured init that a model
stitched from several seeds breaks). Rank 0 writes OUT/weights.pt: the full state dict after prepare_model and
after one training step, the number of parameters, and whether the tie survived. ``--early-optimizer`` builds
the optimizer before prepare_model, as the docs say not to.
"""
import sys

import torch
from torch import nn

import ddpkit


class TinyGPT(nn.Module):
    def __init__(self, tie):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        if tie:
            self.head.weight = self.emb.weight  # the GPT idiom: assigned after both were built

    def forward(self, idx):
        return self.head(self.body(self.emb(idx)))


def orthogonal(module):
    if isinstance(module, nn.Linear):
        nn.init.orthogonal_(module.weight)


def main():
    out, build, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
    state = ddpkit.init(seed=0)
    if build == "empty":
        with ddpkit.init_empty():
            model = TinyGPT("--tie" in flags)
    else:
        model = TinyGPT("--tie" in flags)
        if "--init-fn" in flags:
            model.apply(orthogonal)
    early = torch.optim.SGD(model.parameters(), lr=0.1) if "--early-optimizer" in flags else None
    init_fn = orthogonal if build == "empty" and "--init-fn" in flags else None
    model = ddpkit.prepare_model(model, init_fn=init_fn)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = early or torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.arange(8, device=state.device).reshape(2, 4) + state.rank  # any data: the step is checked per mode
    model(idx).sum().backward()
    optimizer.step()
    plain = ddpkit.unwrap(model)
    report = {"initial": initial, "trained": {k: v.detach().clone() for k, v in model.state_dict().items()},
              "parameters": len(list(plain.parameters())), "tied": plain.head.weight is plain.emb.weight}
    if state.is_main:
        torch.save(report, f"{out}/weights.pt")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
