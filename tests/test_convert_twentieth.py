"""What the twentieth held-out set showed ``ddpkit convert`` owes public scripts (docs/convert.md): each a case
written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

# a tutorial's module: one loader factory for both sets, told apart by a flag whose default is True (the training
# call leaves it out), and the loops the script's main module calls
LOADERS = '''import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
TRAIN = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
TEST = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))


def make_loader(batch_size, is_training=True):
    return DataLoader(TRAIN if is_training else TEST, batch_size=batch_size, shuffle=True)


def train(loader, net, opt):
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def test(loader, net):
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (net(x).argmax(1) == y).sum().item()
    print(correct, len(loader.dataset))
'''
MAIN = '''import torch
import torch.nn as nn
from loaders import make_loader, train, test

train_loader = make_loader(16)
test_loader = make_loader(100, is_training=False)
net = nn.Linear(4, 3)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    train(train_loader, net, opt)
    test(test_loader, net)
'''
SPLIT = ("return ddpkit.data_loader(TRAIN if is_training else TEST, global_batch_size=batch_size, shuffle=True) "
         "if is_training else DataLoader(TRAIN if is_training else TEST, batch_size=batch_size, shuffle=True)")


def _settled(files):
    from ddpkit.commands.convert.crossing import settle
    return settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))


def test_a_factory_whose_training_call_leaves_its_flag_at_the_default_splits_by_the_flag():
    """lcary/pytorch-mnist-tutorial: ``make_loader(16)`` trains, ``make_loader(100, is_training=False)`` is only
    evaluated. In one file it was refused (one DataLoader line for both); split over two files the test loader
    became a training shard and the printed accuracy counted rank 0's half, with no line. The flag's default
    (True) is what the training call passes."""
    one = plan(LOADERS + MAIN.replace("from loaders import make_loader, train, test\n", ""))
    assert SPLIT in one.text and not one.left, (one.left, one.text)
    done = _settled({"loaders.py": LOADERS, "main.py": MAIN})
    assert SPLIT in done["loaders.py"].text, done["loaders.py"].text
    assert not done["loaders.py"].left and not done["main.py"].left, (done["loaders.py"].left, done["main.py"].left)
    assert any("training loop over loader" in k for k in map(str, done["loaders.py"].kept)), done["loaders.py"].kept


# a GAN project: the main script seeds torch's generator, builds both models and calls the training function of a
# module it imports, which draws the noise each step
SEEDING_MAIN = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from loop import train_gan

torch.manual_seed(999)
loader = DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=8, shuffle=True)
netG = nn.Linear(2, 4)
netD = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
optD = torch.optim.Adam(netD.parameters(), lr=1e-3)
train_gan(loader, netG, netD, optG, optD)
'''
LOOP = '''import torch
import torch.nn as nn


def train_gan(loader, netG, netD, optG, optD):
    crit = nn.BCELoss()
    for (real,) in loader:
        b = real.size(0)
        fake = netG(torch.randn(b, 2))
        optD.zero_grad()
        d = crit(netD(real).view(-1), torch.ones(b)) + crit(netD(fake.detach()).view(-1), torch.zeros(b))
        d.backward()
        optD.step()
        optG.zero_grad()
        crit(netD(fake).view(-1), torch.ones(b)).backward()
        optG.step()
'''


def test_noise_drawn_in_an_imported_training_function_of_a_seeded_script_is_drawn_per_rank():
    """vltkv/Generate-faces-with-GAN: main.py seeds torch's generator and calls training/training.py's loop, which
    draws the noise: every rank drew the same noise (the same noise in one file got the rank's generator)."""
    done = _settled({"main.py": SEEDING_MAIN, "loop.py": LOOP})
    assert "fake = netG(torch.randn(b, 2, generator=ddpkit.rank_generator()))" in done["loop.py"].text, \
        done["loop.py"].text


def test_a_loss_unpacked_from_the_scripts_own_helper_fills_a_curve_averaged_step_by_step():
    """vltkv's GAN: ``g, score = gen_loss(netD, fake, crit)`` (the helper returns the criterion's mean and a
    score), then ``G_losses.append(g.item())``, plotted and written: D_losses was averaged step by step, G_losses
    stayed rank 0's with no line."""
    text = plan('''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def loss_and_score(net, x):
    out = net(x)
    return out.pow(2).mean(), out.mean().item()


net = nn.Linear(4, 1)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
losses = []
for (x,) in DataLoader(TensorDataset(torch.randn(32, 4)), batch_size=16, shuffle=True):
    loss, score = loss_and_score(net, x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.save(losses, "curve.pt")
''').text
    assert "losses = ddpkit.reduce(torch.tensor(losses, dtype=torch.float64), op='mean').tolist()" in text, text


def test_a_logger_opening_its_file_with_a_mode_chosen_by_a_flag_is_rank_0s():
    """H0rvex/resnet-cifar10's logger: ``mode = "a" if append else "w"``, then ``open(path, mode)`` kept open and
    written each epoch: every rank wrote metrics.jsonl (rank 1's values in it, interleaved lines)."""
    text = plan('''import json
import torch
from torch.utils.data import DataLoader, TensorDataset


class Logger:
    def __init__(self, path, append=False):
        mode = "a" if append else "w"
        self._f = open(path, mode, encoding="utf-8")

    def log(self, epoch, loss):
        self._f.write(json.dumps({"epoch": epoch, "loss": loss}) + "\\n")


model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
logger = Logger("metrics.jsonl")
for epoch in range(2):
    for (x,) in DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16, shuffle=True):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    logger.log(epoch, loss.item())
''').text
    assert "self._f = open(path if ddpkit.init().is_main else os.devnull, mode, encoding=\"utf-8\")" in text, text


def test_an_image_made_by_torchvisions_to_pil_transform_is_saved_by_rank_0():
    """MahyadSaedpanah/GAN: ``img = transforms.ToPILImage()(img.cpu())``, then ``img.save(path)``: every rank
    wrote the picture."""
    text = plan('import torch\nimport torchvision.transforms as transforms\nimport ddpkit\nstate = ddpkit.init()\n'
                'img = transforms.ToPILImage()(torch.rand(3, 8, 8))\nimg.save("a.png")\n').text
    assert 'if state.is_main:\n    img.save("a.png")' in text, text


def test_the_last_batchs_loss_shown_after_a_sharded_evaluation_is_said_to_be_this_ranks():
    """wide-resnet.pytorch: ``print("Validation Epoch #%d Loss: %.4f Acc@1: %.2f%%" % (epoch, loss.item(), ...))``
    after the evaluation loop: the accuracy's sums are reduced, the loss was rank 0's last batch with no line."""
    done = plan('''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

train_set = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
test_set = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
trainloader = DataLoader(train_set, batch_size=16, shuffle=True)
testloader = DataLoader(test_set, batch_size=100, shuffle=False)
net = nn.Linear(4, 3)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)


def test(epoch):
    correct, total = 0, 0
    with torch.no_grad():
        for x, y in testloader:
            outputs = net(x)
            loss = criterion(outputs, y)
            correct += (outputs.argmax(1) == y).sum().item()
            total += y.size(0)
    print("Epoch #%d Loss: %.4f Acc: %.2f%%" % (epoch, loss.item(), 100. * correct / total))


for epoch in range(2):
    for x, y in trainloader:
        optimizer.zero_grad()
        loss = criterion(net(x), y)
        loss.backward()
        optimizer.step()
    test(epoch)
''')
    assert any(k.what == "print(...) shows loss, the evaluation loop's last batch's" and k.line == 22
               for k in done.kept), done.kept


def test_the_last_steps_loss_kept_once_an_epoch_after_the_loop_is_said_to_be_this_ranks():
    """MahyadSaedpanah/GAN: ``g_losses.append(g_loss.item())`` once an epoch, after the training loop, then written
    to a report: rank 0's last batch's loss, with no line."""
    done = plan('''import torch
from torch.utils.data import DataLoader, TensorDataset

G = torch.nn.Linear(2, 4)
opt = torch.optim.Adam(G.parameters(), lr=1e-3)
losses = []
for epoch in range(2):
    for (x,) in DataLoader(TensorDataset(torch.rand(32, 4)), batch_size=8, shuffle=True):
        loss = (G(torch.randn(x.size(0), 2)) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    losses.append(loss.item())
with open("report.txt", "w") as f:
    f.write(str(sum(losses) / len(losses)))
''')
    assert any(k.what.startswith("append(...) keeps loss, the step's loss, the training loop's last") and k.line == 13
               for k in done.kept), done.kept


def test_an_evaluator_of_the_scripts_own_fed_each_training_batch_is_said_where_it_is_read():
    """longrootchen/cifar10-pytorch: ``evaluator.update_matrix(y, out.argmax(1))`` each training step, then ``return
    evaluator.error()``, printed, logged and saved as the epoch's error rate: rank 0's shard, with no line."""
    done = plan('''import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset


class Evaluator:
    def __init__(self, n):
        self.m = np.zeros((n, n), dtype=int)

    def update_matrix(self, trues, preds):
        self.m += np.bincount(len(self.m) * trues + preds, minlength=len(self.m) ** 2).reshape(self.m.shape)

    def error(self):
        return 1 - np.diag(self.m).sum() / self.m.sum()


def train(model, loader, optimizer):
    evaluator = Evaluator(3)
    for x, y in loader:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        evaluator.update_matrix(y.numpy(), out.argmax(1).numpy())
    return evaluator.error()


model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))), batch_size=16, shuffle=True)
print(train(model, loader, opt))
''')
    assert any(k.what == "evaluator is fed each training batch (evaluator.update_matrix(...)) and read here" and
               k.line == 26 for k in done.kept), done.kept


def test_a_gradient_penaltys_interpolation_weights_drawn_in_its_helper_are_drawn_per_rank():
    """Lornatang/WassersteinGAN_GP-PyTorch: ``alpha = torch.rand(b, 1)`` in the gradient penalty's helper, mixed
    into ``x = alpha * real + (1 - alpha) * fake`` and fed to D: the generator's noise got the rank's generator, the
    penalty's weights stayed the same on every rank."""
    text = plan('''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def gradient_penalty(D, real, fake):
    alpha = torch.rand(real.size(0), 1)
    x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    g = torch.autograd.grad(D(x).sum(), x, create_graph=True)[0]
    return ((g.norm(2, dim=1) - 1) ** 2).mean()


torch.manual_seed(0)
G = nn.Linear(4, 8)
D = nn.Linear(8, 1)
oG = torch.optim.Adam(G.parameters())
oD = torch.optim.Adam(D.parameters())
for (real,) in DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8):
    fake = G(torch.randn(real.size(0), 4))
    lossD = D(fake.detach()).mean() - D(real).mean() + 10 * gradient_penalty(D, real, fake.detach())
    oD.zero_grad()
    lossD.backward()
    oD.step()
''').text
    assert "alpha = torch.rand(real.size(0), 1, generator=ddpkit.rank_generator())" in text, text


def test_loaders_handed_to_a_trainer_in_a_dict_by_their_splits_name_convert():
    """deepshiksharma/vae-mnist: ``dataloaders = {'train': train_loader, 'val': val_loader}`` handed to
    ``trainer.train(model, device, dataloaders)``, which loops over ``dataloaders['train']``: refused as batches
    "fed by hand"."""
    done = _settled({"main.py": '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
import trainer

train_loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8, shuffle=True)
val_loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=8)
dataloaders = {'train': train_loader, 'val': val_loader}
net = nn.Linear(4, 4)
model = trainer.train(net, dataloaders)
''', "trainer.py": '''import torch


def train(model, dataloaders):
    train_loader = dataloaders['train']
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for (x,) in train_loader:
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model
'''})
    assert not done["trainer.py"].left and not done["main.py"].left, (done["trainer.py"].left, done["main.py"].left)
    assert "train_loader = ddpkit.data_loader(TensorDataset(torch.randn(64, 4)), global_batch_size=8, shuffle=True)" \
        in done["main.py"].text, done["main.py"].text


def test_an_evaluation_loop_over_a_helper_that_steps_only_when_told_is_no_training_loop():
    """gmuraleekrishna/fashion-mnist-pytorch: ``network_pass(..., train=True)`` steps under ``if train:``, and the
    test loop calls it with the default ``train=False``: the test loader was converted as the training one."""
    done = plan('''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def load_data(batch_size):
    train_loader = DataLoader(TensorDataset(torch.randn(120, 4), torch.randint(0, 2, (120,))), batch_size=batch_size,
                              shuffle=True)
    test_loader = DataLoader(TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,))), batch_size=4,
                             shuffle=True)
    return train_loader, test_loader


