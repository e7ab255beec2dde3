"""What the tenth held-out set (docs/convert.md) found ``ddpkit convert`` owes public scripts, each a case written
in our own words after the pattern the set met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

ABSA = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Instructor:
    def __init__(self, opt):
        self.opt = opt
        self.model = nn.Linear(4, 2).to(opt.device)
        self.trainset = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    def run(self):
        _params = filter(lambda p: p.requires_grad, self.model.parameters())
        optimizer = self.opt.optimizer(_params, lr=self.opt.lr)
        for x, y in DataLoader(dataset=self.trainset, batch_size=8, shuffle=True):
            loss = nn.functional.cross_entropy(self.model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--lr", default=1e-3, type=float)
    opt = parser.parse_args()
    opt.optimizer = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[opt.optimizer]
    opt.device = torch.device("cpu")
    Instructor(opt).run()


main()
'''


def test_an_optimizer_class_kept_in_the_settings_trains_the_model_of_its_parameters():
    """ABSA-PyTorch: ``optimizer = self.opt.optimizer(_params, lr=...)`` (a torch optimizer class kept in the
    argparse Namespace, ``_params = filter(..., self.model.parameters())``) was read as the settings' own method
    handing out an optimizer: ``opt = ddpkit.prepare_model(opt)`` (AttributeError: 'Namespace' object has no
    attribute 'parameters'), and the model left unwrapped."""
    done = plan(ABSA)
    assert "self.model = ddpkit.prepare_model(nn.Linear(4, 2))" in done.text, done.text
    assert "prepare_model(opt)" not in done.text and not done.left, done.left
    handed = ABSA.replace("self.opt.optimizer(_params, lr=self.opt.lr)", "self.model.get_optimizer(self.opt.lr)")
    assert "self.model = ddpkit.prepare_model(nn.Linear(4, 2))" in plan(handed).text  # a model's own method: as before


CIFAR = '''"""Trains on CIFAR-10 or CIFAR-100."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
net = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for images, targets in loader:
    opt.zero_grad()
    loss = F.cross_entropy(net(images), targets)
    loss.backward()
    opt.step()
    print("last 100 losses", [loss.item()][-100:])
'''


def test_a_dataset_named_in_a_text_is_no_label_padding():
    """augmix: its help says "CIFAR-10, CIFAR-100": the ``-100`` in that text was read as labels padded with
    -100, and its plain ``cross_entropy(logits, targets)`` listed as a token mean (or counted by batch_count=)."""
    done = plan(CIFAR)
    assert not done.left and "batch_count" not in done.text, (done.left, done.text)
    padded = CIFAR.replace("for images, targets in loader:\n", "for images, targets in loader:\n"
                           "    targets[targets == 0] = -100\n")
    assert [left.line for left in plan(padded).left if "a mean over the tokens" in left.what] == [11]


def test_a_setting_written_on_the_model_after_its_move_is_no_initialisation():
    """resnet1d: ``model.to(device)``, then ``model.verbose = False`` (a flag its forward reads), then the
    optimizer: the flag was listed as an initialisation after prepare_model. Through the wrapper the write reaches
    the module (forwarding.py); a new part (``model.fc = nn.Linear(...)``) there still takes the wrap below it."""
    source = CIFAR.replace("net = torch.nn.Linear(4, 2)\n", "net = torch.nn.Linear(4, 2)\nnet.to('cpu')\n"
                           "net.verbose = False\n")
    done = plan(source)
    assert not done.left and "net = ddpkit.prepare_model(net)\nnet.verbose = False\n" in done.text, done.text
    head = plan(source.replace("net.verbose = False", "net.fc = torch.nn.Linear(2, 2)"))
    assert "net.fc = torch.nn.Linear(2, 2)\nnet = ddpkit.prepare_model(net)\n" in head.text, head.text


CAPS = '''import argparse
import torch
from torch.utils.data import DataLoader, TensorDataset


def train(model, loader):
    opt = torch.optim.Adam(model.parameters())
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        torch.save(model.state_dict(), "epoch%d.pkl" % epoch)
    torch.save(model.state_dict(), "trained_model.pkl")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4, shuffle=True)
    model = torch.nn.Linear(4, 2)
    if args.weights is not None:
        model.load_state_dict(torch.load(args.weights))
    train(model, loader)
