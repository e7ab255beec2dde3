"""Review 43 (a reviewer on the fixes after review 42, /work/review43_out): each defect it reproduced, in our own
words, failing on the tree it reviewed (38dd4a6)."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.crossing import settle  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402
from ddpkit.commands.convert.project import files_of  # noqa: E402

HEAD = "import os, sys\nimport torch, torch.nn as nn\nfrom torch.utils.data import DataLoader, TensorDataset\n"
STEP = '''loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 8)), batch_size=16, shuffle=True)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
'''


def _project(files):
    return settle(list(files), lambda rel, c: plan(files[rel], crossing=c))


def test_the_parts_of_a_list_of_models_are_refused_not_the_list_prepared():
    """D01: ``nets = [G, D]`` trained through ``nets[0].parameters()`` became ``prepare_model([G, D])`` (exit 0, an
    AttributeError at launch)."""
    src = HEAD + STEP + "G, D = nn.Linear(8, 8), nn.Linear(8, 1)\nnets = [G, D]\n" \
        "opt_g = torch.optim.Adam(nets[0].parameters())\nfor x, y in loader:\n    opt_g.zero_grad()\n" \
        "    D(nets[0](x)).mean().backward()\n    opt_g.step()\n"
    p = plan(src)
    assert "prepare_model([" not in p.text and any("a collection of models" in x.what for x in p.left)


def test_a_save_each_epoch_of_a_range_loop_another_module_may_load_is_waited_for():
    """D02: the save in ``for epoch in range(3)`` (no test, nothing skipping it) lost its barrier after review 42's
    fix; evaluate.py's load may read it half-written."""
    train = HEAD + "\n\ndef train():\n" + "".join("    " + line + "\n" for line in STEP.splitlines()) + \
        "    for epoch in range(3):\n        for x, y in loader:\n            opt.zero_grad()\n" \
        "            nn.functional.mse_loss(model(x), y).backward()\n            opt.step()\n" \
        "        torch.save(model.state_dict(), 'model.pt')\n"
    files = {"main.py": "import train_part\nimport evaluate\n\ntrain_part.train()\nevaluate.evaluate()\n",
             "evaluate.py": "import torch\n\n\ndef evaluate():\n    return torch.load('model.pt')\n",
             "train_part.py": train}
    text = _project(files)["train_part.py"].text
    assert "torch.save(model.state_dict(), 'model.pt')\n        ddpkit.barrier()" in text, text


SUMMED_HELPER = HEAD + '''

def loss_function(recon, x):
    return nn.functional.mse_loss(recon, x, reduction="sum")


''' + STEP + '''for epoch in range(2):
    for x, y in loader:
        loss = loss_function(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(loss.item())
'''


def test_a_loss_a_summing_helper_returns_is_said_a_sum_where_shown():
    """D03: ``loss = loss_function(recon, x)`` of a helper returning ``reduction="sum"`` was shown as "a mean ...
    the same quantity ... op='mean'" beside the line that says the loss is a sum."""
    why = [k.why for k in plan(SUMMED_HELPER).kept if "shows loss" in k.what]
    assert why and "a sum over its 1/N" in why[0], why


def test_an_unused_self_training_class_that_calls_super_by_its_name_is_still_unused():
    """D04: ``super(OldNet, self).__init__()`` named the class a second time: taken as used, the project refused."""
    mod = ("import torch, torch.nn as nn\n\n\nclass OldNet(nn.Module):\n    def __init__(self):\n"
           "        super(OldNet, self).__init__()\n        self.fc = nn.Linear(4, 3)\n"
           "        self.optimizer = torch.optim.SGD(self.parameters(), lr=0.1)\n\n"
           "    def train_(self, x):\n        self.optimizer.zero_grad()\n        self.fc(x).sum().backward()\n"
           "        self.optimizer.step()\n")
    main = HEAD + "import mod\n" + STEP + "for x, y in loader:\n    opt.zero_grad()\n" \
        "    nn.functional.mse_loss(model(x), y).backward()\n    opt.step()\n"
    done = _project({"mod.py": mod, "main.py": main})
    assert not done["mod.py"].left, [x.what for x in done["mod.py"].left]


