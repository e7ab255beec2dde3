"""Review 40 (a reviewer on set 26's fixes, /work/review40_out): each defect it reproduced, as a case in our own
words; each test failed on the tree it reviewed."""
import pytest

from conftest import settled

pytest.importorskip("libcst")

from test_convert_twentysixth import BOX_LOSS, BOX_TRAIN, HANDED_GAN, HANDED_RUN, SUM_DECAY, VIEW_LITERAL  # noqa: E402

from ddpkit.commands.convert.flow import callee  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402
from ddpkit.commands.convert.scan import parse, scan  # noqa: E402


def test_super_init_runs_no_method_of_the_file():
    """D04: ``super().__init__()`` of one class resolved to another class's ``__init__`` of the file (neither a base
    of the other), so the trainer class had a "caller" again."""
    facts = scan(parse("import torch.nn as nn\nclass A:\n    def __init__(self, g):\n"
                       "        super(A, self).__init__()\n"
                       "class Gen(nn.Module):\n    def __init__(self):\n        super().__init__()\n"))
    supers = [c for c in facts.calls if c.last == "__init__"]
    assert len(supers) == 2 and all(callee(facts, c) is None for c in supers)


STEP = '''import torch


def train_step(g, d, g_opt, d_opt, x):
    z = torch.randn(x.size(0), 8)
    d_opt.zero_grad()
    (d(g(z).detach()).mean() - d(x).mean()).backward()
    d_opt.step()
    for p in d.parameters():
        p.data.clamp_(-0.01, 0.01)
    z = torch.randn(x.size(0), 8)
    g_opt.zero_grad()
    (-d(g(z)).mean()).backward()
    g_opt.step()
'''
STEP_MAIN = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from steps import train_step
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(128, 4)), batch_size=32, shuffle=True)
g, d = nn.Linear(8, 4), nn.Linear(4, 1)
g_opt = torch.optim.Adam(g.parameters(), lr=1e-3)
d_opt = torch.optim.Adam(d.parameters(), lr=1e-3)
for epoch in range(2):
    for (x,) in loader:
        train_step(g, d, g_opt, d_opt, x)
'''


def test_a_wgan_step_of_another_module_with_a_clipping_loop_keeps_its_rank_noise():
    """D01: the weight-clipping ``for p in d.parameters()`` made the step "a function with loops of its own", whose
    draws outside them were then left plain: every rank drew the same z."""
    text = settled({"main.py": STEP_MAIN, "steps.py": STEP})["steps.py"].text
    assert text.count("generator=ddpkit.rank_generator()") == 2, text


def test_a_checkpoint_loaded_into_a_handed_model_is_no_init_after_the_wrap():
    """D02: ``generator.load_state_dict(torch.load(path))`` in the trainer was listed as "ranks start different":
    every rank loads the same file."""
    gan = HANDED_GAN.format(init="", trained="").replace(
        "        self.generator = generator\n",
        "        generator.load_state_dict(torch.load('g.pt'))\n        self.generator = generator\n")
    done = settled({"run.py": HANDED_RUN, "gan/__init__.py": "", "gan/GAN.py": gan})
    assert not done["gan/GAN.py"].left, [x.what for x in done["gan/GAN.py"].left]


def test_models_built_inline_in_the_trainer_classs_call_are_listed():
    """D03: ``dcgan(nn.Linear(4, 8), nn.Linear(8, 1), loader)``: nothing wrapped them and no line said so (the
    class's ``__init__`` was taken as called by no file of the project)."""
    run = HANDED_RUN.replace("gan = dcgan(generator, discriminator, dataloader)",
                             "gan = dcgan(nn.Linear(4, 8), nn.Linear(8, 1), dataloader)")
    done = settled({"run.py": run, "gan/__init__.py": "", "gan/GAN.py": HANDED_GAN.format(init="", trained="")})
    left = [x.what for p in done.values() for x in p.left]
    assert any("a parameter of DCGAN.__init__()" in w for w in left) or \
        any("prepare_model" in p.text for p in done.values()), left


def test_the_decay_of_another_models_optimizer_does_not_list_a_summed_loss():
    """D05: a classifier's ``Adam(weight_decay=...)`` listed the VAE's summed loss, stepped by a plain Adam."""
    src = SUM_DECAY.format(optimizer="Adam(model.parameters(), lr=1e-2)").replace(
        "loader = DataLoader", "clf = nn.Linear(8, 3)\nopt_clf = torch.optim.Adam(clf.parameters(), weight_decay=5e-4)"
        "\nloader = DataLoader").replace("        opt.step()\n", "        opt.step()\n        opt_clf.zero_grad()\n"
                                         "        clf(x).mean().backward()\n        opt_clf.step()\n")
    assert not [x.what for x in plan(src).left if "sum over the batch" in x.what]


def test_a_preview_helper_called_in_the_training_loop_draws_as_written():
    """D06: ``show(netG, i)``, drawing a fixed-size z under no_grad each step, was given this rank's generator."""
    src = STEP_MAIN.replace("from steps import train_step\n", "") + \
        "        with torch.no_grad():\n            show(g, x)\n"
    src = src.replace("torch.manual_seed(0)\n", "torch.manual_seed(0)\n\n\ndef show(net, x):\n"
                      "    print(net(torch.randn(16, 8)).mean())\n\n\n").replace(
        "        train_step(g, d, g_opt, d_opt, x)\n", "        d_opt.zero_grad()\n        d(x).mean().backward()\n"
                                                     "        d_opt.step()\n")
    text = plan(src).text
    assert "print(net(torch.randn(16, 8)).mean())" in text, text


def test_a_number_reshaping_a_constant_table_is_no_batch_size():
    """D07: ``torch.arange(64).view(64, 1)`` in ``__init__`` (batch 64) kept the batch per process."""
    src = VIEW_LITERAL.format(rows="-1", size="64").replace(
        "        self.fc = nn.Linear(784, 10)\n",
        "        self.fc = nn.Linear(784, 10)\n        self.pos = torch.arange(64).view(64, 1)\n")
    p = plan(src)
    assert "global_batch_size=64" in p.text and not p.left, [x.what for x in p.left]


def test_a_loss_class_dividing_by_a_method_is_a_mean():
    """D09: ``self.mse(pred, target).div(pred.size(0))`` was listed as a sum over the batch."""
    files = {"train.py": BOX_TRAIN,
             "myloss.py": BOX_LOSS.format(divided="").replace("self.mse(pred, target)",
                                                               "self.mse(pred, target).div(pred.size(0))")}
    assert not [x.what for x in settled(files)["train.py"].left if "sum over the batch" in x.what]


def test_a_wgan_generator_step_after_its_critic_loop_keeps_its_rank_noise():
    """The guard of set 26's re-run fix (a picture's samples drawn after an epoch's steps stay alike): a generator
    step below its critic's loop, held by the loop over the loader, still draws from this rank's generator."""
    src = STEP_MAIN.replace("from steps import train_step\n", "").replace(
        "        train_step(g, d, g_opt, d_opt, x)\n",
        "        for _ in range(2):\n            z = torch.randn(x.size(0), 8)\n            d_opt.zero_grad()\n"
        "            (d(g(z).detach()).mean() - d(x).mean()).backward()\n            d_opt.step()\n"
        "        z = torch.randn(x.size(0), 8)\n        g_opt.zero_grad()\n        (-d(g(z)).mean()).backward()\n"
        "        g_opt.step()\n")
    text = plan(src).text
    assert text.count("generator=ddpkit.rank_generator()") == 2, text