'''


def test_a_read_in_the_main_block_before_the_training_call_is_no_race():
    """CapsNet-Pytorch: its ``__main__`` block loads ``--weights``, then calls ``train()``, which saves every
    epoch: the load was said to race the saves. A read below the call still races: waited for (a barrier before
    it, which every rank reaches, set 25's c/s06)."""
    # (nor is the model, built in that block and trained by train(), one built on one path of an if)
    assert not plan(CAPS).left, plan(CAPS).left
    below = plan(CAPS + "    model.load_state_dict(torch.load('trained_model.pkl'))\n")
    assert not below.left and "    train(model, loader)\n    ddpkit.barrier()\n    model.load_state_dict(" in \
        below.text, below.text


def test_a_rate_shown_over_the_batch_size_is_listed():
    """pointnet.pytorch: ``print(... % (correct.item() / float(opt.batchSize)))`` in the training loop: with the
    batch global, each process's batch is B/N and the accuracy shown was 1/N of the one-process one, nothing said.
    A count of steps shown (``len(dataset) // B``) is right as it is."""
    rate = CIFAR.replace(
        '    print("last 100 losses", [loss.item()][-100:])\n',
        '    correct = (net(images).argmax(1) == targets).sum()\n    print("acc %f" % (correct.item() / float(4)))\n')
    assert rate != CIFAR
    named = rate.replace("batch_size=4", "batch_size=bs").replace("float(4)", "float(bs)").replace(
        "import torch\n", "import torch\nbs = 4\n", 1)
    done = plan(named)
    assert [left.line for left in done.left if "a rate shown over bs" in left.what] == [15], done.left
    steps = named.replace("correct.item() / float(bs)", "len(loader.dataset) // bs")
    assert not plan(steps).left, plan(steps).left


def test_a_training_loader_handed_to_another_modules_function_is_listed_in_file_mode():
    """PyTorch_Tutorial (TingsongYu): after training, ``validate(net, train_loader, 'train')``, imported from the
    project's utils: converted alone, the loader became a training shard and the accuracy it printed covered each
    rank's half, nothing said. A call that also hands the optimizer trains: not listed."""
    source = "from helpers import validate\n" + CIFAR + "validate(net, loader, 'train')\n"
    done = plan(source)
    assert [left.line for left in done.left if "is also handed to validate" in left.what] == [6], done.left
    trains = "from helpers import fit\n" + CIFAR + "fit(net, loader, opt)\n"
    assert not [left for left in plan(trains).left if "is also handed" in left.what]


FETCH = '''import torch
from torch.utils.data import DataLoader, TensorDataset


def fetch_dataloader(types, batch_size):
    trainset = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    devset = TensorDataset(torch.randn(8, 8), torch.randint(0, 3, (8,)))
    trainloader = DataLoader(trainset, batch_size=batch_size, shuffle=True)
    devloader = DataLoader(devset, batch_size=batch_size, shuffle=False)
    if types == "train":
        dl = trainloader
    else:
        dl = devloader
    return dl
