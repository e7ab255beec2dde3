"""What the thirteenth held-out set's scripts and their neighbours showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest
from test_convert_twelfth import prints_as_one_process

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

SAMPLER_LENS = '''import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from torch.utils.data.sampler import SubsetRandomSampler

train_on_gpu = torch.cuda.is_available()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
train_data = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 3, (80,), generator=g))
test_data = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
num_train = len(train_data)
indices = list(range(num_train))
np.random.seed(0)
np.random.shuffle(indices)
split = int(np.floor(0.2 * num_train))
train_idx, valid_idx = indices[split:], indices[:split]
train_sampler = SubsetRandomSampler(train_idx)
valid_sampler = SubsetRandomSampler(valid_idx)
train_loader = torch.utils.data.DataLoader(train_data, batch_size=8, sampler=train_sampler)
valid_loader = torch.utils.data.DataLoader(train_data, batch_size=8, sampler=valid_sampler)
test_loader = torch.utils.data.DataLoader(test_data, batch_size=8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 3)
    def forward(self, x):
        return self.fc1(x)

model = Net()
if train_on_gpu:
    model.cuda()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
valid_loss_min = np.inf
for epoch in range(1, 3):
    train_loss = 0.0
    valid_loss = 0.0
    model.train()
    for data, target in train_loader:
        if train_on_gpu:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        train_loss += loss.item()*data.size(0)
    model.eval()
    for data, target in valid_loader:
        if train_on_gpu:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        loss = criterion(output, target)
        valid_loss += loss.item()*data.size(0)
    train_loss = train_loss/len(train_loader.sampler)
    valid_loss = valid_loss/len(valid_loader.sampler)
    print('Epoch: {} \tTraining Loss: {:.6f} \tValidation Loss: {:.6f}'.format(epoch, train_loss, valid_loss))
    if valid_loss <= valid_loss_min:
        print('Validation loss decreased ({:.6f} --> {:.6f}).  Saving model ...'.format(valid_loss_min, valid_loss))
        torch.save(model.state_dict(), 'model_cifar.pt')
        valid_loss_min = valid_loss
model.load_state_dict(torch.load('model_cifar.pt'))
test_loss = 0.0
class_correct = list(0. for i in range(3))
class_total = list(0. for i in range(3))
model.eval()
for data, target in test_loader:
    output = model(data)
    loss = criterion(output, target)
    test_loss += loss.item()*data.size(0)
    _, pred = torch.max(output, 1)
    correct = np.squeeze(pred.eq(target.data.view_as(pred)))
    for i in range(target.size(0)):
        label = target.data[i]
        class_correct[label] += correct[i].item()
        class_total[label] += 1
test_loss = test_loss/len(test_loader.dataset)
print('Test Loss: {:.6f}\\n'.format(test_loss))
right, seen = np.sum(class_correct), np.sum(class_total)
print('Test Accuracy (Overall): %2d%% (%2d/%2d)' % (100. * right / seen, right, seen))
'''


def test_sums_over_the_samplers_length_are_every_ranks_and_a_per_class_tally_keeps_its_loader_whole(tmp_path):
    """Udacity's lessons: ``train_loss / len(train_loader.sampler)`` over a ``SubsetRandomSampler``: once sharded,
    the sampler is this rank's (the validation loss printed 2x at 2 processes, the training loss rank 0's); the test
    loop's ``class_correct[label] += ...`` keeps the test loader whole, which is right: said as kept, exit 0."""
    p = plan(SAMPLER_LENS)
    assert not p.left, p.left
    assert "train_loss = train_loss/ddpkit.reduce(len(train_loader.sampler))" in p.text
    assert "valid_loss = valid_loss/ddpkit.reduce(len(valid_loader.sampler))" in p.text
    assert any("class_correct[label]" in k.what for k in p.kept), p.kept
    prints_as_one_process(tmp_path, SAMPLER_LENS, p.text)


