"""What the ninth held-out set (docs/convert.md) found ``ddpkit convert`` owes public scripts, each a case written
in our own words after the pattern the set met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

TRAIN = '''import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, shuffle=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters())
for epoch in range(2):
    for (x,) in loader:
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_a_checkpoint_saved_into_a_file_the_with_opened_guards_the_whole_block():
    """pytorch-vqvae: ``with open(p, 'wb') as f: torch.save(model.state_dict(), f)`` was listed as a block that
    does more than write, and only the save was guarded: every rank still opened (emptied) the file."""
    done = plan(TRAIN + "    with open('model_{}.pt'.format(epoch), 'wb') as f:\n"
                        "        torch.save(model.state_dict(), f)\n")
    assert "    if ddpkit.init().is_main:\n        with open('model_{}.pt'.format(epoch), 'wb') as f:\n" \
           "            torch.save(model.state_dict(), f)\n" in done.text, done.text
    assert not done.left


def test_a_loader_drawn_from_once_before_the_loops_stays_plain():
    """pytorch-vqvae: ``fixed_images, _ = next(iter(test_loader))`` (a shuffled loader, the images shown every
    epoch) became a sharded training loader, its batch halved, with nothing said."""
    source = TRAIN.replace("model = torch.nn.Linear", "shown = DataLoader(TensorDataset(torch.randn(16, 4)), "
                           "batch_size=16, shuffle=True)\nfixed, = next(iter(shown))\nmodel = torch.nn.Linear")
    done = plan(source)
    assert "shown = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=16, shuffle=True)" in done.text
    assert any("drawn from once" in k.what for k in done.kept)
    fed = TRAIN.replace("for (x,) in loader:", "for (x,) in [next(iter(loader))] * 4:")  # (read in a loop: a feed)
    assert "drawn from once" not in str(plan(fed).kept)
