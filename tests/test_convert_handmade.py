"""A script distributed by hand in the way of Hugging Face's 2019-2021 examples (a ``--local_rank`` argument, -1
by default, every distributed line under a test of it): converted from its single-device path (local_rank -1), not
refused as "already distributed by hand"; the lines said are the script's own; the result runs and verifies."""
import sys

import pytest

pytest.importorskip("libcst")

from conftest import run_cmd  # noqa: E402
from ddpkit.commands.convert.handmade import single_device  # noqa: E402
from ddpkit.commands.convert.plan import plan  # noqa: E402

GLUE = '''import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--no_cuda", action="store_true")
parser.add_argument("--per_gpu_train_batch_size", type=int, default=8)
args = parser.parse_args()

if args.local_rank == -1 or args.no_cuda:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu")
    args.n_gpu = torch.cuda.device_count()
else:
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    torch.distributed.init_process_group(backend="nccl")
    args.n_gpu = 1
if args.local_rank not in [-1, 0]:
    torch.distributed.barrier()  # the first process downloads the model
torch.manual_seed(0)
model = nn.Linear(8, 2)
if args.local_rank == 0:
    torch.distributed.barrier()
model.to(device)
g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
args.train_batch_size = args.per_gpu_train_batch_size * max(1, args.n_gpu)
train_sampler = RandomSampler(ds) if args.local_rank == -1 else DistributedSampler(ds)
loader = DataLoader(ds, sampler=train_sampler, batch_size=args.train_batch_size)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
if args.n_gpu > 1:
    model = torch.nn.DataParallel(model)
if args.local_rank != -1:
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
for epoch in range(2):
    for step, batch in enumerate(loader):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        model.zero_grad()
    if args.local_rank in [-1, 0]:
        print("epoch", epoch, loss.item())
        torch.save(model.state_dict(), "model.bin")
'''


def test_a_local_rank_script_converts_from_its_single_device_path_with_its_own_line_numbers():
    done = plan(GLUE)
    assert not done.refused, [x.what for x in done.left]
    for gone in ("init_process_group", "DistributedDataParallel(", "DistributedSampler(ds)", "barrier()",
                 "local_rank in"):
        assert gone not in done.text, gone
    assert "model = ddpkit.prepare_model(model)" in done.text and "train_sampler = RandomSampler(ds)\n" in done.text
    said = {e.line: e.what for e in done.edits}
    assert said[13].startswith("the hand-written distribution taken out")  # the script's own `if` line
    assert said[45] == "print -> ddpkit.print" and said[46].startswith("torch.save guarded")
    again = plan(done.text)  # a second convert of its own output: nothing new
    assert again.text == done.text and not again.left


@pytest.mark.parametrize("source", [
    "import torch\nif args.local_rank == -1:\n    x = 1\ntorch.distributed.barrier()\n",  # live: not the idiom
    "import torch.distributed as dist\nif args.local_rank in 0:\n    dist.barrier()\n",  # not a test it can decide
    "import torch\nif args.rank == -1:\n    torch.distributed.barrier()\n",  # no local_rank
    "import torch\np.add_argument('--local_rank', type=int, default=0)\nif args.local_rank != -1:\n"
    "    torch.distributed.barrier()\n",  # its own run is distributed: no single-device path to take
    "import torch\np.add_argument('--local-rank', type=int)\nif args.local_rank != -1:\n"
    "    torch.distributed.barrier()\n",
])
def test_a_script_whose_distribution_is_not_all_under_local_rank_is_left_to_the_refusal(source):
    assert single_device(source) is None


def test_elif_chains_conditional_expressions_and_emptied_blocks():
    source = "import torch\ndef setup(args):\n    if args.local_rank != -1:\n        torch.distributed.barrier()\n" \
        "x = 1 if args.local_rank == -1 else torch.distributed.get_world_size()\n" \
        "if args.fp16:\n    y = 1\nelif args.local_rank != -1:\n    y = 2\nelse:\n    y = 3\n"
    assert single_device(source) == "import torch\ndef setup(args):\n    pass\nx = 1\n" \
        "if args.fp16:\n    y = 1\nelse:\n    y = 3\n"


def test_the_converted_local_rank_script_verifies(tmp_path):
    script = tmp_path / "glue.py"
    script.write_text(plan(GLUE).text)
    verify = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc", "2", "--steps", "4", str(script)],
                     timeout=300, cwd=tmp_path)
    assert verify.returncode == 0 and "PASS: 2 processes" in verify.stdout, verify.stdout + verify.stderr[-2000:]


def test_review_lines_in_the_texts_and_a_decided_expression_are_the_scripts_own_and_a_dist_variable_is_no_call():
    """Review: the loader line, rewritten by a decided conditional expression, was said one line above; "the
    optimizer at line N" kept the single-device version's N; a variable named ``dist`` refused the script."""
    source = GLUE.replace("model.to(device)\n", "").replace("loader = DataLoader(ds, sampler=train_sampler, "
                                                            "batch_size=args.train_batch_size)\n", "")
    source = source.replace("train_sampler = RandomSampler(ds) if args.local_rank == -1 else DistributedSampler(ds)",
                            "loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds) if args.local_rank == -1 "
                            "else DistributedSampler(ds))")
    lines = source.splitlines()
    loader = next(n for n, line in enumerate(lines, 1) if line.startswith("loader = "))
    optimizer = next(n for n, line in enumerate(lines, 1) if line.startswith("opt = "))
    done = plan(source)
    assert any(e.line == loader and e.what.startswith("DataLoader -> ddpkit.data_loader") for e in done.edits), \
        [(e.line, e.what) for e in done.edits]
    prepared = next(e for e in done.edits if "prepare_model" in e.what)
    assert f"the optimizer at line {optimizer} trains" in prepared.why, (optimizer, prepared.why)
    cdist = GLUE.replace("model.zero_grad()\n", "model.zero_grad()\n        dist = torch.cdist(batch[0], batch[0])\n"
                         "        dist.mean()\n")
    assert not plan(cdist).refused
