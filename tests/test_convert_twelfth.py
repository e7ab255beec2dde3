"""What the eleventh held-out set's leftovers and the twelfth set (docs/convert.md) showed ``ddpkit convert`` owes
public scripts: each a case written in our own words after the pattern met."""
import sys

import pytest

pytest.importorskip("libcst")

from conftest import launch, run_cmd  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402


def prints_as_one_process(tmp_path, source, converted):
    """The converted script, launched at 2 processes, prints what the original printed at one."""
    one = run_cmd([sys.executable, "-c", source], timeout=60)
    script = tmp_path / "converted.py"
    script.write_text(converted)
    two = launch(script, nproc=2, timeout=120)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.split() == one.stdout.split(), (one.stdout, two.stdout)


TRAIN_METRICS = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def train(trainloader, net, criterion, optimizer):
    net.train()
    train_loss = 0
    correct = 0
    total = 0
    for batch_idx, (inputs, targets) in enumerate(trainloader):
        batch_size = inputs.size(0)
        total += batch_size
        optimizer.zero_grad()
        outputs = net(inputs)
        loss = criterion(outputs, targets)
        loss.backward()
        optimizer.step()
        train_loss += loss.item() * batch_size
        _, predicted = torch.max(outputs.data, 1)
        correct += predicted.eq(targets.data).sum().item()
    return train_loss / total, 100. * correct / total


torch.manual_seed(0)
net = nn.Linear(6, 3)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
trainloader = DataLoader(data, batch_size=16, shuffle=True)
optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
for epoch in range(2):
    loss, acc = train(trainloader, net, nn.CrossEntropyLoss(), optimizer)
    print(f"{epoch} {loss:.5f} {acc:.3f}")
'''

BATCH_MEAN = TRAIN_METRICS.replace("return train_loss / total,", "return train_loss / (batch_idx + 1),").replace(
    "loss.item() * batch_size", "loss.item()")


@pytest.mark.parametrize("source", [TRAIN_METRICS, BATCH_MEAN], ids=["over-samples", "over-batches"])
def test_training_metrics_a_function_returns_from_its_own_sums_are_every_ranks(tmp_path, source):
    """loss-landscape's ``train()``: ``return train_loss / total, 100. * correct / total`` of ``total +=
    inputs.size(0)``. The loss and accuracy it returned were rank 0's shard's at 2 processes. The sample sums
    are summed now, a mean over this rank's batches averaged; the weights never move (lr 0), so both runs print
    the same numbers."""
    done = plan(source)
    assert "total = ddpkit.reduce(total)" in done.text and "correct = ddpkit.reduce(correct)" in done.text
    mean = "op='mean'" if "batch_idx + 1" in source else ""
    assert f"train_loss = ddpkit.reduce(train_loss{', ' + mean if mean else ''})" in done.text, done.text
    prints_as_one_process(tmp_path, source, done.text)


PICKED = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--model-name", default="small")
parser.add_argument("--cuda", action="store_true")
args = parser.parse_args()

if args.model_name == "small":
    model = nn.Linear(6, 3)
elif args.model_name == "big":
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))

if args.cuda:
    if torch.cuda.device_count() > 1:
        model = nn.DataParallel(model)
    model = model.cuda()

optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
loader = DataLoader(TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)),
                    batch_size=16, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        if args.cuda:
            x, y = x.cuda(), y.cuda()
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(epoch, round(loss.item(), 3))
'''


def test_a_model_picked_by_an_elif_chain_and_moved_under_a_cuda_flag_is_prepared_below_the_flag(tmp_path):
    """Stand-Alone-Self-Attention: ``if name == ...: model = A()`` / ``elif ...: model = B()`` with no ``else``,
    then ``if args.cuda: (DataParallel); model = model.cuda()``. The wrap went into the ``if args.cuda:`` block
    and was listed: on CPU the model was never prepared. A chain with no ``else`` whose branches all bind the
    model (the path through none is the script's own NameError) binds it on every path; prepared below the flag."""
    done = plan(PICKED)
    assert not done.left, done.left
    assert "\nmodel = ddpkit.prepare_model(model)\n\noptimizer" in done.text, done.text
    script = tmp_path / "picked.py"
    script.write_text(done.text)
    for args in ((), ("--model-name", "big")):
        two = launch(script, *args, nproc=2, timeout=120)
        assert two.returncode == 0, two.stderr[-2000:]
    alone = PICKED.replace("\nif args.cuda:\n    if torch.cuda.device_count() > 1:\n        model = nn.DataParallel("
                           "model)\n    model = model.cuda()\n", "")
    done = plan(alone)  # no flag: below the chain
    assert not done.left and "\nmodel = ddpkit.prepare_model(model)\n\noptimizer" in done.text, done.text


