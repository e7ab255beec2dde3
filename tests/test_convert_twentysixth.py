"""What the twenty-sixth held-out set and its run-up showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

KL_WEIGHT = '''import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

batch_size = 16
train_set = TensorDataset(torch.randn(64, 8))
total = len(train_set)
loader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
model = nn.Linear(8, 8)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(2):
    for (x,) in loader:
        out = model(x)
        loss = F.mse_loss(out, x) + {weight} * out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


@pytest.mark.parametrize("weight", ["batch_size / total", "batch_size / len(train_set)"])
def test_a_weight_of_the_batchs_share_of_the_data_keeps_the_global_batch(weight):
    """Set 25's VAE (``kl_weight = batch_size / total_train_samples``): the global batch's share of the data is what
    one process weighted by, so the global batch keeps it; convert kept the batch per process and named the fix
    ``x.size(0)``, which halved the weight at 2 processes (verify then said "cannot compare")."""
    p = plan(KL_WEIGHT.format(weight=weight))
    assert "global_batch_size=batch_size" in p.text and not p.left, [x.what for x in p.left]


@pytest.mark.parametrize("weight", ["batch_size / half", "torch.zeros(batch_size // 4).sum()"])
def test_a_batch_size_over_a_number_still_sizes(weight):
    """Not the data's size: ``batch_size / half`` (``half = 2``) is a size of the batch's, still kept per process."""
    p = plan(KL_WEIGHT.format(weight=weight).replace("total = len", "half = 2\ntotal = len"))
    assert any("kept per process" in x.what for x in p.left), p.text


def test_a_string_an_edit_puts_in_a_single_quoted_fstring_takes_the_other_quote():
    """Set 26 (a homework VAE exported from a notebook): ``print(f'... {np.mean(train_loss)}')`` became
    ``ddpkit.print(f'... {ddpkit.reduce(np.mean(train_loss), op='mean')}')``, a SyntaxError on Python 3.11."""
    src = KL_WEIGHT.format(weight="0.1").replace("    for (x,) in loader:", "    losses = []\n    for (x,) in loader:")
    text = plan("import numpy as np\n" + src + "        losses += [loss.item()]\n"
                "    print(f'epoch {epoch} loss {np.mean(losses)}')\n").text
    assert "op=\"mean\")}')" in text, text
    compile(text, "converted.py", "exec")  # (the suite runs on 3.11: same quotes inside are a SyntaxError there)


SUM_DECAY = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

ds = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
model = nn.Linear(8, 1)
crit = nn.MSELoss(reduction="sum")
opt = torch.optim.{optimizer}
loader = DataLoader(ds, batch_size=32, shuffle=True)
for epoch in range(2):
    for x, y in loader:
        opt.zero_grad()
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
'''


@pytest.mark.parametrize("optimizer, listed", [
    ("Adam(model.parameters(), lr=1e-2, weight_decay=1.0)", True),
    ("RMSprop(model.parameters(), weight_decay=wd)", True),
    ("Adam(model.parameters(), lr=1e-2)", False), ("AdamW(model.parameters(), weight_decay=0.1)", False),
    ("Adam(model.parameters(), weight_decay=0.1, decoupled_weight_decay=True)", False),
    ("Adam(model.parameters(), weight_decay=0)", False), ("Adam(model.parameters(), weight_decay=NONE)", False)])
def test_a_summed_loss_stepped_by_adam_with_a_coupled_weight_decay_is_listed(optimizer, listed):
    """Set 26 (a homework VAE: BCE summed, ``Adam(weight_decay=...)``): Adam's step follows the gradient against the
    L2 term the decay adds to it, and a rank's sum over B/N samples is 1/N of the original's while the decay is
    not: verify FAILed, convert said nothing (it listed summed losses with SGD only). AdamW's decay is decoupled."""
    src = SUM_DECAY.format(optimizer=optimizer).replace("crit =", "wd = 0.1\nNONE = 0.0\ncrit =")
    left = [x for x in plan(src).left if "sum over the batch" in x.what]
    assert bool(left) == listed, [x.what for x in left]
    if listed:
        assert "weight_decay=" in left[0].what and "state.world_size" in left[0].fix and "reduction" not in left[0].fix


GENERATE_LOCAL = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y=None):
        return self.fc(x)

    def generate(self, idx):
        if len(idx.shape) == 0:
            batch_size = None
        else:
            batch_size = idx.shape[0]
        return self.fc(torch.randn(batch_size or 1, 8))


