"""Convert on what the twenty-ninth held-out set of public scripts showed, and what the sets before it left (the
measurers' repros, written again in our own words): each test failed on the tree before its fix."""

from __future__ import annotations

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

LOOP = """import json, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
norms = []
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    norms.append({name: p.grad.norm().item() for name, p in model.named_parameters()})
    opt.step()
print(sorted(norms[0]), [n for n, _ in model.named_buffers()])
"""


def test_names_read_from_the_prepared_model_are_the_modules_own():
    """Extra five of set 28 (D6): a log of gradient norms keyed by ``model.named_parameters()`` read
    ``module.0.weight`` under launch where one process writes ``0.weight``; now read from the module."""
    p = plan(LOOP)
    assert "for name, p in ddpkit.unwrap(model).named_parameters()}" in p.text, p.text
    assert "[n for n, _ in ddpkit.unwrap(model).named_buffers()]" in p.text, p.text
    assert any("'module.' prefix" in e.why for e in p.edits), [e.why for e in p.edits]
    assert not p.left, [left.what for left in p.left]
