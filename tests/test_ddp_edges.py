"""DDP's edges on real gloo processes: static_graph with a parameter unused by design, and check_sync_every
counting training steps only (evaluation forwards and ddpkit.join's uneven steps add no collective)."""
import json

from conftest import WORKERS, launch, ok


def test_static_graph_unused_parameter_and_sync_checks_on_training_steps_only(tmp_path):
    ok(launch(WORKERS / "ddp_edges.py", tmp_path, timeout=150))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["static_graph_steps"] for r in ranks] == [3, 3]  # 10 samples, global batch 4, padded
    assert [r["eval_batches"] for r in ranks] == [3, 2] == [r["no_grad_batches"] for r in ranks]
    assert [r["join_steps"] for r in ranks] == [3, 2] == [r["torch_join_steps"] for r in ranks]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    for r in ranks:  # the check still runs on training steps: rank 1's changed weight is named on both ranks
        assert r["desync"] and r["desync"].startswith("replicas out of sync at step ")
        assert "rank 1 differs from rank 0" in r["desync"] and "in '0.weight'" in r["desync"], r["desync"]


CONTAINER = '''
import sys
import torch
from torch import nn
import ddpkit

class Pair(nn.Module):  # a GAN held in one container; the loop calls its parts
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, z):
        return self.D(self.G(z))

state = ddpkit.init()
model = ddpkit.prepare_model(Pair())
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
if sys.argv[1] == "eval":  # trained in eval mode (as from_pretrained returns a model): DDP averages all the same
    model.eval()
if sys.argv[1] == "parts":  # a validation forward under no_grad first: it makes no gradient
    with torch.no_grad():
        model(torch.randn(8, 2))
for step in range(3):
    z = torch.randn(8, 2)  # (a per-rank draw: only an all-reduce makes the steps agree)
    out = model.D(model.G(z)) if sys.argv[1] == "parts" else model(z)
    opt.zero_grad()
    out.mean().backward()
    opt.step()
ddpkit.print("done", step)
'''


def test_a_part_of_the_prepared_model_called_directly_stops_the_first_step_with_its_cause(tmp_path):
    script = tmp_path / "container.py"
    script.write_text(CONTAINER)
    r = launch(script, "parts", timeout=120)
    assert r.returncode != 0
    assert "the first optimizer step has gradients in 'G.0.weight'" in r.stderr, r.stderr[-3000:]
    assert "prepare each part the loop calls" in r.stderr and "out of sync" not in r.stderr
    # through the wrapper, in eval mode: no false alarm (review: only train-mode forwards were counted)
    assert "done" in ok(launch(script, "eval", timeout=120)).stdout


RESUMED = '''
import sys
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
import ddpkit

state = ddpkit.init()
model = ddpkit.prepare_model(nn.Linear(4, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
get_optimizer_state_dict(ddpkit.unwrap(model), opt)  # a fresh optimizer's state made by a step over zeros
ckpt = ddpkit.Checkpointer(sys.argv[1], resume=False)
ckpt.save(0, model=model, optimizer=opt)
ckpt.restore(ckpt.latest(), model=model, optimizer=opt)
for step in range(2):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
ddpkit.print("done")
'''


def test_an_optimizer_state_made_before_a_resume_is_no_bypassed_forward(tmp_path):
    """CI: torch.distributed.checkpoint steps a fresh optimizer over zero gradients (its state, before a load):
    the first-step check took that for gradients made outside the prepared model, and every restore failed."""
    script = tmp_path / "resumed.py"
    script.write_text(RESUMED)
    assert "done" in ok(launch(script, tmp_path / "ckpt", timeout=120)).stdout


FLOW = '''
import json, sys
import torch
from torch import nn
import ddpkit

class Flow(nn.Module):  # pytorch-flows: the loss comes from a method, not from forward
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.net(x)

    def log_probs(self, x):
        return -(self(x) ** 2).sum(-1)  # (its own forward inside: the real one)

    def zeros(self, n):
        return torch.zeros(n, 4)

state = ddpkit.init()
model = ddpkit.prepare_model(Flow(), forward_methods=() if sys.argv[2] == "unnamed" else ("log_probs",))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    start = model.zeros(2)  # set-up through a method not named: the plain method
    if state.rank == 0:
        model.zeros(1)  # on one rank only (a review: as a DDP forward, rank 0 waited for a peer that never came)
    with torch.no_grad():
        model.log_probs(torch.randn(2, 4))  # a look under no_grad: the plain method
    x = torch.randn(8, 4)  # (a per-rank draw: only an all-reduce makes the steps agree)
    loss = -model.log_probs(x).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
weights = [round(float(p.sum()), 6) for p in model.parameters()]
open(sys.argv[1] + f"/rank{state.rank}.json", "w").write(json.dumps(weights))
'''


def test_a_loss_from_a_method_named_in_forward_methods_is_averaged_by_ddp(tmp_path):
    """pytorch-flows (tenth held-out set): ``loss = -model.log_probs(x).mean()``, a method of the user's class
    called through the wrapper, ran outside DDP's forward: no gradient was averaged and the first-step check
    stopped the run. Named in ``forward_methods`` it runs as DDP's forward: both ranks step alike; a method not
    named (set-up, one called on rank 0 only) stays the plain method. Unnamed, the stop names the fix."""
    script = tmp_path / "flow.py"
    script.write_text(FLOW)
    ok(launch(script, str(tmp_path), "named", timeout=120))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], ranks
    r = launch(script, str(tmp_path), "unnamed", timeout=120)
    assert r.returncode != 0 and "forward_methods=('log_probs',)" in r.stderr, r.stderr[-2000:]


def test_forward_methods_must_name_methods_of_the_models_class():
    import pytest
    import torch

    from ddpkit.strategies.redirect import validate

    assert validate(torch.nn.Linear(2, 2), ()) == frozenset()
    for bad in ("log_prob", "parameters", "forward"):
        with pytest.raises(ValueError, match=f"forward_methods=...\\): '{bad}' is not a method of your Linear"):
            validate(torch.nn.Linear(2, 2), (bad,))


NESTED = '''import torch
from torch import nn
import ddpkit


class Base:
    def __init__(self):
        self.model = ddpkit.prepare_model(nn.Linear(4, 4))


class WithHead(Base):
    def __init__(self):
        super().__init__()
        self.model = ddpkit.prepare_model(nn.Sequential(self.model, nn.Linear(4, 1)))


WithHead()
print("prepared twice")
'''


def test_a_model_that_holds_a_prepared_part_is_prepared_once_as_a_whole(tmp_path):
    """A base class prepares ``self.model`` and a subclass prepares ``nn.Sequential(self.model, head)`` again (also:
    a backbone trained alone, then a model built around it): two DDP wrappers nested, the inner part all-reduced
    twice and its weights named ``0.module.weight``. The inner part's plain module is put back, with a warning, and
    the whole is prepared once: its state dict names match one process's."""
    script = tmp_path / "nested.py"
    script.write_text(NESTED.replace('WithHead()\nprint("prepared twice")\n',
                                     'm = WithHead().model\nprint(sorted(m.state_dict()))\n'))
    r = launch(script, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "['0.bias', '0.weight', '1.bias', '1.weight']" in r.stdout, r.stdout
    assert "the model holds '0', prepared already" in r.stderr, r.stderr[-2000:]