def main():
    batch_size = {size}
    train(batch_size)


def train(bs):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=bs, shuffle=True)
    for (x,) in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x{view}), x).backward()
        opt.step()


main()
'''


def test_a_local_of_the_same_name_in_a_model_method_is_not_the_batch_size():
    """Set 26 (a conditional VAE's ``generate`` binding its own ``batch_size = None``): ``None`` became a name of
    the loader's batch size, and ``forward(self, x, y=None)`` "read" it: kept per process, listed falsely. A caller
    that passes its own local on is followed still (``batch_size = args.bs`` in main, handed to ``train``)."""
    p = plan(GENERATE_LOCAL.format(size=16, view=""))
    assert "global_batch_size=bs" in p.text and not p.left, [x.what for x in p.left]
    p = plan(GENERATE_LOCAL.format(size=16, view=".view(batch_size, -1)").replace(
        "def train(bs):", "def train(bs):\n    global batch_size\n    batch_size = bs"))
    assert any("kept per process" in x.what for x in p.left), p.text


def test_the_same_device_set_up_written_twice_converts():
    """Set 26 (a notebook exported with its device cell twice): "device is chosen over several lines; write it as
    one: device = torch.device('cuda' if ...)", which both lines already were: refused, and each model's move
    with it. The same set-up again is the same device: each converts."""
    line = "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
    step = "for x, y in loader:\n    opt{n}.zero_grad()\n    nn.functional.mse_loss(m{n}(x.to(device)), " \
        "y.to(device)).backward()\n    opt{n}.step()\n"
    model = "m{n} = nn.Linear(4, 1)\nm{n}.to(device)\nopt{n} = torch.optim.Adam(m{n}.parameters(), lr=1e-3)\n"
    src = "import torch, torch.nn as nn\nfrom torch.utils.data import DataLoader, TensorDataset\n" + line + \
        "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True)\n" + \
        model.format(n=1) + step.format(n=1) + line + model.format(n=2) + step.format(n=2)
    p = plan(src)
    assert not p.left and p.text.count("device = state.device") == 2, [x.what for x in p.left]
    assert "m2 = ddpkit.prepare_model(m2)" in p.text, p.text


STEP_HELPER = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(1)
bce = nn.BCEWithLogitsLoss()


def train(x, netG, netD, optD, optG, device):
    z = torch.randn(x.size(0), 8, device=device)
    fake = netG(z)
    optD.zero_grad()
    lossD = bce(netD(x), torch.ones(x.size(0), 1)) + bce(netD(fake.detach()), torch.zeros(x.size(0), 1))
    lossD.backward()
    optD.step()
    optG.zero_grad()
    bce(netD(fake), torch.ones(x.size(0), 1)).backward()
    optG.step()


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = DataLoader(TensorDataset(torch.randn(128, 4)), batch_size=32, shuffle=True)
    netG = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    netD = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)).to(device)
    optD = torch.optim.Adam(netD.parameters(), lr=1e-3)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
    for epoch in range(2):
        for (x,) in loader:
            train(x.to(device), netG, netD, optD, optG, device)


main()
'''


def test_noise_a_step_helper_draws_for_the_models_it_is_handed_takes_this_ranks_generator():
    """Set 26 (a GAN whose step is a function of the script, handed netG and netD, torch seeded once at the top):
    every rank drew the same noise each step (the global batch's fakes were B/N draws N times), no line, and
    verify PASSed (it matches draws itself)."""
    text = plan(STEP_HELPER).text
    assert "z = torch.randn(x.size(0), 8, device=device, generator=ddpkit.rank_generator(device))" in text, text


FIXED_MAIN = '''import torch
from torch.utils.data import DataLoader, TensorDataset
from models import G, D
torch.manual_seed(1)


def train(x, netG, netD, optD, optG):
    fake = netG(torch.randn(x.size(0), 8))
    optD.zero_grad()
    (netD(x).mean() - netD(fake.detach()).mean()).backward()
    optD.step()
    optG.zero_grad()
    netD(fake).mean().backward()
    optG.step()


def main():
    fixed_noise = torch.randn(64, 8)
    loader = DataLoader(TensorDataset(torch.randn(128, 4)), batch_size=32, shuffle=True)
    netG, netD = G(), D()
    optD = torch.optim.Adam(netD.parameters(), lr=1e-3)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-3)
    for epoch in range(3):
        for (x,) in loader:
            train(x, netG, netD, optD, optG)
        with torch.no_grad():
            print(netG(fixed_noise).mean().item())


main()
'''
FIXED_MODELS = '''import torch, torch.nn as nn
torch.manual_seed(0)


class G(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))

    def forward(self, z):
        return self.net(z)


class D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)
'''