def test_an_unshuffled_loader_a_function_returns_and_no_one_calls_is_kept():
    """joint-vae's ``utils/dataloaders.py``: ``get_chairs_test_dataloader()`` binds its loader, returns it, and no
    file calls it: refused as "role cannot be told", which refused the whole project."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
              "def get_test_loader(batch_size=8):\n    loader = DataLoader(TensorDataset(torch.randn(8, 2)), "
              "batch_size=batch_size, shuffle=False)\n    return loader\n\n\n"
              "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "for (x,) in DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4):\n"
              "    model(x).mean().backward()\n    opt.step()\n")
    p = plan(source)
    assert not [x for x in p.left if "drawn at random" not in x.what], p.left  # (the fixture's own unseeded data)
    assert any("called from no line of this file" in k.what and k.line == 6 for k in p.kept), p.kept


def test_a_library_star_import_is_no_project_module_beside_one():
    """speech-commands' ``train_cifar10.py``: ``from tqdm import *`` and ``from mixup import *``: ``tqdm(loader)`` was
    taken for mixup's function, "a function of another module whose loop convert does not see" (exit 1)."""
    source = ("import torch\nfrom tqdm import *\nfrom torch.utils.data import DataLoader, TensorDataset\n"
              "from mixup import *\n\nmodel = torch.nn.Linear(2, 1)\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "train_loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)\n"
              "for (x,) in tqdm(train_loader):\n    x = mixup_data(x)\n    model(x).mean().backward()\n"
              "    opt.step()\n")
    p = plan(source)
    assert not p.left, p.left
    assert "ddpkit.data_loader(" in p.text


def test_a_best_checkpoint_read_back_in_the_main_block_gets_a_barrier_before_the_read():
    """The protein VAE: ``if val_loss < best: torch.save(..., 'best.pt')`` in the epoch loop, then
    ``torch.load('best.pt')`` after it, all under ``if __name__ == "__main__":``: listed "no barrier" (exit 1),
    though every rank runs that block and a barrier before the read is one every rank passes."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
              "if __name__ == '__main__':\n    model = torch.nn.Linear(2, 1)\n"
              "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)\n"
              "    best = float('inf')\n    for epoch in range(2):\n        for (x,) in loader:\n"
              "            loss = model(x).mean()\n            loss.backward()\n            opt.step()\n"
              "        if loss.item() < best:\n            best = loss.item()\n"
              "            torch.save(model.state_dict(), 'best.pt')\n"
              "    model.load_state_dict(torch.load('best.pt'))\n")
    p = plan(source)
    # (the test reads the last step's loss, rank 0's part of its batch: listed since the sixteenth set's review)
    assert [x.what[:37] for x in p.left] == ["the test compares this rank's loss (l"], p.left
    lines = p.text.splitlines()
    read = next(i for i, line in enumerate(lines) if "torch.load(" in line)
    assert lines[read - 1].strip() == "ddpkit.barrier()", p.text


def test_a_figure_saved_each_epoch_is_covered_by_the_barrier_after_a_later_figure():
    """PyTorch_Practice's GAN lesson: ``plt.savefig`` of each epoch in the loop, then the loss figure after it (a
    barrier put after that one), then the epoch figures read back: the loop's write was listed "no barrier"."""
    source = ("import os\nimport matplotlib.pyplot as plt\nimport imageio\nimport torch\n"
              "from torch.utils.data import DataLoader, TensorDataset\n\nmodel = torch.nn.Linear(2, 1)\n"
              "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)\n"
              "for epoch in range(2):\n    for (x,) in loader:\n        model(x).mean().backward()\n"
              "        opt.step()\n"
              "    plt.savefig(os.path.join('out', '{}_epoch.png'.format(epoch)))\n"
              "plt.savefig(os.path.join('out', 'loss.png'))\n"
              "imgs = [imageio.imread(os.path.join('out', '{}_epoch.png'.format(i))) for i in range(2)]\n")
    p = plan(source)
    assert not p.left, p.left
    assert p.text.count("ddpkit.barrier()") == 1, p.text