def network_pass(net, x, y, crit, optimizer=None, train=False):
    loss = crit(net(x), y)
    if train:
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss


def train(net, loader, optimizer, crit):
    for x, y in loader:
        network_pass(net, x, y, crit, optimizer=optimizer, train=True)


def test(net, loader, crit):
    total = 0.0
    for x, y in loader:
        total += network_pass(net, x, y, crit).item()
    print("test loss", total / len(loader))


net = nn.Linear(4, 2)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
crit = nn.CrossEntropyLoss()
train_loader, test_loader = load_data(10)
train(net, train_loader, opt, crit)
test(net, test_loader, crit)
''')
    text = done.text
    assert "train_loader = ddpkit.data_loader(TensorDataset(" in text, text
    assert "test_loader = DataLoader(" in text or "train=False" in text, text


def test_a_flag_passed_as_a_variable_is_not_taken_for_the_parameters_default():
    """Review 29: ``get_loader(train_ds, 16, shuffle=SHUFFLE)`` (a flag of the script, False) beside
    ``get_loader(val_ds, 20, shuffle=False)``: the default ``shuffle=True`` was read for the training call, the
    factory split on ``shuffle`` and the training loader stayed a plain DataLoader on every rank."""
    text = plan('''import torch
from torch.utils.data import DataLoader, TensorDataset