def test_a_pictures_fixed_noise_drawn_once_above_the_epoch_loop_stays_alike_on_every_rank():
    """Set 26 (MonoFlow's GAN project: ``fixed_noise = torch.randn(64, ...)`` in ``main`` above the epoch loop, fed
    to netG in train mode for each epoch's picture): given this rank's generator, each rank drew other fixed
    noise, and the picture and G's BatchNorm statistics differed from one process. The step's own noise still
    takes it."""
    files = {"train.py": FIXED_MAIN, "models.py": FIXED_MODELS}
    text = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["train.py"].text
    assert "fixed_noise = torch.randn(64, 8)\n" in text, text
    assert "netG(torch.randn(x.size(0), 8, generator=ddpkit.rank_generator()))" in text, text


VIEW_LITERAL = '''import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)

    def forward(self, x):
        x = x.view({rows}, 784)
        return F.log_softmax(self.fc(x), dim=1)


loader = DataLoader(TensorDataset(torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))), batch_size={size})
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for data, target in loader:
    opt.zero_grad()
    F.nll_loss(model(data), target).backward()
    opt.step()
'''


@pytest.mark.parametrize("rows, size, listed", [("16", "16", True), ("16", "bs", True), ("-1", "16", False),
                                                ("data_rows", "16", False)])
def test_a_batch_size_written_as_a_number_into_the_models_view_keeps_it_per_process(rows, size, listed):
    """Set 26 (a homework FCN: ``x.view(16, 784)`` in ``forward``, batch 16): converted with a global batch, each
    rank's 8 rows met the view of 16 at the first step. Said now, kept per process; the launch's likely cause names
    it too (faults.batch_hint reads a view's message)."""
    src = VIEW_LITERAL.format(rows=rows, size=size).replace("loader = ", "bs = 16\ndata_rows = 16\nloader = ")
    p = plan(src)
    assert any("x.view(16, 784)" in x.what for x in p.left) == listed, [x.what for x in p.left]
    assert ("global_batch_size=" in p.text) != listed, p.text


BOX_LOSS = '''import torch.nn as nn


class BoxLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.mse = nn.MSELoss(reduction="sum")

    def forward(self, pred, target):
        return self.mse(pred, target){divided}
'''
BOX_TRAIN = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from myloss import BoxLoss


def train_fn(loader, model, opt, loss_fn):
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main():
    loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 1)), batch_size=16, shuffle=True)
    model = nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = BoxLoss()
    for epoch in range(2):
        train_fn(loader, model, opt, loss_fn)


main()
'''


@pytest.mark.parametrize("divided, listed", [("", True), (" / pred.size(0)", False)])
def test_a_loss_class_of_another_module_summing_over_the_batch_is_listed(divided, listed):
    """Set 26 (a YOLO project: ``loss_fn = YoloLoss()`` of loss.py, ``nn.MSELoss(reduction="sum")`` inside): each
    rank's sum over B/N samples halved the steps at 2 processes, with no line (the same class in the training
    file was listed). One that divides by the batch is a mean."""
    files = {"train.py": BOX_TRAIN, "myloss.py": BOX_LOSS.format(divided=divided)}
    left = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["train.py"].left
    assert any("sum over the batch" in x.what for x in left) == listed, [x.what for x in left]


METRICS_HELPER = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def reset_metrics():
    return {'total_correct': 0, 'total_samples': 0}


def update_metrics(metrics, outputs, targets):
    metrics['total_correct'] += (outputs.argmax(1) == targets).sum().item()
    metrics['total_samples'] += targets.size(0)


train_loader = DataLoader(TensorDataset(torch.randn(128, 8), torch.randint(0, 3, (128,))), batch_size=16)
val_loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=16)
model = nn.Linear(8, 3)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for x, y in train_loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
val_metrics = {made}
with torch.no_grad():
    for x, y in val_loader:
        update_metrics(val_metrics, model(x), y)
print(val_metrics['total_correct'] / val_metrics['total_samples'])
'''