def test_a_legacy_typed_tensor_sized_by_the_batch_before_the_loop_keeps_it_per_process():
    """AC-GAN: ``aux_label = torch.LongTensor(opt.batchSize)`` above the loop, ``aux_label.data.resize_(n)`` in it
    (which leaves the tensor's own size): at a global batch split in two, each rank's loss read 8 labels for 4
    rows (IndexError at step 1), with nothing said."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nbatch_size = 8\n"
              "model = torch.nn.Linear(2, 3)\nopt = torch.optim.Adam(model.parameters())\n"
              "loader = DataLoader(TensorDataset(torch.randn(16, 2), torch.randint(0, 3, (16,))), "
              "batch_size=batch_size, shuffle=True)\naux_label = torch.LongTensor(batch_size)\n"
              "for x, y in loader:\n    aux_label.data.resize_(x.size(0)).copy_(y)\n"
              "    loss = torch.nn.functional.cross_entropy(model(x), aux_label)\n    loss.backward()\n"
              "    opt.step()\n")
    p = plan(source)
    assert any("kept per process" in x.what and "aux_label" in x.what for x in p.left), p.left
    assert "batch_size=batch_size" in p.text and "global_batch_size" not in p.text


def test_a_batch_size_rebound_from_the_batch_in_the_loop_sizes_nothing_of_the_loaders():
    """A DCGAN: ``batch_size = x.size(0)`` in the loop, then ``torch.randn(batch_size, nz)``: the read sees the
    batch's own size, yet the loader's batch was kept per process (the global batch doubled at 2), listed falsely."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nbatch_size = 16\n"
              "loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=batch_size, shuffle=True)\n"
              "D = torch.nn.Linear(4, 1)\nopt = torch.optim.Adam(D.parameters(), lr=1e-3)\nfor (x,) in loader:\n"
              "    batch_size = x.size(0)\n    z = torch.randn(batch_size, 4)\n    loss = D(x).mean() - D(z).mean()\n"
              "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")
    p = plan(source)
    assert not p.left, p.left
    assert "global_batch_size=batch_size" in p.text


FIT = ("import torch\n\n\ndef fit(model, loader, epochs):\n    opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
       "    for _ in range(epochs):\n        for x, y in loader:\n            opt.zero_grad()\n"
       "            torch.nn.functional.cross_entropy(model(x), y).backward()\n            opt.step()\n")
DATA = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
        "ds = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))\n"
        "train_loader = DataLoader(ds, batch_size=16, shuffle=True)\n")


@pytest.mark.parametrize("main", [
    DATA + "from trainer import fit\nnet = torch.nn.Linear(8, 2)\nfit(model=net, loader=train_loader, epochs=1)\n",
    "import torch\nfrom data import train_loader\nfrom trainer import fit\n\nnet = torch.nn.Linear(8, 2)\n"
    "fit(net, train_loader, 1)\n"], ids=["by-keyword", "imported-loader"])
def test_a_trainer_of_another_module_handed_a_model_by_keyword_or_a_loader_imported_from_a_third(main):
    """A distillation project: ``fit(model=net, loader=loader, epochs=1)`` (the trainer refused: "no line of this
    file calls fit()"), and ``from data import train_loader`` handed to ``fit`` (data.py's loader kept as "read by
    no one", the trainer's loop left to you)."""
    files = {"trainer.py": FIT, "data.py": DATA, "main.py": main}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert not any(done[rel].left for rel in files), {rel: done[rel].left for rel in files}
    assert "net = ddpkit.prepare_model(torch.nn.Linear(8, 2))" in done["main.py"].text
    loaders = done["main.py"].text if "from data" not in main else done["data.py"].text
    assert "train_loader = ddpkit.data_loader(ds, global_batch_size=16, shuffle=True)" in loaders


SPREAD = '''import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
TRAIN_BATCH_SIZE = 8
training_set = TensorDataset(torch.randn(48, 6), torch.randint(0, 2, (48,)))
train_params = {'batch_size': TRAIN_BATCH_SIZE,
                'shuffle': True,
                'num_workers': 0
                }
training_loader = DataLoader(training_set, **train_params)
model = torch.nn.Linear(6, 2)
optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-5)
steps = 0
for _, (x, y) in enumerate(training_loader, 0):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    steps += 1
print(len(training_loader), steps)
'''