def test_a_sum_of_a_none_reduction_criterion_named_like_a_loss_is_a_summed_loss():
    """D05: ``mse_loss = nn.MSELoss(reduction='none')`` then ``mse_loss(out, y).sum()`` was taken for a sum of
    means (the name ends in "loss"): the running total averaged, 1/N of the original's."""
    src = HEAD + STEP + '''mse_loss = nn.MSELoss(reduction="none")
for epoch in range(2):
    train_loss, num_iter = 0.0, 0
    for x, y in loader:
        num_iter += 1
        opt.zero_grad()
        loss = mse_loss(model(x), y).sum()
        loss.backward()
        opt.step()
        train_loss += loss.item()
    print(train_loss / num_iter)
'''
    assert "    train_loss = ddpkit.reduce(train_loss)\n" in plan(src).text


def test_a_token_criterion_a_validation_loop_without_no_grad_calls_is_no_training_loss():
    """D06: a criterion called only in a validation loop with no backward and no ``no_grad`` (``model.eval()``)
    was listed as a training loss, its fix reweighing a training loss that ignores no tokens."""
    src = HEAD + '''x = torch.randint(1, 20, (64, 6))
train_loader = DataLoader(TensorDataset(x, x.clone()), batch_size=16, shuffle=True)
val_loader = DataLoader(TensorDataset(x, x.clone()), batch_size=16)
net = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss(ignore_index=0)
for epoch in range(2):
    for src, tgt in train_loader:
        opt.zero_grad()
        nn.functional.cross_entropy(net(src).view(-1, 20), tgt.view(-1)).backward()
        opt.step()
    net.eval()
    total = 0.0
    for src, tgt in val_loader:
        total += criterion(net(src).view(-1, 20), tgt.view(-1)).item()
    print(total)
'''
    assert not any("tokens it does not ignore" in x.what for x in plan(src).left)


def test_a_dual_mode_entry_that_imports_a_sibling_by_name_keeps_its_folder_as_root(tmp_path):
    """D08: ``try: from .data import ... except ImportError: from data import ...`` and ``import utils``: the root
    moved above the package, and utils.py was neither converted nor copied."""
    (tmp_path / "src").mkdir()
    for name, text in {"__init__.py": "", "data.py": "", "utils.py": "",
                       "train.py": "try:\n    from .data import x\nexcept ImportError:\n    from data import x\n"
                                   "import utils\n"}.items():
        (tmp_path / "src" / name).write_text(text)
    root, files = files_of(str(tmp_path / "src" / "train.py"), imports=True)
    assert root == str(tmp_path / "src") and "utils.py" in files, (root, files)


MKDIR = HEAD + '''log_dir = "runs/a"
{made}
''' + STEP + '''for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
'''


def test_a_refusing_handler_that_builds_its_message_first_is_still_a_refusal():
    """D09: ``except FileExistsError: msg = ...; sys.exit(msg)`` was listed as a handler that "sets names the
    script reads" and the mkdir made exist_ok=True (the refusal dropped)."""
    made = "try:\n    os.mkdir(log_dir)\nexcept FileExistsError:\n    msg = 'exists: ' + log_dir\n    sys.exit(msg)"
    p = plan(MKDIR.format(made=made))
    assert "exist_ok" not in p.text and "ddpkit.barrier()" in p.text and not p.left, [x.what for x in p.left]


def test_a_try_made_folder_in_a_helper_called_under_an_exists_test_gets_no_barrier():
    """D11: the helper's try was made rank 0's with a barrier inside it, called under ``if not
    os.path.exists(d):`` (a rank that tests after rank 0 made it skips the barrier: a desync)."""
    made = ("def make(d):\n    try:\n        os.mkdir(d)\n    except FileExistsError:\n        sys.exit(1)\n\n\n"
            "if not os.path.exists(log_dir):\n    make(log_dir)")
    assert "barrier" not in plan(MKDIR.format(made=made)).text
