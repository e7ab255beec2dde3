"""Loaders held in a dict by their split's string (the transfer-learning tutorials' ``dataloaders = {x:
DataLoader(...) for x in ['train', 'val']}`` with a loop over the phases; a literal ``{'train': DataLoader(...),
'test': DataLoader(...)}`` read by key): converted, the trained split sharded, its sums reduced under the split's
test, and what the script prints at 2 processes is what it printed at one."""
import sys

import pytest
from test_convert_twelfth import prints_as_one_process

from conftest import launch, run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

CONVERT = [sys.executable, "-m", "ddpkit", "convert"]

PHASES = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
image_datasets = {x: TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
                  for x, n in [('train', 48), ('val', 20)]}
dataloaders = {x: DataLoader(image_datasets[x], batch_size=8, shuffle=True) for x in ['train', 'val']}
dataset_sizes = {x: len(image_datasets[x]) for x in ['train', 'val']}
device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
model = nn.Linear(6, 3).to(device)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)


def train_model(model, criterion, optimizer, num_epochs=2):
    best_acc = 0.0
    for epoch in range(num_epochs):
        for phase in ['train', 'val']:
            if phase == 'train':
                model.train()
            else:
                model.eval()
            running_loss = 0.0
            running_corrects = 0
            for inputs, labels in dataloaders[phase]:
                inputs, labels = inputs.to(device), labels.to(device)
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == 'train'):
                    outputs = model(inputs)
                    _, preds = torch.max(outputs, 1)
                    loss = criterion(outputs, labels)
                    if phase == 'train':
                        loss.backward()
                        optimizer.step()
                running_loss += loss.item() * inputs.size(0)
                running_corrects += torch.sum(preds == labels.data)
            epoch_loss = running_loss / dataset_sizes[phase]
            epoch_acc = running_corrects.double() / dataset_sizes[phase]
            print(f'{phase} {epoch_loss:.4f} {epoch_acc:.4f}')
            if phase == 'val' and epoch_acc > best_acc:
                best_acc = epoch_acc
    return model


train_model(model, criterion, optimizer)
'''

LITERAL = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
train_set = TensorDataset(torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g))
test_set = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
loaders = {
    'train': DataLoader(train_set, batch_size=8, shuffle=True),
    'test': DataLoader(test_set, batch_size=8, shuffle=False),
}
model = nn.Linear(6, 3)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)


def train_epoch(loader, model, criterion, optimizer):
    loss_sum = 0.0
    correct = 0.0
    for inputs, targets in loader:
        output = model(inputs)
        loss = criterion(output, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * inputs.size(0)
        correct += output.argmax(1).eq(targets).sum().item()
    return {'loss': loss_sum / len(loader.dataset), 'accuracy': correct / len(loader.dataset) * 100.0}


def evaluate(loader, model, criterion):
    loss_sum = 0.0
    correct = 0.0
    model.eval()
    for inputs, targets in loader:
        output = model(inputs)
        loss_sum += criterion(output, targets).item() * inputs.size(0)
        correct += output.argmax(1).eq(targets).sum().item()
    return {'loss': loss_sum / len(loader.dataset), 'accuracy': correct / len(loader.dataset) * 100.0}


for epoch in range(2):
    model.train()
    train_res = train_epoch(loaders['train'], model, criterion, optimizer)
    test_res = evaluate(loaders['test'], model, criterion)
    tr, te = train_res, test_res
    print(f"{epoch} {tr['loss']:.4f} {tr['accuracy']:.2f} {te['loss']:.4f} {te['accuracy']:.2f}")
'''


def test_a_dict_of_loaders_by_split_with_a_loop_over_the_phases_reduces_the_trained_splits_sums(tmp_path):
    p = plan(PHASES)
    assert not p.left, p.left
    assert "if x == 'train' else DataLoader(image_datasets[x]" in p.text
    assert "running_loss = ddpkit.reduce(running_loss) if phase == 'train' else running_loss" in p.text
    prints_as_one_process(tmp_path, PHASES, p.text)
    again = plan(p.text)
    assert again.text == p.text and not again.left, again.left