def test_a_batch_size_in_a_dict_spread_into_the_training_loader_is_the_global_batch(tmp_path):
    """The Hugging Face tutorials' ``train_params = {'batch_size': TRAIN_BATCH_SIZE, ...}`` then
    ``DataLoader(training_set, **train_params)``: kept per process (the global batch doubled at 2, said); the
    dict's key becomes ``'global_batch_size'`` when that loader alone spreads it."""
    p = plan(SPREAD)
    assert "train_params = {'global_batch_size': TRAIN_BATCH_SIZE," in p.text, p.text
    assert not p.left, p.left
    prints_as_one_process(tmp_path, SPREAD, p.text)
    shared = SPREAD.replace("print(len(training_loader), steps)\n",
                            "test_loader = DataLoader(training_set, **train_params)\nprint(len(test_loader))\n")
    assert "'global_batch_size'" not in plan(shared).text  # (another loader spreads it too: left as it was)


REBOUND = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def update():
    total, total_loss = 0.0, 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_function(model(x), y)
        loss.backward()
        optimizer.step()
        total += len(y)
        total_loss += loss.item()
    loss = total_loss / total      # s07: the name `loss` re-bound to the epoch value
    return loss


if __name__ == "__main__":
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(32, 5), torch.randint(0, 3, (32,)))
    loader = DataLoader(ds, batch_size=8, shuffle=False)
    model = nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)   # lr 0: the printed value is comparable
    loss_function = nn.CrossEntropyLoss()
    print('epoch 0 loss %.6f' % update())
'''


def test_a_sum_of_batch_means_is_averaged_though_the_loss_name_is_rebound_after_the_loop(tmp_path):
    """LSTM_pytorch's ``update()``: ``total_loss += loss.item()`` in the loop, ``loss = total_loss / total`` after it:
    the loss's last binding (after the loop) was taken for the criterion, the batch means summed: 2x at 2."""
    p = plan(REBOUND)
    assert "total_loss = ddpkit.reduce(total_loss, op='mean')" in p.text, p.text
    prints_as_one_process(tmp_path, REBOUND, p.text)


TRAINER_RESUME = '''import os
import torch
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, train_loader):
        self.model = model
        self.train_loader = train_loader
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def save_checkpoint(self, epoch, save_dir='checkpoints'):
        checkpoint = {'model_state_dict': self.model.state_dict(), 'epoch': epoch}
        torch.save(checkpoint, os.path.join(save_dir, f'checkpoint_epoch_{epoch}.pth'))
        if epoch >= 1:
            torch.save(checkpoint, os.path.join(save_dir, 'best_model.pth'))

    def load_checkpoint(self, checkpoint_path):
        if not os.path.exists(checkpoint_path):
            return 0
        checkpoint = torch.load(checkpoint_path)
        self.model.load_state_dict(checkpoint['model_state_dict'])
        return checkpoint['epoch']

    def train(self, epochs=2, resume_checkpoint=None):
        start_epoch = 0
        if resume_checkpoint:
            start_epoch = self.load_checkpoint(resume_checkpoint)
        for epoch in range(start_epoch, epochs):
            for x, y in self.train_loader:
                self.optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.model(x), y).backward()
                self.optimizer.step()
            self.save_checkpoint(epoch)


def main():
    os.makedirs('checkpoints', exist_ok=True)
    try:
        torch.manual_seed(0)
        ds = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
        if len(ds) == 0:
            print("empty")
            return
        train_loader = DataLoader(ds, batch_size=8, shuffle=True)
        model = torch.nn.Linear(4, 2)
        Trainer(model, train_loader).train(2)
    except KeyboardInterrupt:
        print("stopped")


if __name__ == "__main__":
    main()
'''

TRAINER_VAL = '''import torch
from torch.utils.data import DataLoader, TensorDataset


class Trainer:
    def __init__(self, model, train_loader, val_loader, test_loader):
        self.model = model
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.test_loader = test_loader
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.criterion = torch.nn.CrossEntropyLoss()

    def train_epoch(self):
        self.model.train()
        for x, y in self.train_loader:
            self.optimizer.zero_grad()
            loss = self.criterion(self.model(x), y)
            loss.backward()
            self.optimizer.step()

    def evaluate(self, loader):
        self.model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for x, y in loader:
                total += self.criterion(self.model(x), y).item() * y.numel()
                n += y.numel()
        return total / n

    def train(self, epochs):
        for epoch in range(epochs):
            self.train_epoch()
            print("val", self.evaluate(self.val_loader))
        print("test", self.evaluate(self.test_loader))