@pytest.mark.parametrize("made", ["reset_metrics()", "{'total_correct': 0, 'total_samples': 0}"])
def test_an_evaluation_dict_of_counts_a_helper_adds_to_leaves_the_loader_whole(made):
    """Set 26 (a CIFAR-100 recipe: ``update_metrics(val_metrics, outputs, targets)`` adding to a dict): the
    validation loader was sharded and its ``val_loss`` reduced, but not the dict: the printed accuracy was rank
    0's half, no line. Each rank evaluates the whole set now, said."""
    p = plan(METRICS_HELPER.replace("{made}", made))
    assert "val_loader = DataLoader(" in p.text and any("update_metrics()" in k.what for k in p.kept), p.text


HANDED_GAN = '''import torch
import torch.optim as optim


def weights(m):
    if isinstance(m, torch.nn.Linear):
        torch.nn.init.normal_(m.weight, 0.0, 0.02)


class DCGAN:
    def __init__(self, generator, discriminator, dataloader):
        super(DCGAN, self).__init__()
        self.generator = generator{init}
        self.discriminator = discriminator
        self.optim_gen = optim.Adam({trained}generator.parameters(), lr=1e-3)
        self.optim_disc = optim.Adam(discriminator.parameters(), lr=1e-3)
        self.dataloader = dataloader

    def train(self):
        for (x,) in self.dataloader:
            fake = self.generator(torch.randn(x.size(0), 4))
            self.optim_disc.zero_grad()
            (self.discriminator(fake.detach()).mean() - self.discriminator(x).mean()).backward()
            self.optim_disc.step()
            self.optim_gen.zero_grad()
            (-self.discriminator(fake).mean()).backward()
            self.optim_gen.step()
'''
HANDED_RUN = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from gan.GAN import DCGAN as dcgan

torch.manual_seed(0)
dataloader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=16, shuffle=True)
discriminator = nn.Linear(8, 1)
generator = nn.Linear(4, 8)
gan = dcgan(generator, discriminator, dataloader)
gan.train()
'''


def _handed(init, trained=""):
    files = {"run.py": HANDED_RUN, "gan/__init__.py": "",
             "gan/GAN.py": HANDED_GAN.format(init=init, trained=trained)}
    return settle(list(files), lambda rel, c: plan(files[rel], crossing=c))


def test_models_handed_to_a_trainer_class_calling_super_init_are_wrapped_where_built():
    """Set 26 (a DCGAN course project: ``DCGAN.__init__`` calls ``super(DCGAN, self).__init__()``): that call was
    read as a caller of DCGAN.__init__ in its own file, so the models it trains were asked of no file: "where it
    is built was not found", refused, and again after its named fix."""
    done = _handed("")
    assert "generator = ddpkit.prepare_model(nn.Linear(4, 8))" in done["run.py"].text, done["run.py"].text
    assert not done["gan/GAN.py"].left and not done["run.py"].left, [x.what for x in done["gan/GAN.py"].left]


def test_a_handed_model_initialised_in_the_trainer_is_prepared_there_and_its_loop_still_asks():
    """The same project's ``self.generator = generator.apply(weights)``: wrapped where built, each rank would set
    its own weights after the wrap (the launch stops: ranks start different). Listed with the fix (prepare it
    there); with that fix written in, the trainer's loop over the handed loader still asks its callers (a file
    with prepare_model counted as written with ddpkit, and the loader stayed plain)."""
    done = _handed(".apply(weights)")
    left = [x for x in done["gan/GAN.py"].left if "generator.apply(...)" in x.what]
    assert left and "self.generator = ddpkit.prepare_model(generator.apply(weights))" in left[0].fix, \
        [x.what for x in done["gan/GAN.py"].left]
    fixed = HANDED_GAN.format(init=".apply(weights)", trained="self.").replace(
        "self.generator = generator.apply(weights)", "self.generator = ddpkit.prepare_model(generator.apply(weights))")
    fixed = fixed.replace("self.discriminator = discriminator\n",
                          "self.discriminator = ddpkit.prepare_model(discriminator)\n")
    fixed = fixed.replace("optim.Adam(discriminator", "optim.Adam(self.discriminator")
    files = {"run.py": HANDED_RUN, "gan/__init__.py": "", "gan/GAN.py": "import ddpkit\n" + fixed}
    done = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))
    assert "ddpkit.data_loader(" in done["run.py"].text and "prepare_model" not in done["run.py"].text, \
        done["run.py"].text
    assert not done["run.py"].left and not done["gan/GAN.py"].left, [x.what for x in done["run.py"].left]


def test_a_summary_writer_imported_from_its_own_module_is_rank_zeros():
    """Set 26 (a GAN trainer: ``from torch.utils.tensorboard.writer import SummaryWriter``): left as it was, every
    rank wrote its event files into one folder while the add_image line said "rank 0's writer"."""
    src = KL_WEIGHT.format(weight="0.1").replace(
        "import torch, torch.nn", "from torch.utils.tensorboard.writer import SummaryWriter\nimport torch, torch.nn")
    text = plan(src + "writer = SummaryWriter('runs')\nwriter.add_scalar('loss', loss.item(), 0)\n").text
    assert "writer = ddpkit.summary_writer('runs')" in text, text


ENGINE = '''def train(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''
ENGINE_MAIN = '''import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from engine import train

loader = DataLoader(TensorDataset(torch.randn(64, 10), torch.randn(64, 1)), batch_size=16, shuffle=True)
model = nn.Linear(10, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def criterion(pred, target):
    return F.mse_loss(pred, target, reduction="{reduction}")


for epoch in range(2):
    train(model, loader, optimizer, criterion)
'''


@pytest.mark.parametrize("reduction, listed", [("sum", True), ("mean", False)])
def test_a_summing_criterion_handed_to_another_modules_training_function_is_listed(reduction, listed):
    """Set 26 (a VAE project: ``def criterion(...)`` summing, handed to ``train(model, loader, optimizer,
    criterion, device)`` of train_engine.py): every step's gradient halved at 2 processes, no line."""
    files = {"main.py": ENGINE_MAIN.format(reduction=reduction), "engine.py": ENGINE}
    left = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["main.py"].left
    assert any("sum over the batch" in x.what for x in left) == listed, [x.what for x in left]


TEST_BAR = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def progress_bar(i, n, msg):
    print(f"{i + 1}/{n} {msg}")


train_loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=16)
test_loader = DataLoader(TensorDataset(torch.randn(200, 8), torch.randint(0, 2, (200,))), batch_size=100)
net = nn.Linear(8, 2)
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for x, y in train_loader:
    opt.zero_grad()
    criterion(net(x), y).backward()
    opt.step()
