"""Review 37 (a reviewer who wrote none of it) on the twenty-fourth set's fixes: each case written in our own words
after the reviewer's repro (/work/review37_out/REPORT.md at the time)."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

PEEKED = '''import torch
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.randn(48, 3), torch.randn(48, 1))
full = DataLoader(data, batch_size=len(data))
everything = next(iter(full))
X = everything[0]
Y = everything[1]
net = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    for xb, yb in zip(X.split(12), Y.split(12)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xb), yb).backward()
        opt.step()
'''


def test_a_part_of_a_batch_drawn_once_is_no_loader():
    """D11 / D2: ``everything = next(iter(full_loader))`` then ``inputs = everything[0]`` split by hand for
    training: the subscript was followed as a loader's, the full-batch loader made a sharded training loader."""
    result = plan(PEEKED.replace("everything[0]", "everything['x']").replace("everything[1]", "everything['y']"))
    assert "ddpkit.data_loader" not in result.text, result.text


CLASH = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def fit(net, opt, data, criterion):
    running = 0.0
    loader = DataLoader(data, batch_size=16, shuffle=True)
    for x, y in loader:
        opt.zero_grad()
        loss = criterion(net(x), y)
        loss.backward()
        opt.step()
        running += loss.item()
    return running / len(loader)


def score(net, data, criterion):
    x, y = data.tensors
    return criterion(net(x), y).item()


net = torch.nn.Linear(5, 3)
data = TensorDataset(torch.randn(64, 5), torch.randint(0, 3, (64,)))
runs = {"fit": fit}
print(runs["fit"](net, torch.optim.SGD(net.parameters(), lr=0.1), data, torch.nn.CrossEntropyLoss(reduction="sum")))
print(score(net, data, torch.nn.CrossEntropyLoss()))
'''


def test_a_criterion_another_function_is_handed_decides_nothing():
    """D7: ``score(..., CrossEntropyLoss())`` decided the criterion of ``fit(..., reduction="sum")`` (a parameter of
    the same name): the summed loss was averaged across ranks as a batch mean, the printed value halved."""
    assert "running = ddpkit.reduce(running, op='mean')" not in plan(CLASH).text


AUG = '''import torch
from torch.utils.data import DataLoader, TensorDataset

net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4, shuffle=True):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    path = "ckpt"
    path += ".pth"
    if epoch == 1:
        torch.save(net.state_dict(), path)
net.load_state_dict(torch.load("ckpt.pth"))
'''


def test_a_save_path_built_by_parts_still_owes_the_read_its_barrier():
    """D1: ``path = "ckpt"; path += ".pth"`` read as the file ``ckpt``: the exact-name rule dropped the barrier
    before ``torch.load("ckpt.pth")``."""
    result = plan(AUG)
    assert "ddpkit.barrier()" in result.text or [x for x in result.left if "barrier" in x.fix], result.text


def test_a_file_run_by_runpy_as_main_keeps_its_training():
    """D3: ``runpy.run_path("train.py", run_name="__main__")`` counted as an import: train.py's main block was
    taken for a demo, its loader dropped, and the file refused "fed by hand"."""
    from ddpkit.commands.convert.crossing import _imported

    assert _imported("import runpy\nrunpy.run_path('train.py', run_name='__main__')\n") == {"runpy"}


MAIN_CLEAN = '''import os
import shutil
import torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    os.makedirs("out", exist_ok=True)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in DataLoader(TensorDataset(torch.randn(8, 3), torch.randn(8, 1)), batch_size=4, shuffle=True):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    torch.save(net.state_dict(), "out/n.pth")


if __name__ == "__main__":
    main()
    other = torch.nn.Linear(3, 1)
    other.load_state_dict(torch.load("out/n.pth"))
    {block}