SHUFFLE = False
train_ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
val_ds = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))


def get_loader(ds, batch_size, shuffle=True):
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle)


train_loader = get_loader(train_ds, 16, shuffle=SHUFFLE)
val_loader = get_loader(val_ds, 20, shuffle=False)
net = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for x, y in train_loader:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
''').text
    assert "if shuffle else" not in text and "return ddpkit.data_loader(ds, global_batch_size=batch_size" in text, text


def test_an_imported_evaluator_and_a_penalty_seeded_in_its_own_module_are_said_and_drawn_per_rank():
    """After-fix re-run: the same patterns across modules. ``from meters import Evaluator`` fed each training batch
    got no line; a gradient penalty in gp.py, which also holds the ``init_seeds`` that seeds torch, drew alike."""
    done = _settled({"meters.py": '''import numpy as np


class Evaluator:
    def __init__(self, n):
        self.m = np.zeros((n, n), dtype=int)

    def update(self, trues, preds):
        self.m[trues, preds] += 1
''', "gp.py": '''import torch


def init_seeds(seed):
    torch.manual_seed(seed)


def gradient_penalty(D, real, fake):
    alpha = torch.rand(real.size(0), 1)
    x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    g = torch.autograd.grad(D(x).sum(), x, create_graph=True)[0]
    return ((g.norm(2, dim=1) - 1) ** 2).mean()