test_loss, correct, total = 0, 0, 0
with torch.no_grad():
    for batch_idx, (x, y) in enumerate(test_loader):
        out = net(x)
        test_loss += criterion(out, y).item()
        total += y.size(0)
        correct += out.argmax(1).eq(y).sum().item()
        progress_bar(batch_idx, len(test_loader), 'Loss: %.3f | Acc: %.3f%%' % (test_loss / (batch_idx + 1),
                                                                                 100. * correct / total))
'''


def test_an_evaluation_shown_only_by_its_progress_line_keeps_its_loader_whole():
    """Set 26 (kuangliu-style CIFAR: the test loop's only output its progress line): sharded, it showed rank 0's
    running half, said by no line. Each rank evaluates the whole set now; with an accuracy read after the loop, the
    shown test loss that nothing reduces is named on the bar's line."""
    p = plan(TEST_BAR)
    assert "test_loader = DataLoader(" in p.text and any("progress_bar(...), read nowhere" in k.what for k in p.kept)
    p = plan(TEST_BAR + "acc = 100. * correct / total\nprint(acc)\n")
    shown = [k for k in p.kept if k.what.startswith("progress_bar(...) in the loop shows")]
    assert shown and "test_loss stays this rank's" in shown[0].why, [k.what for k in p.kept]


INIT_ORDER = '''import argparse, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import TensorDataset, DataLoader


