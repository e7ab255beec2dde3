"""What the twenty-fifth held-out set and its run-up showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

SELF_LOSS = '''import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)
{held}
    def forward(self, x):
        return self.fc(x)


def fit(model, opt, data, loss_function):
    loader = DataLoader(data, batch_size=64, shuffle=True)
    running_loss, total = 0.0, 0
    for x, y in loader:
        opt.zero_grad()
        loss = {call}(model(x), y)
        loss.backward()
        opt.step()
        running_loss += loss.item()
        total += y.size(0)
    print(f"loss {{running_loss / total:.6f}}")


if __name__ == "__main__":
    ds = TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,)))
    model = Net()
    fit(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, {given})
'''
PROPERTY = "\n    @property\n    def loss_function(self):\n        return nn.functional.cross_entropy\n"
ATTRIBUTE = "        self.loss_function = nn.functional.cross_entropy\n"


@pytest.mark.parametrize("held, call, given", [
    (PROPERTY, "model.loss_function", "None"),
    (ATTRIBUTE, "model.loss_function", "None"),
    (PROPERTY, "loss_function", "model.loss_function"),
])
def test_a_loss_function_kept_by_the_model_is_a_batch_mean(held, call, given):
    """Set 24's c/s05 (a Fashion-MNIST wrapper): the loss function a ``@property`` of the model (or an attribute
    bound to ``F.cross_entropy``), its batch means added up: the ranks' sums were added, the loss printed N x."""
    text = plan(SELF_LOSS.format(held=held, call=call, given=given)).text
    assert "running_loss = ddpkit.reduce(running_loss, op='mean')" in text, text
    assert "total = ddpkit.reduce(total)" in text, text


def test_a_property_of_the_script_that_sums_is_not_taken_for_a_mean():
    held = "\n    @property\n    def loss_function(self):\n        return nn.CrossEntropyLoss(reduction='sum')\n"
    text = plan(SELF_LOSS.format(held=held, call="model.loss_function", given="None")).text
    assert "running_loss = ddpkit.reduce(running_loss)" in text, text


IMPORTED_LOAD = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from helpers import load_model

ds = TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 2, (32,)))
loader = DataLoader(ds, batch_size=8, shuffle=True)
net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 2))
{call}
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
for x, y in loader:
    loss = nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.mark.parametrize("call", ["load_model(net, 'g.pth', 'cpu')", "restore_weights(net, path='g.pth')"])
def test_an_imported_load_helper_below_the_build_comes_before_the_wrap(call):
    """Set 24's extra s02 (a DCGAN lesson): ``load_model(disc, path, device)`` of utils.py loads a checkpoint or, with
    none, draws an init; the wrap stayed at the build, so each rank drew its own and the launch stopped. A load into
    the plain model before the wrap is right either way (no ``module.`` keys, rank 0's weights copied)."""
    text = plan(IMPORTED_LOAD.format(call=call)).text
    assert f"{call}\nnet = ddpkit.prepare_model(net)\nopt = " in text, text


def test_an_imported_load_helper_after_the_optimizer_keeps_the_wrap_at_the_build():
    src = IMPORTED_LOAD.format(call="").replace("lr=1e-3)\n", "lr=1e-3)\nload_model(net, 'g.pth', 'cpu')\n")
    text = plan(src).text
    assert "net = ddpkit.prepare_model(nn.Sequential(" in text, text


def test_a_training_loop_in_the_models_own_class_is_listed():
    """The Keras-like ``model.train_model(opt, data, epochs)`` of a model class whose loop calls ``self(x)``: the
    plain module's forward, outside DDP. Converted with nothing said, the first step stopped every rank."""
    text = SELF_LOSS.format(held=PROPERTY, call="self.loss_function", given="None")
    text = text.replace("def fit(model, opt, data, loss_function):", "    def fit(self, opt, data):")
    body = text[text.index("    def fit(self"):text.index('\n\nif __name__')]
    moved = body.replace("\n    ", "\n        ").replace("model(x)", "self(x)")
    text = text.replace(body, moved).replace("\n\n\n    def fit(self", "\n\n    def fit(self")
    text = text.replace("fit(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, None)",
                        "model.fit(torch.optim.SGD(model.parameters(), lr=0.1), ds)")
    compile(text, "case.py", "exec")
    left = plan(text).left
    assert [x.what[:43] for x in left] == ["the training loop of Net.fit runs the model"], (left, text)
    assert "def fit(model, ...)" in left[0].fix, left
