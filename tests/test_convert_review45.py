"""Convert on what review 45 (a reviewer trying to break the fixes of the twenty-ninth held-out set) reproduced,
written again in our own words: each test failed on the reviewed tree (30cb815) before its fix."""

from __future__ import annotations

import pytest

from conftest import settled

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

VAE = ("import torch\nimport torch.nn.functional as F\nfrom torch.utils.data import DataLoader\nmodel = Vae()\n"
       "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n{crit}"
       "for (x,) in DataLoader(ds, batch_size=16, shuffle=True):\n    recon, mu, logvar = model(x)\n"
       "    bce = {bce}\n    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())\n    loss = bce + kld\n"
       "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n")


@pytest.mark.parametrize("crit, bce, listed", [
    ("", "F.binary_cross_entropy(recon, x, reduction='sum') / x.size(0)", True),  # a mean: the KL beside it
    ("crit = torch.nn.BCELoss(reduction='sum')\n", "crit(recon, x)", False),  # a sum, the criterion named
])
def test_a_summed_term_beside_a_reconstruction_read_as_it_is(crit, bce, listed):
    """R2: a sum divided by the batch's size is a mean, so the KL beside it is a term beside a mean (it went unsaid);
    R3: a criterion told reduction='sum' under a name makes the whole loss a sum (the KL was listed, its fix wrong)."""
    p = plan(VAE.format(crit=crit, bce=bce))
    assert any("a term of the training loss is summed" in x.what for x in p.left) is listed, [x.what for x in p.left]


def test_a_training_loop_through_a_function_ends_the_search_for_late_initialisations():
    """R1: ``for epoch in range(2): train(epoch)`` (the function trains the global model), then MC dropout's
    ``model.apply(enable_dropout)`` after training: listed as an initialisation after the wrap, a false line."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\n"
            "loader = DataLoader(ds, batch_size=8, shuffle=True)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Dropout(0.2))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\ndef train(epoch):\n    for x, y in loader:\n"
            "        opt.zero_grad()\n        ((model(x) - y) ** 2).mean().backward()\n        opt.step()\n"
            "def on(m):\n    m.train()\nfor epoch in range(2):\n    train(epoch)\nmodel.apply(on)\n")
    assert not [x for x in plan(text).left if "initialised here" in x.what], plan(text).left


def test_a_loss_method_running_the_models_own_forward_called_elsewhere_is_named():
    """R5: ``def loss(self, batch): return ((self(x) - y) ** 2).mean()``, called by training.py: left unnamed, the
    first step stopped ("the prepared model's forward never ran")."""
    main = ("import torch\nfrom torch.utils.data import DataLoader\nfrom training import train\n"
            "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.fc = torch.nn.Linear(4, 1)\n    def forward(self, x):\n        return self.fc(x)\n"
            "    def loss(self, batch):\n        x, y = batch\n        return ((self(x) - y) ** 2).mean()\n"
            "model = Net()\nopt = torch.optim.Adam(model.parameters())\n"
            "loader = DataLoader(ds, batch_size=8, shuffle=True)\ntrain(model, opt, loader)\n")
    training = ("def train(model, optimizer, loader):\n    for batch in loader:\n        loss = model.loss(batch)\n"
                "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n")
    done = settled({"main.py": main, "training.py": training})
    assert "ddpkit.prepare_model(Net(), forward_methods=('loss',))" in done["main.py"].text, done["main.py"].text


@pytest.mark.parametrize("saved, hoisted, kept", [
    ("model.eval()", "    model.eval()\n", "torch.save(ddpkit.unwrap(model), 'ckpt.pt')"),
    ("model.cpu().state_dict()", "    model.cpu()\n", "torch.save(model.state_dict(), 'ckpt.pt')"),
])
def test_a_move_or_mode_change_inside_a_saved_expression_runs_on_every_rank(saved, hoisted, kept):
    """R10: ``torch.save(model.eval(), path)`` each epoch became a guarded save of ``ddpkit.unwrap(model).eval()``:
    rank 0's model alone went to eval, its SyncBatchNorm collectives no longer paired the others', and the run hung."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Sequential(torch.nn.Linear(4, 2), "
            "torch.nn.BatchNorm1d(2))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor epoch in range(3):\n"
            "    model.train()\n    for x in DataLoader(ds, batch_size=8, shuffle=True):\n        opt.zero_grad()\n"
            f"        model(x).sum().backward()\n        opt.step()\n    torch.save({saved}, 'ckpt.pt')\n")
    text = plan(text).text
    assert f"{hoisted}    if ddpkit.init().is_main:\n        {kept}\n" in text, text


def test_statistics_pooling_over_time_and_a_parameters_spread_are_no_batchnorm():
    """R8: ``torch.cat([h.mean(0), h.std(0)], 1)`` over a sequence-first GRU's time, and prototypes standardised over
    their own rows, were listed as a BatchNorm of the script's own (a false line, exit 1)."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nclass Pool(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.rnn = torch.nn.GRU(4, 4)\n"
            "        self.protos = torch.nn.Parameter(torch.randn(5, 8))\n    def forward(self, x):\n"
            "        h, _ = self.rnn(x)\n        pooled = torch.cat([h.mean(0), h.std(0)], dim=1)\n"
            "        protos = (self.protos - self.protos.mean(0)) / self.protos.std(0)\n"
            "        return pooled @ protos.t()\nmodel = Pool()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\n    opt.zero_grad()\n"
            "    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    assert not plan(text).left, [x.what for x in plan(text).left]


def test_a_dict_spread_updated_with_one_filled_later_keeps_the_batch_per_process():
    """R9: ``extra = {'shuffle': True}; extra['batch_size'] = 16; train_kwargs.update(extra)`` was read as an update
    without a batch size: 'global_batch_size' beside the update's 'batch_size' stopped the loader at launch."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\nmodel = torch.nn.Linear(4, 2)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain_kwargs = {'batch_size': 8}\n"
            "extra = {'shuffle': True}\nextra['batch_size'] = 16\ntrain_kwargs.update(extra)\n"
            "for x, y in DataLoader(ds, **train_kwargs):\n    opt.zero_grad()\n"
            "    torch.nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    assert "global_batch_size" not in plan(text).text


@pytest.mark.parametrize("made, size", [
    ("config = {'batch_size': 8}", "config['batch_size']"),
    ("B = 8\nconfig = dict(batch_size=B)", "B"),
])
def test_a_settings_dict_the_loader_and_the_model_both_read_keeps_the_batch_per_process(made, size):
    """R7: the loader reading ``config["batch_size"]`` itself (or the dict made by ``dict(batch_size=B)``), the
    model's __init__ sizing a GRU state by ``cfg["batch_size"]``: the batch became global, the first forward failed."""
    text = ("import torch\nfrom torch.utils.data import DataLoader\n" + made + "\n"
            "class Enc(torch.nn.Module):\n    def __init__(self, cfg):\n        super().__init__()\n"
            "        self.b = cfg['batch_size']\n        self.rnn = torch.nn.GRU(4, 4)\n"
            "    def forward(self, x):\n        return self.rnn(x, torch.zeros(1, self.b, 4))[0]\n"
            "model = Enc(config)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            f"for x, y in DataLoader(ds, batch_size={size}, shuffle=True):\n    opt.zero_grad()\n"
            "    model(x).mean().backward()\n    opt.step()\n")
    p = plan(text)
    assert "global_batch_size" not in p.text and any("(Enc(...))" in x.what for x in p.left), p.left