''', "main.py": '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from gp import gradient_penalty, init_seeds
from meters import Evaluator

init_seeds(0)
G = nn.Linear(4, 8)
D = nn.Linear(8, 1)
oD = torch.optim.Adam(D.parameters())
evaluator = Evaluator(2)
for (real,) in DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8):
    fake = G(torch.randn(real.size(0), 4))
    out = D(real)
    lossD = D(fake.detach()).mean() - out.mean() + 10 * gradient_penalty(D, real, fake.detach())
    oD.zero_grad()
    lossD.backward()
    oD.step()
    evaluator.update(real.argmax(1).numpy(), out.argmax(1).numpy())
print(evaluator.m)
'''})
    assert "alpha = torch.rand(real.size(0), 1, generator=ddpkit.rank_generator())" in done["gp.py"].text, \
        done["gp.py"].text
    assert any(k.what.startswith("evaluator is fed each training batch") for k in done["main.py"].kept), \
        done["main.py"].kept


def test_images_saved_in_a_loop_of_a_helper_called_after_training_are_rank_0s():
    """MahyadSaedpanah/GAN: ``save_image_grid(fake, ...)`` after the epochs saves each generated image in a loop
    (``transforms.ToPILImage()(img).save(...)``): every rank wrote them (a save in a loop was taken for a data
    preparation's)."""
    text = plan('''import os
import torch
import torchvision.transforms as transforms
from torch.utils.data import DataLoader, TensorDataset


def save_image_grid(images, folder):
    for i, img in enumerate(images):
        img = transforms.ToPILImage()(img)
        img.save(os.path.join(folder, f"fake_{i}.png"))


G = torch.nn.Linear(2, 64)
opt = torch.optim.Adam(G.parameters(), lr=1e-3)
for (x,) in DataLoader(TensorDataset(torch.rand(32, 64)), batch_size=8, shuffle=True):
    loss = (G(torch.randn(x.size(0), 2)) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    save_image_grid(G(torch.randn(4, 2)).view(4, 1, 8, 8), "out")
''').text
    assert "        if ddpkit.init().is_main:\n            img.save(os.path.join(folder" in text, text