def main():
    torch.manual_seed(0)
    mk = lambda n: TensorDataset(torch.randn(n, 8), torch.randint(0, 2, (n,)))
    train_loader = DataLoader(mk(64), batch_size=8, shuffle=True)
    val_loader = DataLoader(mk(32), batch_size=8, shuffle=False)
    test_loader = DataLoader(mk(32), batch_size=8, shuffle=False)
    model = torch.nn.Linear(8, 2)
    Trainer(model, train_loader, val_loader, test_loader).train(2)


if __name__ == "__main__":
    main()
'''


def test_a_trainer_that_resumes_before_its_epochs_and_builds_its_model_in_a_try_converts_whole():
    """transformer-lm-wikitext2: ``load_checkpoint`` runs once, at the top of ``train()`` (under ``if resume:``),
    before the epochs that call ``save_checkpoint``: listed "a file is read ... the other ranks may read it before
    rank 0 has written it"; its model is built in ``try:`` (``except KeyboardInterrupt:`` binds none, and uses
    none): listed "built in one branch of an if"."""
    p = plan(TRAINER_RESUME)
    assert not p.left, p.left
    assert "ddpkit.barrier()" not in p.text and "model = ddpkit.prepare_model(torch.nn.Linear(4, 2))" in p.text
    twice = TRAINER_RESUME.replace("        Trainer(model, train_loader).train(2)\n",
                                   "        Trainer(model, train_loader).train(2)\n"
                                   "        Trainer(model, train_loader).train(2, 'checkpoints/best_model.pth')\n")
    assert plan(twice).left  # (a second trainer resumes from what the first saved: the read may come after)


def test_a_trainers_loaders_kept_as_attributes_are_followed_to_where_they_are_built(tmp_path):
    """The same script's ``Trainer(model, train_loader, val_loader, test_loader)``: ``self.evaluate(self.val_loader)``
    was refused as "a loader left unsharded", though ``val_loader`` is made ``ddpkit.data_loader(train=False)``."""
    p = plan(TRAINER_VAL)
    assert not p.left, p.left
    assert p.text.count("train=False)") == 2 and "total = ddpkit.reduce(total)" in p.text


HELPERS = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def load_data(batch_size):
    ds = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    return DataLoader(ds, batch_size=batch_size, shuffle=True)


def train(net, loader, optimizer, epochs):
    for epoch in range(epochs):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
'''
LESSON = '''import sys
sys.path.append("..")
import torch
import helpers

net = torch.nn.Linear(8, 2)
loader = helpers.load_data(batch_size=16)
optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
helpers.train(net, loader, optimizer, 2)
'''


def test_an_optimizer_handed_to_a_module_the_conversion_does_not_read_is_said():
    """Dive-into-DL's lessons: ``sys.path.append("..")``, then ``d2l.train_ch5(net, ..., optimizer, ...)`` of a
    package beside the lesson's folder: convert prepared the model, exited 0 and said nothing; every rank then
    trained on every batch (ddpkit's runtime warned at launch). Read together, the helpers' loader (its trainer
    handed the optimizer, the loader built there too) was kept as "called from no line" and nothing said."""
    said = [x for x in plan(LESSON).left if "the training runs in helpers.train()" in x.what]
    assert said and said[0].line == 9, plan(LESSON).left
    files = {"lesson.py": LESSON, "helpers.py": HELPERS}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert not done["lesson.py"].left and not done["helpers.py"].left, (done["lesson.py"].left, done["helpers.py"].left)
    assert "return ddpkit.data_loader(ds, global_batch_size=batch_size, shuffle=True)" in done["helpers.py"].text