'''


def test_a_dev_set_loader_is_named_for_evaluation():
    """knowledge-distillation-pytorch (Stanford CS230's template): ``fetch_dataloader(types, params)`` builds
    ``trainloader`` and ``devloader`` and returns the one ``types`` names: the dev set's loader was refused as one
    whose role cannot be told. A loader over a dataset made on a device is no dev set."""
    done = plan(FETCH)
    assert not done.refused, done.left
    assert "trainloader = ddpkit.data_loader(trainset, global_batch_size=batch_size, shuffle=True)" in done.text
    assert [k.line for k in done.kept if "an evaluation DataLoader (by its name)" in k.what] == [9], done.kept
    device = FETCH.replace("devset", "data_on_device").replace("devloader", "loader_b")
    assert plan(device).refused


def test_a_loader_built_in_the_branch_of_a_split_takes_that_splits_role():
    """A data provider's ``if flag == 'train': DataLoader(..., shuffle=True)`` / ``else: DataLoader(...,
    shuffle=False)`` (the tenth set's Time-Series-Library, in our words): the else's loader was refused as one
    whose role cannot be told; it evaluates."""
    source = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef provider(flag, bs):\n"
              "    data = TensorDataset(torch.randn(16, 2))\n    if flag == 'train':\n"
              "        loader = DataLoader(data, batch_size=bs, shuffle=True)\n    else:\n"
              "        loader = DataLoader(data, batch_size=bs, shuffle=False)\n    return data, loader\n")
    done = plan(source)
    assert not done.refused and "ddpkit.data_loader(data, global_batch_size=bs, shuffle=True)" in done.text
    assert [k.line for k in done.kept if "an evaluation DataLoader" in k.what] == [10], done.kept


def test_a_pil_image_or_an_animation_saved_is_rank_0s():
    """Diffusion-Models-pytorch's ``Image.fromarray(ndarr).save(path)`` in its save_images helper, InfoGAN's
    ``anim.save('gan.gif')``: every rank wrote the same file, nothing said."""
    source = CIFAR + ("from PIL import Image\nimport matplotlib.animation as animation\n\n\ndef show(a, path):\n"
                      "    im = Image.fromarray(a)\n    im.save(path)\n\n\nImage.fromarray(a).save('x.png')\n"
                      "anim = animation.ArtistAnimation(fig, [])\nanim.save('gan.gif')\n")
    done = plan(source)
    assert done.text.count("ddpkit.init().is_main:") == 3, done.text
    assert [e.line for e in done.edits if e.what.startswith("save guarded")] == [20, 23, 25], done.edits


def test_a_dataparallel_line_below_the_optimizer_becomes_the_wrap_on_every_path():
    """augmix: ``if args.model == 'densenet': net = ... elif ...: net = ...`` (no else), the SGD optimizer over
    ``net.parameters()``, then ``net = torch.nn.DataParallel(net).cuda()``: the wrap went into the last branch
    only, and the default model was never prepared (the first step stopped it)."""
    source = CIFAR.replace("net = torch.nn.Linear(4, 2)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\n",
                           "arch = 'small'\nif arch == 'small':\n    net = torch.nn.Linear(4, 2)\n"
                           "elif arch == 'big':\n    net = torch.nn.Sequential(torch.nn.Linear(4, 2))\n"
                           "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nnet = torch.nn.DataParallel(net).cuda()\n")
    done = plan(source)
    assert "opt = torch.optim.SGD(net.parameters(), lr=0.1)\nnet = ddpkit.prepare_model(net)\n" in done.text, done.text
    assert done.text.count("prepare_model") == 1 and not done.left, done.left


def test_a_validation_loader_from_the_training_loaders_helper_is_listed():
    """LLMs-from-scratch ch05: ``create_dataloader_v1(..., shuffle=True)`` for training and ``(..., shuffle=False)``
    for validation, one helper of another module: the helper's loader became a training shard, and the validation
    loss its evaluation printed was rank 0's shard, nothing said. A second call that also trains is not listed."""
    from ddpkit.commands.convert.crossing import settle

    files = {
        "helpers.py": HELPER,
        "main.py": "import torch\nfrom helpers import make\n\ntrain = make(torch.randn(32, 4), True)\n"
                   "val = make(torch.randn(8, 4), False)\nmodel = torch.nn.Linear(4, 4)\n"
                   "opt = torch.optim.AdamW(model.parameters())\nfor (x,) in train:\n    opt.zero_grad()\n"
                   "    model(x).sum().backward()\n    opt.step()\nwith torch.no_grad():\n"
                   "    print(sum(model(x).sum().item() for (x,) in val))\n",
    }
    done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    # (the calls tell the roles apart by the flag they pass, True and False: since the nineteenth set, the helper's
    # loader is sharded for the True call only, and the validation stays whole, each rank evaluating all of it)
    assert "ddpkit.data_loader(TensorDataset(data), global_batch_size=4, shuffle=shuffle) if shuffle else " \
        "DataLoader(" in done["helpers.py"].text, done["helpers.py"].text
    assert not done["main.py"].left, done["main.py"].left
    told = dict(files, **{"main.py": files["main.py"].replace("True)", "len(sys.argv) > 0)").replace(
        "False)", "len(sys.argv) < 0)").replace("import torch\n", "import sys\nimport torch\n")})
    done = settle(list(told), lambda rel, crossing: plan(told[rel], crossing=crossing))
    assert "ddpkit.data_loader(" in done["helpers.py"].text and " if shuffle else " not in done["helpers.py"].text
    assert [left.line for left in done["main.py"].left if "val comes from make() of helpers" in left.what] == [6]
    both = dict(files, **{"main.py": files["main.py"].split("with torch.no_grad()")[0] +
                          "for (x,) in val:\n    opt.zero_grad()\n    model(x).sum().backward()\n    opt.step()\n"})
    done = settle(list(both), lambda rel, crossing: plan(both[rel], crossing=crossing))
    assert not [left for left in done["main.py"].left if "comes from make()" in left.what], done["main.py"].left


HELPER = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef make(data, shuffle):\n"
          "    return DataLoader(TensorDataset(data), batch_size=4, shuffle=shuffle)\n")


def test_a_loss_from_a_method_of_the_model_names_it_in_forward_methods():
    """pytorch-flows: ``loss = -model.log_probs(inputs).mean()``: the loss came from a method, outside DDP's
    forward, and the converted run stopped at its first step. The method the loss is made from, also through the
    loop's names (``out = net.decode(x)``), is named in ``forward_methods``; a set-up call is not."""
    flows = CIFAR.replace("    loss = F.cross_entropy(net(images), targets)\n",
                          "    h = net.init_hidden(4)\n    loss = -net.log_probs(images, h).mean()\n")
    done = plan(flows)
    assert "net = ddpkit.prepare_model(torch.nn.Linear(4, 2), forward_methods=('log_probs',))" in done.text, done.text
    assert not done.left, done.left
    decoded = CIFAR.replace("    loss = F.cross_entropy(net(images), targets)\n",
                            "    out = net.decode(images)\n    loss = F.cross_entropy(out, targets)\n")
    assert "forward_methods=('decode',)" in plan(decoded).text
    assert "forward_methods" not in plan(CIFAR).text


def test_second_review_a_freeze_a_late_wrap_a_preparation_loop_and_a_count_of_steps():
    """Second review: (1) ``model.head.weight.requires_grad = False`` after the move was taken for a setting and
    the wrap put above the freeze (DDP then waited for a gradient that never came); (2) a DataParallel line after
    the training loop became the wrap (training ran unwrapped); (3) a PIL save in a preparation loop became rank
    0's, and the other ranks read the folder before it was written; (4) a count of steps shown (``n // B``) was
    listed as a rate."""
    frozen = CIFAR.replace("net = torch.nn.Linear(4, 2)\n", "net = torch.nn.Linear(4, 2)\nnet.to('cpu')\n"
                           "net.weight.requires_grad = False\n")
    assert "net.weight.requires_grad = False\nnet = ddpkit.prepare_model(net)\n" in plan(frozen).text
    late = CIFAR.replace("net = torch.nn.Linear(4, 2)\n", "if len('ab') == 2:\n    net = torch.nn.Linear(4, 2)\n"
                         "elif len('a') == 3:\n    net = torch.nn.Linear(4, 2)\n")
    late += "net = torch.nn.DataParallel(net)\n"
    done = plan(late)
    assert "ddpkit.prepare_model(net)\n" not in done.text.split("for images")[1], done.text
    # (an elif chain with no else binds it on every path that does not end in the script's own NameError: the
    # twelfth session; prepared below the chain)
    assert "elif len('a') == 3:\n    net = torch.nn.Linear(4, 2)\nnet = ddpkit.prepare_model(net)\n" in done.text
    prepared = "from PIL import Image\nfor p in ['a.jpg', 'b.jpg']:\n    Image.open(p).save(p + '.png')\n" + CIFAR
    assert "is_main" not in plan(prepared).text.split("TensorDataset")[0]
    steps = CIFAR.replace('    print("last 100 losses", [loss.item()][-100:])\n',
                          '    print("steps", 16 // bs, "acc", float(loss) / 2)\n').replace(
        "batch_size=4", "batch_size=bs").replace("import torch\n", "import torch\nbs = 4\n", 1)
    assert not plan(steps).left, plan(steps).left


def test_after_the_fixes_a_walk_over_the_models_children_and_a_bar_whose_count_is_read():
    """The re-run after the fixes: ABSA's ``_reset_params`` walks ``self.model.children()`` and re-initialises
    every child that is not the BERT: on the prepared model the one child is the whole wrapped module (its
    pretrained BERT re-initialised at 2 processes). pytorch-flows divides by ``pbar.n``: the bar disabled on the
    other ranks counted nothing (ZeroDivisionError on rank 1)."""
    walked = CIFAR.replace("opt = torch.optim", "for child in net.children():\n    torch.nn.init.zeros_(child.weight)\n"
                           "opt = torch.optim")
    assert "for child in ddpkit.unwrap(net).children():" in plan(walked).text, plan(walked).text
    counted = CIFAR + "bar = tqdm(total=4)\nfor i in range(4):\n    bar.update(1)\nprint(1 / bar.n)\n"
    counted = "from tqdm import tqdm\n" + counted
    done = plan(counted)
    assert "bar = tqdm(total=4)\n" in done.text and any("left on every rank" in k.what for k in done.kept)
    shown = counted.replace("print(1 / bar.n)\n", "")
    assert "tqdm(total=4, disable=" in plan(shown).text