@pytest.mark.parametrize("call", ["step(*batch, True)", "step(*batch, **opts)", "step(batch[0])"])
def test_a_training_loop_whose_helper_steps_under_a_flag_stays_one_when_the_flag_cannot_be_told(call):
    """Review 30: ``step(*batch, True)`` and ``step(x, y, **opts)`` were read as leaving ``train`` at its default
    False, and a helper that trains through ``d_step(...)`` beside its flagged backward as switched off: the
    training loop became an evaluation (no_grad, a whole loader), and the launch crashed."""
    text = plan(f'''import torch
from torch.utils.data import DataLoader, TensorDataset

G = torch.nn.Linear(4, 4)
D = torch.nn.Linear(4, 1)
oG = torch.optim.SGD(G.parameters(), lr=0.1)
oD = torch.optim.SGD(D.parameters(), lr=0.1)
opts = {{"train": True}}


def d_step(real):
    loss = D(G(torch.randn_like(real)).detach()).mean() - D(real).mean()
    oD.zero_grad()
    loss.backward()
    oD.step()


def step(real, y=None, train=False):
    {"d_step(real)" if call == "step(batch[0])" else "pass"}
    loss = -D(G(torch.randn_like(real))).mean()
    if train:
        oG.zero_grad()
        loss.backward()
        oG.step()


loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 4)), batch_size=8, shuffle=True)
for batch in loader:
    {call}
''').text
    assert "ddpkit.data_loader(TensorDataset(torch.randn(64, 4), torch.randn(64, 4)), global_batch_size=8" in text \
        and "shuffle=True, train=False" not in text and "no_grad" not in text, text


def test_a_seed_set_by_a_utils_helper_the_main_script_calls_reaches_the_training_module():
    """Review 30: main.py calls ``utils.seed_all(0)``, then ``gan.train_gan(...)``: gan.py and utils.py import
    neither each other, and the noise gan.py draws stayed alike on every rank."""
    done = _settled({"utils.py": "import torch\n\n\ndef seed_all(seed):\n    torch.manual_seed(seed)\n",
                     "gan.py": LOOP, "main.py": SEEDING_MAIN.replace("torch.manual_seed(999)", "seed_all(999)")
                     .replace("from loop import train_gan", "from loop import train_gan\nfrom utils import seed_all")
                     .replace("from loop", "from gan")})
    assert "generator=ddpkit.rank_generator()" in done["gan.py"].text, done["gan.py"].text


def test_a_loss_rebound_to_the_epochs_mean_and_printed_is_not_said_to_be_the_steps():
    """WKUAILAB's lesson: ``loss = running_loss / n_batch`` after the inner loop (its sum reduced), then printed in
    the epoch loop: it was said to be "the step's loss: this rank's" (false: every rank's mean)."""
    done = plan('''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=16, shuffle=True)
net = nn.Linear(4, 2)
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    running_loss = 0.0
    n_batch = len(loader)
    for inputs, labels in loader:
        optimizer.zero_grad()
        loss = criterion(net(inputs), labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
    loss = running_loss / n_batch
    print(f"loss: {loss:.3f}, epoch: {epoch}")
''')
    assert not any("the step's loss" in k.what for k in done.kept), done.kept
    assert "running_loss = ddpkit.reduce(running_loss, op='mean')" in done.text, done.text


@pytest.mark.parametrize("where", ["here", "utils.py"])
def test_only_the_model_a_penalty_helper_is_handed_is_prepared_without_syncbatchnorm(where):
    """Lornatang/WassersteinGAN_GP-PyTorch: ``calculate_gradient_penalty(self.discriminator, real, fake)`` of
    another module differentiates the critic twice; the generator, never differentiated twice, was prepared with
    ``sync_batchnorm=False`` too (its BatchNorm then normalised each rank's half: not what one process does)."""
    helper = '''def penalty(D, real, fake):
    alpha = torch.rand(real.size(0), 1)
    x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    g = torch.autograd.grad(D(x).sum(), x, create_graph=True)[0]
    return ((g.norm(2, dim=1) - 1) ** 2).mean()
'''
    main = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
{imports}
G = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
D = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
oG = torch.optim.Adam(G.parameters())
oD = torch.optim.Adam(D.parameters())
for (real,) in DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=8):
    fake = G(torch.randn(real.size(0), 4))
    lossD = D(fake.detach()).mean() - D(real).mean() + 10 * penalty(D, real, fake.detach())
    oD.zero_grad()
    lossD.backward()
    oD.step()
    lossG = -D(fake).mean()
    oG.zero_grad()
    lossG.backward()
    oG.step()
'''
    if where == "here":
        text = plan(main.format(imports="\n\n" + helper)).text
    else:
        text = _settled({"utils.py": "import torch\n\n\n" + helper,
                         "main.py": main.format(imports="from utils import penalty\n")})["main.py"].text
    assert "D = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), " \
        "sync_batchnorm=False)" in text, text
    assert "G = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))" in text, text
