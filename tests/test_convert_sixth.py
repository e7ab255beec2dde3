"""What the sixth held-out set (docs/convert.md) left silently wrong in a converted script's own numbers, each a
case that printed N times off at 2 processes before its fix: a step count from ``loader.batch_size`` after the
rewrite to ``global_batch_size=``, and a training accuracy over ``len(loader) * batch_size``. In process, on small
scripts in the shapes those scripts have; one real 2-process launch prints what a user reads."""
import textwrap

import pytest

pytest.importorskip("libcst")

from conftest import launch, ok  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
"""

STEPS = HEAD + """
loader = DataLoader(dataset, batch_size=16, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
for x, y in loader:
    step += 1
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("%d/%d" % (step, (len(loader.dataset) - 1) // loader.batch_size + 1))
"""


def test_a_step_count_from_the_loaders_batch_size_reads_the_global_batch_at_two_processes(tmp_path):
    result = plan(STEPS)
    assert "(len(loader.dataset) - 1) // 16 + 1" in result.text, result.text
    assert any(e.what == "loader.batch_size -> 16" for e in result.edits)
    script = tmp_path / "steps.py"
    script.write_text(result.text)
    out = ok(launch(script)).stdout
    # as one process: 4 steps of the global 16 (each rank 8 of its 32); loader.batch_size (8) made it x/8
    assert out.split() == ["1/4", "2/4", "3/4", "4/4"], out


@pytest.mark.parametrize("use", ["model(x) + torch.zeros(loader.batch_size, 2)",
                                 "model(x) if x.size(0) == loader.batch_size else model(x)"])
def test_a_loaders_batch_size_in_the_training_step_stays_this_ranks_as_the_batch_is(use):
    result = plan(STEPS.replace("model(x)", use))
    assert "ddpkit.data_loader(dataset, global_batch_size=16, shuffle=True)" in result.text, result.text
    assert use in result.text and not result.left, result.left  # the attribute and the batch: both this rank's


def test_a_loaders_batch_size_read_where_the_global_batch_cannot_be_named_is_listed():
    source = HEAD + textwrap.dedent("""
    def fit(model, opt, loader):
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(step, len(loader.dataset) // loader.batch_size)


    def main(bs):
        model = nn.Linear(8, 2)
        fit(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(dataset, batch_size=bs, shuffle=True))
    """)
    source = source.replace("fit(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(",
                            "loader = DataLoader(").replace("shuffle=True))", "shuffle=True)\n    fit(model, "
                                                            "torch.optim.SGD(model.parameters(), lr=0.1), loader)")
    result = plan(source + "\nmain(16)\n")
    assert "global_batch_size=bs" in result.text, result.text
    said = [left for left in result.left if "loader.batch_size is each process's share" in left.what]
    assert said and "read the global batch there (bs as it was at line" in said[0].fix, result.left


ACCURACY = HEAD + """
batch_size = 16
loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
correct = 0
for x, y in loader:
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    correct += (out.argmax(1) == y).sum().item()
print(correct / (len(loader) * batch_size))
"""


def test_a_training_accuracy_over_len_loader_times_the_batch_is_reduced_with_the_global_batch_only():
    result = plan(ACCURACY)
    assert "correct = ddpkit.reduce(correct)" in result.text, result.text
    assert "(len(loader) * batch_size)" in result.text  # this rank's batches x the global batch: every sample
    kept = plan(ACCURACY, per_process_batch=True)  # this rank's batches x its own batch: its samples, its accuracy
    assert "ddpkit.reduce(correct)" not in kept.text, kept.text


GROUPS = HEAD + """
loader = DataLoader(dataset, batch_size=16, shuffle=True)
model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
head = nn.Linear(2, 2)
{groups}
for x, y in loader:
    loss = nn.functional.cross_entropy(head(model(x)), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("groups", [
    # weight-decay groups filled by a loop (either list picked per parameter), beside another model's parameters
    "decay, no_decay = [], []\nfor n, p in model.named_parameters():\n"
    "    (no_decay if n.endswith('bias') else decay).append(p)\n"
    "opt = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.01}, {'params': no_decay, 'weight_decay': 0.0},"
    " {'params': head.parameters()}])",
    # one group per parameter, appended to a list the optimizer takes
    "groups = [{'params': head.parameters()}]\nfor n, p in model.named_parameters():\n"
    "    groups.append({'params': [p], 'weight_decay': 0.0 if 'bias' in n else 0.01})\n"
    "opt = torch.optim.AdamW(groups)",
])
def test_parameter_groups_filled_by_a_loop_prepare_every_model_they_train(groups):
    result = plan(GROUPS.format(groups=groups))
    assert "model = ddpkit.prepare_model(nn.Sequential(" in result.text, result.text
    assert "head = ddpkit.prepare_model(nn.Linear(2, 2))" in result.text, result.text


TARGET = HEAD + """
def make_net():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


loader = DataLoader(dataset, batch_size=16, shuffle=True)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
online = make_net().to(device)
{target}
opt = torch.optim.SGD(online.parameters(), lr=0.1)
for x, _ in loader:
    with torch.no_grad():
        t = target(x + 0.1)
    loss = ((online(x - 0.1) - t) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for po, pt in zip(online.parameters(), target.parameters()):
            pt.mul_(0.99).add_(po, alpha=0.01)
"""


@pytest.mark.parametrize("target", [
    "target = make_net().to(device)\nfor po, pt in zip(online.parameters(), target.parameters()):\n"
    "    pt.data.copy_(po.data)\n    pt.requires_grad = False",
    "target = make_net().to(device)\ntarget.load_state_dict(online.state_dict())",
])
def test_a_moving_average_target_built_on_its_own_is_prepared_frozen(target):
    result = plan(TARGET.format(target=target))
    assert "target = ddpkit.prepare_model(make_net().requires_grad_(False))" in result.text, result.text
    assert "online = ddpkit.prepare_model(make_net())" in result.text, result.text


def test_a_target_copied_from_the_online_model_or_trained_by_an_optimizer_is_not_frozen():
    copied = plan(TARGET.format(target="import copy\ntarget = copy.deepcopy(online)"))
    assert "requires_grad_(False)" not in copied.text, copied.text
    trained = plan(TARGET.format(target="target = make_net().to(device)").replace(
        "SGD(online.parameters()", "SGD(list(online.parameters()) + list(target.parameters())"))
    assert "requires_grad_(False)" not in trained.text and "target = ddpkit.prepare_model(make_net())" in trained.text


LAYER = """
import torch
from torch import nn


class Layer(nn.Module):  # a layer that trains itself in forward (a stacked autoencoder's)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)

    def forward(self, x):
        return self.lin(x)


def fit_epoch(model, loader, opt):  # a helper over the script's own optimizer
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
"""

PROBE = HEAD + """
from layers import {name}
loader = DataLoader(dataset, batch_size=16, shuffle=True)
probe = nn.Linear(8, 2)
opt = torch.optim.SGD(probe.parameters(), lr=0.1)
{loop}
"""


def test_a_script_converted_alone_while_a_module_beside_it_builds_its_own_optimizer_is_listed(tmp_path, capsys):
    from ddpkit.commands.convert.command import main

    (tmp_path / "layers.py").write_text(LAYER)
    script = tmp_path / "run.py"
    script.write_text(PROBE.format(name="Layer", loop="ae = Layer()\nfor x, y in loader:\n    opt.zero_grad()\n"
                                   "    nn.functional.cross_entropy(probe(ae(x)), y).backward()\n    opt.step()"))
    assert main(["-o", str(tmp_path / "out.py"), str(script)]) == 1
    err = capsys.readouterr().err
    assert "left to you: layers.py:10 (imported from the script's folder) builds an optimizer (SGD)" in err
    assert f"ddpkit convert --imports {script}" in err, err
    (tmp_path / "layers.py").write_text(LAYER.replace("        self.opt = torch.optim.SGD(self.parameters(), "
                                                      "lr=0.1)\n", ""))
    script.write_text(PROBE.format(name="fit_epoch", loop="fit_epoch(probe, loader, opt)"))
    assert main(["-o", str(tmp_path / "out.py"), str(script)]) == 0, capsys.readouterr().err


TRIALS = HEAD + """
import numpy as np
loader = DataLoader(dataset, batch_size=16, shuffle=True)
test_loader = DataLoader(dataset, batch_size=4, shuffle=False)  # one batch: one 4-way trial
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
right = 0
with torch.no_grad():
    for x, y in test_loader:
        out = model(x)[:, 1].numpy()
        right += int({pick} == 0)
print(right / len(test_loader))
"""


@pytest.mark.parametrize("pick", ["np.argmax(out)", "torch.from_numpy(out).argmax()", "np.argmax(out, axis=0)"])
def test_an_evaluation_whose_batch_is_one_trial_keeps_its_loader_whole(pick):
    result = plan(TRIALS.format(pick=pick))
    assert "test_loader = DataLoader(dataset, batch_size=4, shuffle=False)" in result.text, result.text
    assert any("over each whole batch (a batch is one unit" in kept.what for kept in result.kept), result.kept


def test_an_argmax_per_sample_still_shards_the_evaluation():
    result = plan(TRIALS.format(pick="model(x).argmax(1)[0]"))
    assert "test_loader = ddpkit.data_loader(dataset, batch_size=4, shuffle=False, train=False)" in result.text, \
        result.text


def test_hugging_faces_own_adamw_over_weight_decay_groups_prepares_the_model():
    groups = ("from transformers import AdamW\nnamed = list(model.named_parameters())\n"
              "opt = AdamW([{'params': [p for n, p in named if 'bias' not in n], 'weight_decay': 0.01},\n"
              "             {'params': [p for n, p in named if 'bias' in n], 'weight_decay': 0.0}], lr=3e-5)")
    result = plan(GROUPS.replace("head = nn.Linear(2, 2)\n", "").replace("head(model(x))", "model(x)")
                  .format(groups=groups))
    assert "model = ddpkit.prepare_model(nn.Sequential(" in result.text, result.text


def test_a_peer_trained_through_add_param_group_is_prepared_not_frozen():
    result = plan(TARGET.format(target="target = make_net().to(device)\ntarget.load_state_dict(online.state_dict())")
                  .replace("for x, _ in loader:", "opt.add_param_group({'params': target.parameters()})\n"
                                                  "for x, _ in loader:"))
    assert "requires_grad_(False)" not in result.text and "target = ddpkit.prepare_model(target)" in result.text, \
        result.text


def test_a_copy_loaded_for_an_export_after_training_is_left_as_it_is():
    export = "\nexport = make_net()\nexport.load_state_dict(online.state_dict())\nexport.eval()\n"
    result = plan(TARGET.format(target="target = copy.deepcopy(online)").replace("import torch\n", "import copy\n"
                                                                                "import torch\n", 1) + export)
    assert "export = make_net()" in result.text, result.text


# the review of the change above: each a case it converted wrong (a crash, a number N times off) or listed for nothing
LOOP8 = HEAD + """
train_loader = DataLoader(dataset, batch_size=8, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
total, correct = 0.0, 0
for i, (x, y) in enumerate(train_loader):
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.item()
    correct += (out.argmax(1) == y).sum().item()
"""


def test_review_a_global_batch_in_an_f_string_takes_the_other_quotes_and_the_script_compiles():
    source = LOOP8.replace("batch_size=8", 'batch_size=config["batch_size"]').replace(
        "train_loader = DataLoader", 'config = {"batch_size": 8}\ntrain_loader = DataLoader') + \
        '    print(f"[{(i + 1) * train_loader.batch_size}/{len(train_loader.dataset)}]")\n'
    result = plan(source)
    assert "(i + 1) * config['batch_size']" in result.text, result.text
    compile(result.text, "converted.py", "exec")  # (before Python 3.12 a " inside f"..." ends it)


@pytest.mark.parametrize("after, kept", [
    # a loader rebound to another (predictions in order): its batch_size is its own
    ("train_loader = DataLoader(dataset, batch_size=16)\nprint(len(dataset) // train_loader.batch_size)\n", None),
    # the name of the global batch means another value there: listed, not pasted
    ("batch_size = 3\nprint(len(dataset) // train_loader.batch_size)\n", "as it was at line"),
])
def test_review_a_loaders_batch_size_is_the_global_batch_only_where_it_still_means_it(after, kept):
    result = plan(LOOP8.replace("batch_size=8", "batch_size=batch_size").replace(
        "train_loader = DataLoader", "batch_size = 8\ntrain_loader = DataLoader") + after)
    assert "print(len(dataset) // train_loader.batch_size)" in result.text, result.text
    assert (kept is None) == (not result.left) and all(kept in left.fix for left in result.left), result.left


@pytest.mark.parametrize("line, reduced", [
    # a mean of batch means beside a dataset-size read: the mean averaged (every rank took len(train_loader) steps:
    # the count stays; fourteenth set), the sum summed
    ("print(total / len(train_loader), correct / len(train_loader.dataset))",
     "total = ddpkit.reduce(total, op='mean')"),
    # this rank's batches x the loader's own (per-rank) batch: this rank's samples, its ratio
    ("print(correct / (len(train_loader) * train_loader.batch_size))", None),
    # the dataset divided by the batch: a count of batches (the global batch's: one process's count)
    ("print(total / (len(train_loader.dataset) / train_loader.batch_size))", None),
    # len(loader) times something other than the batch: no size
    ("print(total / (len(train_loader) * 2))", None),
])
def test_review_training_sums_are_reduced_only_over_every_samples_count(line, reduced):
    result = plan(LOOP8 + line + "\n")
    assert ("ddpkit.reduce(total)" in result.text or "ddpkit.reduce(correct)" in result.text) == bool(reduced), \
        result.text
    assert reduced is None or reduced in result.text, result.text


def test_review_an_evaluation_over_the_training_loader_keeps_its_batch_size_per_rank():
    result = plan(LOOP8 + "hits = 0\nwith torch.no_grad():\n    for x, y in train_loader:\n"
                  "        hits += (model(x).argmax(1) == y).sum().item()\n"
                  "print(hits / (len(train_loader) * train_loader.batch_size))\n")
    assert "hits / (ddpkit.reduce(len(train_loader)) * train_loader.batch_size)" in result.text, result.text


@pytest.mark.parametrize("pick, test_batch", [("out[0].argmax()", "4"), ("np.argmax(out)", "1")])
def test_review_an_argmax_of_one_sample_shards_the_evaluation(pick, test_batch):
    result = plan(TRIALS.replace("batch_size=4", f"batch_size={test_batch}").format(pick=pick))
    assert "test_loader = ddpkit.data_loader(" in result.text and not result.left, result.left


def test_review_a_module_that_only_builds_the_scripts_optimizer_is_no_training_elsewhere(tmp_path, capsys):
    from ddpkit.commands.convert.command import main

    (tmp_path / "layers.py").write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Linear):\n"
                                        "    def configure_optimizers(self):\n"
                                        "        return torch.optim.AdamW(self.parameters())\n")
    script = tmp_path / "run.py"
    script.write_text(HEAD + "from layers import Net\nloader = DataLoader(dataset, batch_size=16, shuffle=True)\n"
                      "model = Net(8, 2)\nopt = model.configure_optimizers()\nfor x, y in loader:\n"
                      "    opt.zero_grad()\n    nn.functional.cross_entropy(model(x), y).backward()\n    opt.step()\n")
    assert main(["-o", str(tmp_path / "out.py"), str(script)]) == 0, capsys.readouterr().err