def test_a_dict_literal_of_loaders_read_by_key_shards_the_one_trained_on(tmp_path):
    p = plan(LITERAL)
    assert not p.left, p.left
    assert "'train': ddpkit.data_loader(train_set" in p.text and "'test': DataLoader(test_set" in p.text
    assert "loss_sum = ddpkit.reduce(loss_sum)" in p.text
    prints_as_one_process(tmp_path, LITERAL, p.text)
    again = plan(p.text)
    assert again.text == p.text and not again.left, again.left


def test_items_of_a_dict_literal_handed_to_another_modules_loops_are_followed(tmp_path):
    """swa's shape: ``utils.train_epoch(loaders['train'], ...)`` and ``utils.evaluate(loaders['test'], ...)``."""
    head, rest = LITERAL.split("def train_epoch", 1)
    functions, loop = rest.split("\n\nfor epoch", 1)
    (tmp_path / "utils.py").write_text("import torch\n\n\ndef train_epoch" + functions + "\n")
    entry = head.replace("import torch\n", "import torch\nimport utils\n", 1) + "\nfor epoch" + \
        loop.replace("train_epoch(", "utils.train_epoch(").replace("evaluate(", "utils.evaluate(")
    (tmp_path / "train.py").write_text(entry)
    out = tmp_path / "out"
    r = run_cmd(CONVERT + ["--imports", "-o", str(out), str(tmp_path / "train.py")], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss_sum = ddpkit.reduce(loss_sum)" in (out / "utils.py").read_text()
    one = run_cmd([sys.executable, str(tmp_path / "train.py")], timeout=60, cwd=tmp_path)
    two = launch(out / "train.py", nproc=2, timeout=120)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.split() == one.stdout.split(), (one.stdout, two.stdout)


@pytest.mark.parametrize("sizes", ["len(dataloaders[phase].dataset)", "from-loaders"])
def test_review_a_phase_loops_sums_over_the_items_dataset_are_reduced(tmp_path, sizes):
    """Review: ``running_loss / len(dataloaders[phase].dataset)``, and sizes taken from the loaders
    (``{x: len(dataloaders[x].dataset) ...}``), were no dataset size: the training split's loss rank 0's half."""
    source = PHASES.replace("dataset_sizes[phase]", "len(dataloaders[phase].dataset)") if sizes != "from-loaders" \
        else PHASES.replace("dataset_sizes = {x: len(image_datasets[x])",
                            "dataset_sizes = {x: len(dataloaders[x].dataset)")
    p = plan(source)
    assert "running_loss = ddpkit.reduce(running_loss) if phase == 'train' else running_loss" in p.text, p.text
    prints_as_one_process(tmp_path, source, p.text)


def test_review_an_evaluation_of_the_trained_key_is_reduced_or_refused(tmp_path):
    """Review: ``evaluate(loaders['train'])`` (one function for both keys) and a last loop over
    ``dataloaders['train']`` read the sharded loader with nothing summing the ranks: the accuracy rank 0's."""
    shared = LITERAL.replace("    tr, te = train_res, test_res\n",
                             "    tr, te = evaluate(loaders['train'], model, criterion), test_res\n")
    assert any(x.blocks and "also runs over" in x.what for x in plan(shared).left), plan(shared).left
    final = PHASES + ("correct = 0\nwith torch.no_grad():\n    for inputs, labels in dataloaders['train']:\n"
                      "        correct += (model(inputs).argmax(1) == labels).sum().item()\n"
                      "print('final', correct / dataset_sizes['train'])\n")
    p = plan(final)
    assert "    correct = ddpkit.reduce(correct)" in p.text or "correct = ddpkit.reduce(correct)" in p.text, p.text
    prints_as_one_process(tmp_path, final, p.text)


def test_review_a_sum_over_every_split_begun_outside_their_loop_is_refused():
    """Review: ``total_loss = 0.0`` per epoch, summed in both phases: skipped with no word (the trained split's
    part rank 0's, the other's whole)."""
    source = PHASES.replace("        for phase in ['train', 'val']:\n",
                            "        total_loss = 0.0\n        for phase in ['train', 'val']:\n").replace(
        "                running_loss += loss.item() * inputs.size(0)\n",
        "                running_loss += loss.item() * inputs.size(0)\n"
        "                total_loss += loss.item()\n").replace(
        "    return model\n", "        print(total_loss / (dataset_sizes['train'] + dataset_sizes['val']))\n"
                           "    return model\n")
    assert source.count("total_loss") == 3
    assert any(x.blocks and "total_loss summed over every split" in x.what for x in plan(source).left)