def get_loaders(bs):
    return DataLoader(TensorDataset(torch.rand(64, 784), torch.randint(0, 10, (64,))), batch_size=bs, shuffle=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--cuda', default=1)
    use_cuda = int(p.parse_args().cuda)
    train_loader = get_loaders(16)
    device = torch.device("cuda" if use_cuda else "cpu")
    model = nn.Linear(784, 10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for data, target in train_loader:
        opt.zero_grad()
        F.cross_entropy(model(data.to(device)), target.to(device)).backward()
        opt.step()


main()
'''


def test_init_goes_above_a_call_of_the_files_own_loader_builder():
    """Set 26 (a homework: ``train_loader = get_loaders(16)`` above ``device = torch.device("cuda" if use_cuda
    ...)``): ``init(cpu=not use_cuda)`` came below the call, whose ddpkit.data_loader had started ddpkit with the
    defaults already (a second init returns that state): ``--cuda 0`` was not read on a GPU machine."""
    lines = plan(INIT_ORDER).text.splitlines()
    init = next(i for i, line in enumerate(lines) if "ddpkit.init(cpu=not use_cuda)" in line)
    assert init < next(i for i, line in enumerate(lines) if "train_loader = get_loaders(16)" in line), lines


EVAL_UTIL = '''import torch


def get_preds(loader, model):
    all_pred, all_true = [], []
    for x, y in loader:
        with torch.no_grad():
            out = model(x)
        for i in range(x.shape[0]):
            all_pred.append(int(out[i].argmax()))
            all_true.append(int(y[i]))
    return all_pred, all_true
'''
EVAL_TRAIN = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from evalutil import get_preds

ds = TensorDataset(torch.randn(64, 10), torch.randint(0, 3, (64,)))
train_loader = DataLoader(ds, batch_size=16, shuffle=True)
{evaluated}model = nn.Linear(10, 3)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for epoch in range(2):
    pred, true = get_preds({handed}, model)
    for x, y in train_loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
'''


def test_the_fix_named_for_a_training_loader_another_module_evaluates_converts_right():
    """Set 26 (yolo_v1's ``get_bboxes(train_loader, ...)``): the refusal named a ``ddpkit.data_loader(...,
    train=False)`` of its own, which, applied, converted with nothing said while the other module's evaluation
    collected one rank's half. It names a plain loader of its own now, which convert leaves whole."""
    files = {"evalutil.py": EVAL_UTIL, "train.py": EVAL_TRAIN.format(evaluated="", handed="train_loader")}
    left = [x for x in settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["train.py"].left if x.blocks]
    assert left and "DataLoader(dataset, batch_size)" in left[0].fix, [x.fix for x in left]
    files["train.py"] = EVAL_TRAIN.format(evaluated="eval_loader = DataLoader(ds, batch_size=16)\n",
                                          handed="eval_loader")
    done = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["train.py"]
    assert "eval_loader = DataLoader(ds, batch_size=16)" in done.text and not done.left, done.text


FIXED_PICTURE = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torchvision.utils import save_image

loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16, shuffle=True)
G, D = nn.Linear(8, 4), nn.Linear(4, 1)
opt = torch.optim.Adam(D.parameters(), lr=1e-3)
fixed_noise = torch.randn(16, 8)
for epoch in range(3):
    for (x,) in loader:
        opt.zero_grad()
        D(x).mean().backward()
        opt.step()
    with torch.no_grad():
        fake = G(fixed_noise)
    path = f"gan-{epoch}.png"
    save_image(fake, path)
'''


def test_a_picture_of_fixed_noise_named_by_the_epoch_is_no_share_of_a_batch():
    """Set 26 (MonoFlow: ``netG(fixed_noise)`` saved as ``gan-{epoch}.png`` in the epoch loop): its guard's note
    said "what it shows is rank 0's share of the step's batch"; the epoch count is no batch."""
    notes = [e.why for e in plan(FIXED_PICTURE).edits if e.what.startswith("save_image guarded")]
    assert notes and "share of the step's batch" not in notes[0], notes


COUNTED_DATA = '''import torch, ddpkit
from torch.utils.data import TensorDataset


def get_dataloader(batch_size):
    src = torch.randint(1, 50, (256, 10))
    return ddpkit.data_loader(TensorDataset(src, src.clone()), global_batch_size=batch_size, shuffle=True{count})
'''
COUNTED_MAIN = '''import torch, torch.nn as nn
from data import get_dataloader

loader = get_dataloader(32)
model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))
criterion = nn.CrossEntropyLoss(ignore_index=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for src, tgt in loader:
    loss = criterion(model(src[:, :-1]).reshape(-1, 50), tgt[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("count, listed", [("", True),
                                           (",\n                              batch_count=lambda b: (b[1] != 0).sum()",
                                            False)])
def test_a_token_count_told_in_the_module_that_builds_the_loader_is_seen(count, listed):
    """Set 26 (a Transformer project: ``ignore_index=0`` in main.py, its loader built in data.py): with the named
    fix written in data.py (``batch_count=``), main.py listed the token mean again."""
    files = {"data.py": COUNTED_DATA.format(count=count), "main.py": COUNTED_MAIN}
    left = settle(list(files), lambda rel, c: plan(files[rel], crossing=c))["main.py"].left
    assert any("batch_count" in x.fix for x in left) == listed, [x.what for x in left]


def test_a_shuffled_loader_read_only_to_print_predictions_stays_whole():
    """Set 26 (yolo_v1: a shuffled ``test_loader`` read after training only to run the model and plot, no
    no_grad, no eval()): refused as "a DataLoader whose role cannot be told"; it trains nothing, and every rank
    reading all of it is right."""
    src = KL_WEIGHT.format(weight="0.1").replace(
        "loader = DataLoader(", "test_loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=16, "
        "shuffle=True)\nloader = DataLoader(") + "for (x,) in test_loader:\n    print(model(x)[0].tolist())\n"
    p = plan(src)
    assert "test_loader = DataLoader(" in p.text and not p.left, [x.what for x in p.left]


CLOSURE = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    trainloader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=16)
    net = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def train(epoch):
        for inputs, targets in trainloader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs), targets).backward()
            optimizer.step()

    for epoch in range(2):
        train(epoch)