'''


def test_a_clean_up_in_the_main_block_waits_below_the_read_not_above_main():
    """D8: the outermost ``if`` holding the removal was the main guard: the "before" barrier went above ``main()``,
    not between the read and the removal."""
    text = plan(MAIN_CLEAN.format(block='if os.path.exists("out"):\n        shutil.rmtree("out")\n'
                                        '        print("gone")')).text
    lines = text.splitlines()
    at = lines.index('    if os.path.exists("out"):')
    assert lines[at - 1] == "    ddpkit.barrier()" and "torch.load" in lines[at - 2], text
    assert lines.index("if __name__ == \"__main__\":") + 1 == lines.index("    main()"), text


def test_a_clean_up_whose_if_also_holds_the_read_is_listed():
    """D8: the removal and the read it must wait for inside one ``if``: a barrier before that ``if`` waited for
    nothing; listed, as before the fix."""
    source = MAIN_CLEAN.format(block="pass").replace(
        '    other = torch.nn.Linear(3, 1)\n    other.load_state_dict(torch.load("out/n.pth"))\n    pass\n',
        '    if os.environ.get("CHECK"):\n        other = torch.nn.Linear(3, 1)\n'
        '        other.load_state_dict(torch.load("out/n.pth"))\n        if os.path.exists("out"):\n'
        '            shutil.rmtree("out")\n            print("gone")\n')
    result = plan(source)
    assert [x for x in result.left if "rmtree" in x.what], (result.left, result.text)


LISTED = '''import torch


def batches():
    found = []
    for name in ["a.pt", "b.pt"]:
        found.append(torch.load(name))
    return found


data = batches()
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for x, y in data:
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
'''


def test_a_list_of_batches_loaded_from_files_is_no_pickled_loader():
    """D5: ``torch.load`` inside the helper that builds a list of batches was said to be "a loader loaded from a
    file", with a fix (``data.dataset``) a list does not have."""
    said = [x for x in plan(LISTED).left if x.blocks]
    assert said and "fed by hand" in said[0].what and "loaded from a file" not in said[0].what, said


def test_getattr_of_torchs_optim_reads_no_project_class(tmp_path):
    """D10: ``getattr(optim, args.optim)`` made every class of the project's modules count as used: an unused
    logger class that writes a file was said."""
    from ddpkit.commands.convert import unread

    (tmp_path / "logs.py").write_text("class CsvLogger:\n    def write(self, p):\n        open(p, 'w').write('x')\n")
    script = tmp_path / "train.py"
    script.write_text("import torch.optim as optim\nimport logs\nopt = getattr(optim, args.optim)(params)\n")
    assert unread.writers(str(script), ["logs.py"], script.read_text()) == []


def test_a_path_of_the_files_own_folder_moves_with_it():
    """D6: one ``dirname(__file__)`` (the file's own folder, copied beside it) was said to name other folders."""
    from ddpkit.commands.convert.project import moved_file_paths

    assert moved_file_paths("/p/src", "/p/src/out", {"a.py": "here = os.path.dirname(__file__)\n"}) == []
    assert moved_file_paths("/p/src", "/p/src/out", {"a.py": "up = Path(__file__).parent.parent\n"})


TIMER = '''import time
import torch
from torch.utils.data import DataLoader, TensorDataset


class AvgMeter:
    def __init__(self):
        self.total, self.n = 0.0, 0

    def add(self, v):
        self.total, self.n = self.total + v, self.n + 1


net = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
clock = AvgMeter()
end = time.time()
for x, y in DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4, shuffle=True):
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    opt.step()
    clock.add(time.time() - end)
    print(clock.total)
'''


def test_a_timer_fed_by_add_is_no_meter_of_the_shard():
    """D9: a timer fed by ``add(time.time() - end)`` was said to show "this rank's running share of its shard"."""
    assert not [x for x in plan(TIMER).kept if "shows the meter" in x.what]


BEFORE_STEP = '''import torch
from torch.utils.data import DataLoader, TensorDataset

net = torch.nn.Linear(10, 2)
crit = torch.nn.CrossEntropyLoss()
opt = torch.optim.Adam(net.parameters())
n = 64
loader = DataLoader(TensorDataset(torch.randn(n, 10), torch.randint(0, 2, (n,))), batch_size=16, shuffle=True)
for epoch in range(2):
    running = 0.0
    for i, (x, y) in enumerate(loader):
        out = net(x)
        loss = crit(out, y)
        running += loss.item() * len(x)
        print(f"[{epoch}][{i}] loss {loss:.3f}")
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(epoch, running / n)
'''


def test_the_steps_loss_printed_before_its_backward_is_said():
    """The extra five's dogs-vs-cats project: the step's loss printed in the loop above ``loss.backward()``, beside
    an epoch sum that is reduced: rank 0's half batch, no line (the same print below the step was said)."""
    assert [x.line for x in plan(BEFORE_STEP).kept if "the step's loss" in x.what] == [15]
