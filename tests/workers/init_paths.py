"""Worker: a model built the way a script builds it, right after ``ddpkit.init(seed=0)`` (no reseed).

``python init_paths.py OUT BUILD [FLAGS]`` (alone, or under ``ddpkit launch``). BUILD is ``normal`` or ``empty``
(inside ``ddpkit.init_empty()``). FLAGS: ``--tie`` shares the head's weight with the embedding (a GPT),
``--tie-head`` the other way round (nanoGPT); ``--init-fn`` re-initialises every Linear orthogonally (a
structured init that a model stitched from several seeds breaks), ``--numpy`` with numpy's generator;
``--early-optimizer`` builds the optimizer before prepare_model, as the docs say not to. Rank 0 writes
OUT/weights.pt: the full state dict after prepare_model and after one step, the parameter count, the tie.
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
        if tie == "--tie":
            self.head.weight = self.emb.weight  # the GPT idiom: assigned after both were built
        elif tie == "--tie-head":
            self.emb.weight = self.head.weight  # nanoGPT's direction: the head's values are the tie's

    def forward(self, idx):
        return self.head(self.body(self.emb(idx)))


def orthogonal(module):
    if isinstance(module, nn.Linear):
        nn.init.orthogonal_(module.weight)


def numpy_init(module):
    """An init that draws from numpy, not torch."""
    import numpy as np

    if isinstance(module, nn.Linear):
        module.weight.data.copy_(torch.from_numpy(np.random.randn(*module.weight.shape)))


def main():
    out, build, flags = sys.argv[1], sys.argv[2], set(sys.argv[3:])
    if "--numpy" in flags:
        import numpy  # noqa: F401  (imported before init, so init(seed=) seeds it, as scripts have it)
    state = ddpkit.init(seed=0)
    tie = next((f for f in ("--tie", "--tie-head") if f in flags), None)
    init = numpy_init if "--numpy" in flags else orthogonal if "--init-fn" in flags else None
    if build == "empty":
        with ddpkit.init_empty():
            model = TinyGPT(tie)
    else:
        model = TinyGPT(tie)
        if init is not None:
            model.apply(init)
    early = torch.optim.SGD(model.parameters(), lr=0.1) if "--early-optimizer" in flags else None
    init_fn = init if build == "empty" else None
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
