"""Convert on what the twenty-eighth held-out set of public scripts showed (the measurers' repros, written again
in our own words): each test failed on the tree before its fix."""

from __future__ import annotations

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.command import main  # noqa: E402

SCRIPT = """import torch
from torch.utils.data import DataLoader
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(list(zip(torch.randn(8, 4), torch.randint(0, 2, (8,)))), batch_size=4, shuffle=True):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def test_options_typed_after_the_script_are_converts_own_without_verify(tmp_path, capsys):
    """``ddpkit convert train.py -o out.py``, the order people type (measurer a): without --verify nothing after
    the script is the script's, so -o is convert's; with arguments convert does not know, the one-line error."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.py"
    assert main([str(script), "-o", str(out), "--per-process-batch"]) in (0, 1), capsys.readouterr().err
    assert "prepare_model" in out.read_text() and "global_batch_size" not in out.read_text()
    assert main([str(script), "--epochs", "1"]) == 2
    assert "--verify" in capsys.readouterr().err