main()
'''


def test_a_training_loop_in_a_nested_function_reads_the_enclosing_functions_loader():
    """Set 26's extra five (a course lab: ``def train(epoch):`` inside ``main()``, over main's ``trainloader``): the
    closure's names were not read through, and the script was refused as "fed by hand"."""
    p = plan(CLOSURE)
    assert "trainloader = ddpkit.data_loader(" in p.text and "net = ddpkit.prepare_model(" in p.text and not p.left, \
        [x.what for x in p.left]


def test_a_name_bound_again_after_the_loop_to_fixed_noise_samples_is_no_last_batch():
    """Set 26's extra five (a DCGAN: ``fake = G(fixed_z)`` after the training loop, then ``save_image(fake, ...)``):
    said "the training loop's last batch ... ddpkit.gather(fake)", which would double the picture."""
    src = FIXED_PICTURE.replace("    path = f\"gan-{epoch}.png\"\n    save_image(fake, path)\n",
                                "    save_image(fake, 'gan-{}.png'.format(epoch))\n").replace(
        "        D(x).mean().backward()\n", "        fake = G(torch.randn(x.size(0), 8))\n"
        "        (D(x).mean() - D(fake).mean()).backward()\n")
    assert ".format(epoch)" in src
    kept = [k.what for k in plan(src).kept if "last batch" in k.what]
    assert not kept, kept


ROWS_BY_HAND = '''import torch
import ddpkit

data = [torch.rand(3, 8, 8) for _ in range(64)]
loader = torch.utils.data.DataLoader(data, batch_size=16)
eval_loader = ddpkit.data_loader(data, batch_size=16, train=False)
model = torch.nn.Conv2d(3, 3, 3, padding=1)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for x in loader:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x).backward()
    opt.step()
errs = []
with torch.no_grad():
    for x in eval_loader:
        errs.append(torch.nn.functional.mse_loss(model(x), x).item())