def test_review_a_count_alone_a_running_total_a_mixed_divisor_and_two_loops_into_one_sum(tmp_path):
    """Review of the training metrics: (1) ``return correct, total`` (the caller divides) reduced ``total`` alone
    and halved the accuracy; (2) two passes adding to one ``correct`` / ``total`` reduced after each; (3) a
    running total kept across calls (``global``) was reduced again at every call; (4) ``correct / ((i + 1) *
    batch_size)`` was averaged as a mean over batches (1/N of the truth). Each now stays rank 0's or is reduced
    once, after the last loop."""
    counts = TRAIN_METRICS.replace("return train_loss / total, 100. * correct / total", "return correct, total")
    running = TRAIN_METRICS.replace("    train_loss = 0\n    correct = 0\n    total = 0\n",
                                    "    global train_loss, correct, total\n").replace(
        "torch.manual_seed(0)\n", "train_loss, correct, total = 0, 0, 0\ntorch.manual_seed(0)\n")
    mixed = TRAIN_METRICS.replace("return train_loss / total, 100. * correct / total",
                                  "return 0.0, 100. * correct / ((batch_idx + 1) * batch_size)")
    for source in (counts, running, mixed):
        assert "ddpkit.reduce(" not in plan(source).text, plan(source).text
    second = ("    for inputs, targets in trainloader:\n        total += inputs.size(0)\n"
              "        optimizer.zero_grad()\n"
              "        outputs = net(inputs)\n        loss = criterion(outputs, targets)\n        loss.backward()\n"
              "        optimizer.step()\n        train_loss += loss.item() * inputs.size(0)\n")
    counted = TRAIN_METRICS.replace("    return train_loss", second + "    return train_loss")
    assert "ddpkit.reduce(" not in plan(counted).text  # correct's count grows in the second loop: rank 0's both
    two = TRAIN_METRICS.replace("    return train_loss", second +
                                "        correct += outputs.argmax(1).eq(targets).sum().item()\n    return train_loss")
    done = plan(two)
    for name in ("total", "train_loss", "correct"):
        assert done.text.count(f"{name} = ddpkit.reduce({name})") == 1, done.text
    assert done.text.index("correct = ddpkit.reduce") > done.text.rindex("optimizer.step()"), done.text
    prints_as_one_process(tmp_path, two, done.text)


def test_review_an_elif_chain_in_a_loop_is_no_binding_on_every_path():
    """Review: in a loop, the path through no branch keeps the last pass's model, prepared already: a wrap
    below the chain wrapped it again (DDP inside DDP). Listed, as before the chain rule."""
    looped = ('import torch\nfrom torch import nn\nfor stage in ["small", "big", "again"]:\n'
              '    if stage == "small":\n        model = nn.Linear(6, 3)\n    elif stage == "big":\n'
              '        model = nn.Linear(6, 3)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n'
              '    opt.step()\n')
    done = plan(looped)
    assert "    model = ddpkit.prepare_model(model)\n" not in done.text, done.text
    assert any("one branch of an if" in left.what for left in done.left), done.left


BAR = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