def test_a_batch_norm_of_the_scripts_own_is_listed():
    """normalizing_flows' MAF: ``class BatchNorm(nn.Module)`` whose ``forward`` takes ``x.mean(0)`` / ``x.var(0)``
    when training: each rank's statistics over its half of the batch; convert said nothing, verify FAILed it.
    Dive-into-DL's ``batch_norm(is_training, X, ...)`` the same; a mean over features or in a plain training
    function is no batch norm."""
    head = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
            "class BatchNorm(torch.nn.Module):\n    def forward(self, x):\n        if self.training:\n"
            "            {stat}\n        return x\n\n\n"
            "model = torch.nn.Sequential(torch.nn.Linear(4, 4), BatchNorm())\n"
            "opt = torch.optim.Adam(model.parameters())\n"
            "loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8, shuffle=True)\n"
            "for (x,) in loader:\n    model(x).mean().backward()\n    opt.step()\n")
    listed = [x for x in plan(head.format(stat="x = (x - x.mean(0)) / x.std(0)")).left if "over the batch" in x.what]
    assert listed and listed[0].line == 8, listed
    assert not plan(head.format(stat="x = x - x.mean(dim=-1, keepdim=True)")).left


XMOD_MAIN = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from tools import EarlyStopping

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, shuffle=True)
model = nn.Linear(4, 1)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
stopper = EarlyStopping()
for epoch in range(3):
    total = 0.0
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
    stopper(total, model, "best.pth")
model.load_state_dict(torch.load("best.pth"))
print("loaded the best weights")
'''
XMOD_TOOLS = '''import torch


class EarlyStopping:                      # PatchTST's utils/tools.py EarlyStopping, in small
    def __init__(self):
        self.best = None

    def __call__(self, val_loss, model, path):
        if self.best is None or val_loss < self.best:
            self.best = val_loss
            torch.save(model.state_dict(), path)