print(sum(errs) / len(errs))
'''


def test_per_sample_rows_of_a_hand_written_evaluation_loader_are_listed():
    """Set 26's extra five (an autoencoder's evaluation over ``ddpkit.data_loader(..., train=False)``, the fix a
    refusal used to name, collecting one error per sample): exit 0, nothing said, its count rank 0's half."""
    left = [x for x in plan(ROWS_BY_HAND).left if "per-sample results in errs" in x.what]
    assert left and "ddpkit.gather(errs)" in left[0].fix, [x.what for x in plan(ROWS_BY_HAND).left]


def test_running_sums_shown_in_an_evaluation_whose_function_returns_only_a_timing_are_said():
    """Set 26's extra five (a course lab's ``test()``: prints ``(correct/total)`` each step, returns its data time):
    the time was reduced after the loop and the shown counts said by nothing ((10/20) for (18/40))."""
    src = TEST_BAR.replace("test_loss, correct, total = 0, 0, 0\n", "test_loss, correct, total, seen = 0, 0, 0, 0\n")
    src = src.replace("        total += y.size(0)\n", "        total += y.size(0)\n        seen += y.size(0)\n")
    kept = [k for k in plan(src + "print(seen / len(test_loader.dataset))\n").kept
            if k.what.startswith("progress_bar(...) in the loop shows")]
    assert kept and "reduced by nothing" in kept[0].why, [k.what for k in plan(src).kept]


def test_a_value_a_step_helper_reads_from_a_model_it_is_handed_and_returns_is_said_when_printed():
    """Set 26 (MonoFlow: ``return lossD.item(), d.mean().item()`` of ``d = netD(fake)``, printed after the loop as
    ``loss_g``): rank 0's last half batch, said by nothing."""
    src = STEP_HELPER.replace("    bce(netD(fake), torch.ones(x.size(0), 1)).backward()\n",
                              "    d = netD(fake)\n    bce(d, torch.ones(x.size(0), 1)).backward()\n").replace(
        "    optG.step()\n\n\ndef main", "    optG.step()\n    return d.mean().item()\n\n\ndef main").replace(
        "            train(x.to(device), netG, netD, optD, optG, device)\n",
        "            g_loss = train(x.to(device), netG, netD, optD, optG, device)\n        print(g_loss)\n")
    assert "return d.mean().item()" in src and "print(g_loss)" in src
    kept = [k.what for k in plan(src).kept if "g_loss" in k.what]
    assert kept and "of the model's outputs on the batch" in kept[0], [k.what for k in plan(src).kept]


def test_samples_drawn_once_an_epoch_after_its_steps_stay_alike_on_every_rank():
    """Set 26's re-run (a GAN drawing ``z = torch.randn(10, 8)`` after each epoch's steps, under no_grad, for a
    picture through G in train mode): given this rank's generator, each rank's picture batch differed, and G's
    BatchNorm statistics with it. The step's noise keeps it (a WGAN's after its critic loop: test_convert_review40)."""
    src = STEP_HELPER.replace("            train(x.to(device), netG, netD, optD, optG, device)\n",
                              "            train(x.to(device), netG, netD, optD, optG, device)\n"
                              "        with torch.no_grad():\n            sample = netG(torch.randn(10, 8))\n")
    text = plan(src).text
    assert "sample = netG(torch.randn(10, 8))" in text and "generator=ddpkit.rank_generator(device))" in text, text


# review 41 (a reviewer on the late fixes, /work/review41_out): its three regressions, each failing first
WGAN_COUNT = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(1)
loader = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=32, shuffle=True, drop_last=True)
G, D = nn.Linear(8, 4), nn.Linear(4, 1)
g_opt = torch.optim.Adam(G.parameters(), lr=1e-3)
d_opt = torch.optim.Adam(D.parameters(), lr=1e-3)
for it in range(10):
    for (x,) in loader:
        d_opt.zero_grad()
        (D(G(torch.randn(x.size(0), 8)).detach()).mean() - D(x).mean()).backward()
        d_opt.step()
    noise = torch.randn(x.size(0), 8)
    g_opt.zero_grad()
    (-D(G(noise)).mean()).backward()
    g_opt.step()
'''


def test_a_generator_step_after_the_critic_loop_in_a_count_loop_keeps_its_rank_noise():
    """Review 41's D01: a draw after a count loop's training loops was taken for a picture's samples, also where a
    step follows it (not under no_grad): every rank drew the same noise for the generator's step."""
    assert "noise = torch.randn(x.size(0), 8, generator=ddpkit.rank_generator())" in plan(WGAN_COUNT).text


def test_a_weight_decay_parameter_is_not_read_through_a_module_global_of_its_name():
    """Review 41's D03: ``weight_decay=weight_decay`` in ``main(weight_decay=1e-4)`` was read as the module's
    ``weight_decay = 0.0``: the summed loss under Adam's decay went unlisted."""
    src = SUM_DECAY.format(optimizer="Adam(model.parameters(), lr=1e-2, weight_decay=weight_decay)")
    body = "\n".join("    " + line if line else line for line in src.split("\n")[3:])
    src = "\n".join(src.split("\n")[:3]) + "\nweight_decay = 0.0\n\n\ndef main(weight_decay=1e-4):\n" + body + \
        "\nmain()\n"
    assert any("sum over the batch" in x.what for x in plan(src).left), src


def test_a_name_bound_again_only_under_an_if_after_the_loop_may_still_be_the_last_batch():
    """Review 41's D06: ``if use_fixed: fake = G(fixed)`` after the loop dropped the last batch's note for the
    path that keeps the step's fakes."""
    src = FIXED_PICTURE.split("fixed_noise = torch.randn(16, 8)\n")[0] + (
        "fixed = torch.randn(16, 8)\nuse_fixed = False\nfor (x,) in loader:\n    fake = G(torch.randn(x.size(0), 8))\n"
        "    opt.zero_grad()\n    (D(x).mean() - D(fake).mean()).backward()\n    opt.step()\n"
        "if use_fixed:\n    fake = G(fixed)\nsave_image(fake, 'last.png')\n")
    assert any("the training loop's last batch" in k.what for k in plan(src).kept), plan(src).text