batch_size = 4
train_dataset = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
model = torch.nn.Linear(3, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
train_dataloader = DataLoader(train_dataset, batch_size=batch_size, shuffle=True)
for epoch in range(2):
    with tqdm(total=(len(train_dataset) - len(train_dataset) % batch_size)) as t:
        for x, y in train_dataloader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t.update(len(x))
'''


def test_a_progress_bars_total_and_a_loader_built_per_split_do_not_size_the_batch():
    """ESPCN's ``with tqdm(total=(len(ds) - len(ds) % args.batch_size)) as t:`` around its training loop, and
    Sentence-VAE's loader built in its loop over the splits (``DataLoader(datasets[split], batch_size=...)``):
    each read of the batch size was taken for the loop sizing tensors by it, and the batch was kept per process
    (the global batch doubled at 2 processes). What a bar counts to, and the loader's own argument, size nothing."""
    assert "global_batch_size=batch_size" in plan(BAR).text, plan(BAR).left
    split = BAR.replace("train_dataloader = DataLoader(train_dataset, batch_size=batch_size, shuffle=True)\n"
                        "for epoch in range(2):\n", "for epoch in range(2):\n    train_dataloader = DataLoader("
                        "train_dataset, batch_size=batch_size, shuffle=True)\n")
    assert "global_batch_size=batch_size" in plan(split).text, plan(split).left
    sized = BAR.replace("            t.update(len(x))\n", "            t.update(len(x))\n"
                        "            noise = torch.randn(batch_size, 3)\n")
    assert any("kept per process" in left.what for left in plan(sized).left)  # a tensor sized by it: as before


def test_a_state_an_init_method_returns_is_no_initialisation_of_the_model():
    """RNN-Time-series-Anomaly-Detection's ``hidden = model.init_hidden(bsz)`` (a zero state made from the
    weights' type) in functions below the build was listed six times as "initialised here, after prepare_model".
    A model's own init method counts only as a statement of its own (``model.init_weights()``)."""
    source = ('import torch\nfrom torch import nn\nmodel = Net()\nopt = torch.optim.Adam(model.parameters())\n'
              'def run(x):\n    hidden = model.init_hidden(x.size(0))\n    return model(x, hidden)\n')
    assert not [left for left in plan(source).left if "initialised" in left.what], plan(source).left
    own = source.replace("model = Net()\n", "model = Net()\nmodel.init_weights()\n")
    assert "model.init_weights()\nmodel = ddpkit.prepare_model(model)\n" in plan(own).text, plan(own).text


CALLED_UNDER_NO_GRAD = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)


def mnist(train=True):
    n = 64 if train else 40
    return TensorDataset(torch.randn(n, 4), torch.arange(n) % 2)


train_loader = DataLoader(mnist(train=True), batch_size=16, shuffle=True)
test_loader = DataLoader(mnist(train=False), batch_size=8)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.0)


def accuracy(model, dataset_loader):
    total_correct = 0
    for x, y in dataset_loader:
        total_correct += (model(x).detach().argmax(1) == y).sum().item()
    return total_correct / len(dataset_loader.dataset)


for epoch in range(2):
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        acc = accuracy(model, test_loader)
    print("test acc %.4f" % acc)
'''


def test_a_loop_whose_function_runs_under_no_grad_at_every_call_evaluates(tmp_path):
    """torchdiffeq's odenet example: ``accuracy(model, loader)`` has no no_grad of its own; every call is in a
    ``with torch.no_grad():``. Its loader was refused ("role cannot be told"); it evaluates, summed across ranks."""
    done = plan(CALLED_UNDER_NO_GRAD)
    assert "test_loader = ddpkit.data_loader(" in done.text and "train=False)" in done.text, done.left
    assert "total_correct = ddpkit.reduce(total_correct)" in done.text, done.text
    prints_as_one_process(tmp_path, CALLED_UNDER_NO_GRAD, done.text)


HISTORY = """import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(0)
train_dl = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)), 8,
                      shuffle=True)
valid_dl = DataLoader(TensorDataset(torch.randn(36, 4, generator=g), torch.randint(0, 2, (36,), generator=g)), 8)
torch.manual_seed(0)
model = nn.Linear(4, 2)
loss_fn = nn.CrossEntropyLoss()
optimizer = torch.optim.Adam(model.parameters(), lr=0.0)


def train(model, num_epochs, train_dl, valid_dl):
    loss_hist_train = [0] * num_epochs
    accuracy_hist_train = [0] * num_epochs
    loss_hist_valid = [0] * num_epochs
    accuracy_hist_valid = [0] * num_epochs
    for epoch in range(num_epochs):
        model.train()
        for x_batch, y_batch in train_dl:
            pred = model(x_batch)
            loss = loss_fn(pred, y_batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_hist_train[epoch] += loss.item() * y_batch.size(0)
            is_correct = (torch.argmax(pred, dim=1) == y_batch).float()
            accuracy_hist_train[epoch] += is_correct.sum().item()
        loss_hist_train[epoch] /= len(train_dl.dataset)
        accuracy_hist_train[epoch] /= len(train_dl.dataset)
        model.eval()
        with torch.no_grad():
            for x_batch, y_batch in valid_dl:
                pred = model(x_batch)
                loss = loss_fn(pred, y_batch)
                loss_hist_valid[epoch] += loss.item() * y_batch.size(0)
                is_correct = (torch.argmax(pred, dim=1) == y_batch).float()
                accuracy_hist_valid[epoch] += is_correct.sum().item()
        loss_hist_valid[epoch] /= len(valid_dl.dataset)
        accuracy_hist_valid[epoch] /= len(valid_dl.dataset)
        print(f'Epoch {epoch+1} accuracy: {accuracy_hist_train[epoch]:.4f} val_accuracy: '
              f'{accuracy_hist_valid[epoch]:.4f} loss {loss_hist_train[epoch]:.4f} {loss_hist_valid[epoch]:.4f}')
    return loss_hist_train, loss_hist_valid, accuracy_hist_train, accuracy_hist_valid


hist = train(model, 2, train_dl, valid_dl)
"""


def test_sums_kept_in_a_history_list_and_divided_in_place_are_every_ranks(tmp_path):
    """rasbt's lessons: ``loss_hist_train[epoch] += loss.item() * y.size(0)`` then ``loss_hist_train[epoch] /=
    len(train_dl.dataset)`` (and the validation's alike), or a plain ``acc /= len(train_dl.dataset)``. Only plain
    names were sums, and ``/=`` divided nothing: the training accuracy printed was rank 0's half (0.5 for 1.0),
    and the validation loader was left whole on every rank. Both are reduced now, after each epoch's loop."""
    done = plan(HISTORY)
    for name in ("loss_hist_train", "accuracy_hist_train", "loss_hist_valid", "accuracy_hist_valid"):
        assert f"{name}[epoch] = ddpkit.reduce({name}[epoch])" in done.text, done.text
    assert "train=False)" in done.text and not done.left, done.left
    prints_as_one_process(tmp_path, HISTORY, done.text)
    assert plan(done.text).text == done.text  # its own output converts to itself
    in_place = CALLED_UNDER_NO_GRAD.replace("    return total_correct / len(dataset_loader.dataset)",
                                            "    total_correct /= len(dataset_loader.dataset)\n"
                                            "    return total_correct")
    assert "total_correct = ddpkit.reduce(total_correct)" in plan(in_place).text
    trained = TRAIN_METRICS.replace("    return train_loss / total, 100. * correct / total",
                                    "    correct /= len(trainloader.dataset)\n    return 0.0, correct")
    assert "correct = ddpkit.reduce(correct)" in plan(trained).text, plan(trained).text


def test_a_checkpoint_dict_choosing_the_model_by_a_flag_saves_the_plain_module_on_each_side():
    """GCommandsPytorch: ``state = {'net': model.module if args.cuda else model}``. The ``.module`` side was
    unwrapped, the other pickled the DDP wrapper (on CPU: a file that loads only where a process group runs)."""
    source = ("import torch\nmodel = torch.nn.Linear(4, 2)\nopt = torch.optim.Adam(model.parameters())\n"
              "cuda = False\nif cuda:\n    model = torch.nn.DataParallel(model)\n"
              "state = {'net': model.module if cuda else model, 'epoch': 1}\ntorch.save(state, 'ckpt.t7')\n")
    text = plan(source).text
    assert "state = {'net': ddpkit.unwrap(model) if cuda else ddpkit.unwrap(model), 'epoch': 1}" in text, text


def test_a_builtin_is_no_name_of_the_one_star_imported_module():
    """pytorch-cifar-models: ``from models import *`` and ``for i, (x, y) in enumerate(train_loader)``: any name
    read and never bound was taken for one of models', ``enumerate`` included, and listed as another module's
    function fed by hand (exit 1)."""
    from ddpkit.commands.convert.origins import imported_from
    from ddpkit.commands.convert.scan import parse, scan

    facts = scan(parse("from models import *\nfor i, x in enumerate(loader):\n    pass\n"))
    assert imported_from(facts, "enumerate") is None and imported_from(facts, "loader") == ("models", "loader")


def test_a_batch_drawn_by_hand_each_epoch_and_a_state_sized_by_the_batch_keeps_it_per_process():
    """rasbt's character RNN: ``seq, target = next(iter(dl))`` in the epoch loop, and ``model.init_hidden(
    batch_size)`` beside it. No loop over the loader was found, so nothing read the batch size: the global batch
    was kept and the hidden state (8 rows) met a batch of 4 at 2 processes. Listed and kept per process."""
    source = ("import torch\nfrom torch.utils.data import DataLoader\nbatch_size = 8\n"
              "dl = DataLoader(ds, batch_size=batch_size, shuffle=True, drop_last=True)\nmodel = Net()\n"
              "opt = torch.optim.Adam(model.parameters())\nfor epoch in range(3):\n"
              "    hidden = model.init_hidden(batch_size)\n    x, y = next(iter(dl))\n"
              "    loss = model(x, hidden)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    done = plan(source)
    assert "global_batch_size" not in done.text
    assert any("kept per process" in left.what and "line 8" in left.what for left in done.left), done.left


def test_a_target_sized_by_a_config_items_batch_before_the_loop_keeps_it_per_process():
    """pytorch-GANs' DCGAN: ``real_gt = torch.ones((config['batch_size'], 1))`` above the epoch loop, the BCE
    target each step; the loader's ``batch_size=config['batch_size']``. Neither an item nor a tensor made before
    the loops was read as sizing by the batch: the global batch was kept and BCE met 4 targets for 2 outputs."""
    source = ("import torch\nfrom torch.utils.data import DataLoader\nconfig = {'batch_size': 4}\n"
              "loader = DataLoader(ds, batch_size=config['batch_size'], shuffle=True)\nmodel = Net()\n"
              "opt = torch.optim.Adam(model.parameters())\nreal_gt = torch.ones((config['batch_size'], 1))\n"
              "for epoch in range(2):\n    for (x,) in loader:\n        loss = bce(model(x), real_gt)\n"
              "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n")
    done = plan(source)
    assert "global_batch_size" not in done.text
    assert any("reads real_gt at line 7" in left.what for left in done.left), done.left
    inside = source.replace("real_gt = torch.ones((config['batch_size'], 1))\n", "").replace(
        "bce(model(x), real_gt)", "bce(model(x), torch.ones(config['batch_size'], 1))")
    assert any("reads config['batch_size'] at line 9" in left.what for left in plan(inside).left), plan(inside).left
    printed = source.replace("real_gt = torch.ones((config['batch_size'], 1))\n", "").replace(
        "bce(model(x), real_gt)", "bce(model(x), x)").replace("        opt.step()\n", "        opt.step()\n"
                                                              "        print(config['batch_size'])\n")
    assert "global_batch_size=config['batch_size']" in plan(printed).text, plan(printed).left


SPLITS = """import json
import torch
from collections import defaultdict
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
datasets = {'train': TensorDataset(torch.randn(48, 4), torch.randn(48, 1)),
            'valid': TensorDataset(torch.ones(20, 4), torch.arange(20.).view(20, 1))}
model = torch.nn.Linear(4, 1)
with torch.no_grad():
    model.weight.zero_(); model.bias.zero_()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
batch_size = 8
for epoch in range(1):
    for split in ['train', 'valid']:
        data_loader = DataLoader(dataset=datasets[split], batch_size=batch_size, shuffle=split == 'train')
        tracker = defaultdict(torch.Tensor)
        model.train() if split == 'train' else model.eval()
        for iteration, (x, y) in enumerate(data_loader):
            bs = x.size(0)
            loss = ((model(x) - y) ** 2).sum() / bs
            if split == 'train':
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            tracker['ELBO'] = torch.cat((tracker['ELBO'], loss.data.view(1, -1)), dim=0)
            if split == 'valid':
                tracker['targets'] = torch.cat((tracker['targets'], y.view(-1)), dim=0)
        print("%s Epoch %02d, Mean ELBO %9.4f" % (split.upper(), epoch, tracker['ELBO'].mean()))
        if split == 'valid':
            with open('dump.json', 'w') as f:
                json.dump({'targets': tracker['targets'].tolist()}, f)
print('valid targets dumped:', len(json.load(open('dump.json'))['targets']))
"""


def test_a_loader_built_in_a_loop_over_the_splits_shards_only_the_split_it_trains_on(tmp_path):
    """Sentence-VAE: ``for split in ['train', 'valid']: data_loader = DataLoader(datasets[split], ...)``, the step
    under ``if split == 'train':``. Converted as one training loader, the validation split was sharded too: its
    mean ELBO and its dump were rank 0's half. The split's string decides now, as a factory's does."""
    done = plan(SPLITS)
    assert "if split == 'train' else DataLoader(dataset=datasets[split]" in done.text, done.text
    one = run_cmd([sys.executable, "-c", SPLITS], timeout=60, cwd=tmp_path)
    script = tmp_path / "splits.py"
    script.write_text(done.text)
    two = launch(script, nproc=2, timeout=120, cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    valid = [line for line in one.stdout.splitlines() if not line.startswith("TRAIN")]
    assert valid == [line for line in two.stdout.splitlines() if not line.startswith("TRAIN")], (one.stdout,
                                                                                                 two.stdout)
    assert plan(done.text).text == done.text


def test_a_token_loss_that_sums_is_no_token_mean():
    """Sentence-VAE: ``NLLLoss(ignore_index=pad_idx, reduction='sum')``, divided by the batch's own size, was listed
    as a mean over the tokens it does not ignore."""
    source = ("import torch\nmodel = Net()\nopt = torch.optim.Adam(model.parameters())\npad = vocab['<pad>']\n"
              "NLL = torch.nn.NLLLoss(ignore_index=pad, reduction='sum')\nfor x, y in loader:\n"
              "    loss = NLL(model(x), y) / x.size(0)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    assert not [left for left in plan(source).left if "a mean over the tokens" in left.what]
    mean = source.replace(", reduction='sum'", "")
    assert [left for left in plan(mean).left if "a mean over the tokens" in left.what]


def test_second_review_history_items_batch_reads_builtins_and_init_methods():
    """Second review: (1) one history item two training loops add to was reduced after each; (2) an item indexed
    by a fold around the epochs (a running sum) was reduced every epoch; (3) ``preds[epoch] += out.tolist()`` was
    taken for a sum (reduce crashed); (4) a count printed, a scheduler's, a writer's, a noise batch shown under an
    ``if``, all made before the loops from the batch size, kept it per process; (5) a star-imported ``eval`` was
    taken for the builtin; (6) ``n = model.init_weights()`` (its value used) was no initialisation."""
    loops = HISTORY.replace("        loss_hist_train[epoch] /= len(train_dl.dataset)\n",
                            "        for x_batch, y_batch in train_dl:\n"
                            "            loss = loss_fn(model(x_batch), y_batch)\n            loss.backward()\n"
                            "            optimizer.step()\n            loss_hist_train[epoch] += loss.item()\n"
                            "        loss_hist_train[epoch] /= len(train_dl.dataset)\n")
    assert plan(loops).text.count("loss_hist_train[epoch] = ddpkit.reduce(") == 1
    folds = HISTORY.replace("    for epoch in range(num_epochs):\n", "    for epoch in range(num_epochs):\n"
                            "      for fold in range(1):\n").replace("\n        ", "\n          ")
    assert "loss_hist_train[epoch] = ddpkit.reduce(" not in plan(folds).text
    listed = HISTORY.replace("loss_hist_valid[epoch] += loss.item() * y_batch.size(0)",
                             "loss_hist_valid[epoch] += pred.argmax(1).tolist()")
    assert "loss_hist_valid[epoch] = ddpkit.reduce(" not in plan(listed).text
    for made in ("n_batches = int(len(train_dataset) / batch_size)\nprint(f'{n_batches}')",
                 "sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1.0, steps_per_epoch=len(train_dataset) // "
                 "batch_size, epochs=2)", "fixed = torch.randn(batch_size, 3)"):
        source = BAR.replace("for epoch in range(2):\n", made + "\nfor epoch in range(2):\n").replace(
            "            t.update(len(x))\n", "            t.update(len(x))\n            if epoch == 1:\n"
            "                print(model(fixed if 'fixed' in dir() else x).sum())\n")
        assert "global_batch_size=batch_size" in plan(source).text, (made, plan(source).left)
    from ddpkit.commands.convert.origins import imported_from
    from ddpkit.commands.convert.scan import parse, scan
    assert imported_from(scan(parse("from utils import *\neval(model, loader)\n")), "eval") == ("utils", "eval")
    own = ("import torch\nmodel = Net()\nn = model.init_weights()\nopt = torch.optim.Adam(model.parameters())\n")
    assert "n = model.init_weights()\nmodel = ddpkit.prepare_model(model)\n" in plan(own).text, plan(own).text


def test_a_history_item_over_a_count_of_samples_is_reduced_with_it():
    """Re-read: ``hist[epoch] / total`` of ``total += y.size(0)``: the item was summed, the count it is divided by
    dropped as unpaired (the pairing saw plain names only), and the ratio was N times one process's."""
    source = HISTORY.replace("    for epoch in range(num_epochs):\n        model.train()\n",
                             "    for epoch in range(num_epochs):\n        model.train()\n        total = 0\n").replace(
        "            loss_hist_train[epoch] += loss.item() * y_batch.size(0)\n",
        "            loss_hist_train[epoch] += loss.item() * y_batch.size(0)\n            total += y_batch.size(0)\n"
    ).replace("        loss_hist_train[epoch] /= len(train_dl.dataset)\n", "        loss_hist_train[epoch] /= total\n")
    text = plan(source).text
    assert "loss_hist_train[epoch] = ddpkit.reduce(" in text and "total = ddpkit.reduce(total)" in text, text