'''


def test_a_checkpoint_another_module_saves_during_training_is_waited_for_before_it_is_read():
    """PatchTST: ``EarlyStopping`` of ``utils/tools.py`` saves the best model in the epoch loop (rank 0's alone once
    converted) and ``exp_main.py`` loads it after the loop: no barrier, no line; at 2 processes rank 1 read the
    epoch-1 file and the replicas parted (a ReplicaError at the end, a second row in result.txt)."""
    files = {"main.py": XMOD_MAIN, "tools.py": XMOD_TOOLS}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    lines = done["main.py"].text.splitlines()
    read = next(i for i, line in enumerate(lines) if "torch.load(" in line)
    assert lines[read - 1].strip() == "ddpkit.barrier()", done["main.py"].text
    assert "ddpkit.barrier()" not in plan(XMOD_MAIN).text  # (alone: no project, no other module's save known)


def test_review_a_read_in_a_function_the_loop_calls_is_not_answered_by_a_later_barrier():
    """Review: ``np.save('emb.npy', ...)`` then ``report()`` (which loads it) in the epoch loop, and a final save
    after the loop with its barrier: the later barrier was taken to answer the loop's write, though the read runs
    before it (rank 1 read a stale file or none)."""
    source = ("import numpy as np\nimport torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
              "model = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)\n\n\n"
              "def train():\n    for epoch in range(2):\n        for (x,) in loader:\n"
              "            model(x).mean().backward()\n            opt.step()\n"
              "        np.save('emb.npy', np.zeros(3))\n        report()\n    np.save('final.npy', np.zeros(3))\n\n\n"
              "def report():\n    return np.load('emb.npy')\n\n\ntrain()\n")
    p = plan(source)
    assert any("a file is read at line 21" in x.what and x.line == 15 for x in p.left), p.left


def test_review_a_loader_imported_for_a_trainer_and_an_evaluation_of_another_module_is_refused():
    """Review: ``from data import train_loader``, handed to ``fit`` (made a training loader in data.py) and to
    ``evaluate`` of the same trainer module: the accuracy was rank 0's shard's, with exit 0."""
    trainer = FIT + ("\n\ndef evaluate(model, loader):\n    correct = 0\n    with torch.no_grad():\n"
                     "        for x, y in loader:\n            correct += (model(x).argmax(1) == y).sum().item()\n"
                     "    return correct / len(loader.dataset)\n")
    main = ("import torch\nfrom data import train_loader\nfrom trainer import fit, evaluate\n\n"
            "net = torch.nn.Linear(8, 2)\nfit(net, train_loader, 1)\nprint(evaluate(net, train_loader))\n")
    files = {"trainer.py": trainer, "data.py": DATA, "main.py": main}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    assert any(x.blocks and "also handed to another module's evaluation" in x.what for x in done["main.py"].left)


def test_second_review_a_handed_optimizer_a_scheduler_a_mean_pool_and_an_inline_loader():
    """Second review: a trainer stepping an optimizer it is handed hid "no model prepared" when nothing prepared one
    (the launch then stopped); a scheduler made from the optimizer by a project helper was taken for the training;
    a dataset's standardization in ``__init__(..., training=True)`` and a sequence mean-pool in a ``forward`` that
    reads ``self.training`` were taken for a BatchNorm; a loader passed inline got a false "no call passes"."""
    trainer = ("def train(net, loader, opt):\n    for (x,) in loader:\n        net(x).mean().backward()\n"
               "        opt.step()\n\n\n")
    made = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\nfrom optim_wrap import make\n\n\n"
            + trainer + "net = torch.nn.Linear(2, 1)\nopt = make(net)\n"
            "loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4, shuffle=True)\n"
            "train(net, loader, opt)\n")
    assert any("no model that an optimizer here trains" in x.what for x in plan(made).left), plan(made).left
    scheduled = LESSON.replace("helpers.train(", "scheduler = Warmup(optimizer, 5)\nhelpers.train(").replace(
        "import helpers\n", "import helpers\nfrom warmup import Warmup\n")
    assert not any("Warmup" in x.what for x in plan(scheduled).left)
    scaled = made.replace("from optim_wrap import make\n", "").replace("opt = make(net)\n", "opt = torch.optim.SGD("
                                                                          "net.parameters(), lr=0.1)\n") + (
        "\n\nclass Scaled(torch.utils.data.Dataset):\n    def __init__(self, x, training=True):\n"
        "        self.mu = x.mean(0)\n\n\nclass Pool(torch.nn.Module):\n    def forward(self, h):\n"
        "        h = torch.nn.functional.dropout(h, training=self.training)\n        return h.mean(dim=0)\n")
    assert not plan(scaled).left, plan(scaled).left
    inline = scaled.replace("loader = DataLoader(", "train(net, DataLoader(").replace(
        "shuffle=True)\ntrain(net, loader, opt)\n", "shuffle=True), opt)\n")
    assert [x.what[:40] for x in plan(inline).left] == ["a DataLoader built inside an expression "]


def test_second_review_a_write_block_that_runs_the_training_is_not_rank_0s():
    """Second review (not from this change): ``with open("result.txt", "w") as f: f.write(f"{fit(model, x, y)}")``
    was guarded to rank 0 whole, the training inside it with it: the other ranks would never join its collectives."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
              "def fit(model, x):\n    opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
              "    for (xb,) in DataLoader(TensorDataset(x), batch_size=16, shuffle=True):\n"
              "        model(xb).mean().backward()\n        opt.step()\n    return model.weight.sum().item()\n\n\n"
              "model = torch.nn.Linear(4, 1)\nwith open('result.txt', 'w') as f:\n"
              "    f.write(f'{fit(model, torch.randn(64, 4)):.4f}')\n")
    p = plan(source)
    assert "is_main:\n    with open" not in p.text, p.text
    assert any("does more than write" in x.what for x in p.left), p.left


def test_a_loader_imported_for_another_modules_evaluation_is_said_kept_for_it():
    """The distillation project's ``DataLoader.py``: its ``test_loader``, imported by ``Main.py`` and handed to
    ``test()`` of another module, was kept as "nothing reads test_loader" (right to keep whole, wrong as said)."""
    trainer = FIT + ("\n\ndef evaluate(model, loader):\n    correct = 0\n    with torch.no_grad():\n"
                     "        for x, y in loader:\n            correct += (model(x).argmax(1) == y).sum().item()\n"
                     "    return correct / len(loader.dataset)\n")
    main = ("import torch\nfrom data import train_loader, test_loader\nfrom trainer import fit, evaluate\n\n"
            "net = torch.nn.Linear(8, 2)\nfit(net, train_loader, 1)\nprint(evaluate(net, test_loader))\n")
    files = {"trainer.py": trainer, "data.py": DATA + "test_loader = DataLoader(ds, batch_size=16)\n", "main.py": main}
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    kept = [k for k in done["data.py"].kept if k.what.startswith("test_loader")]
    assert kept and "another module of the project loops over it" in kept[0].why, kept
    assert not any(done[rel].left for rel in files)
