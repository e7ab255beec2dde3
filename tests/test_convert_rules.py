"""``ddpkit convert``'s decisions one at a time, on small scripts in the shapes public ones have: what becomes
what, and what is refused or left (and why). In process: the converter never runs the script."""
import textwrap

import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = """\
import torch
from torch import nn
from torch.utils.data import DataLoader
"""


def convert(body):
    return plan(HEAD + textwrap.dedent(body))


def lines(result):
    return [line.strip() for line in result.text.splitlines()]


TRAIN_EVAL = """
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(train_set, batch_size=8, shuffle=True)
val_loader = DataLoader(val_set, batch_size=8)

def fit(loader):
    step = 0
    total = 0.0
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        step += 1
        total += loss.item()
    return step, total

def evaluate(loader):
    model.eval()
    correct, seen, batches = 0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            seen += len(y)
            batches += 1
    return correct / seen, batches

for epoch in range(3):
    fit(train_loader)
    evaluate(val_loader)
"""


def test_roles_follow_the_loaders_into_the_functions_that_loop_over_them():
    result = convert(TRAIN_EVAL)
    text = lines(result)
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=8, shuffle=True)" in text
    assert "val_loader = ddpkit.data_loader(val_set, batch_size=8, train=False)" in text
    assert "model = ddpkit.prepare_model(nn.Linear(4, 2))" in text and not result.left


def test_a_training_step_counter_is_never_summed_and_evaluation_counts_are():
    text = lines(convert(TRAIN_EVAL))
    assert not any(t.startswith("step = ddpkit.reduce") for t in text)
    # a sum of the loss's batch means returned whole: averaged over the ranks (each took as many steps), which is
    # the sum one process makes over the global batches (it was left rank 0's before the sixteenth set)
    assert "total = ddpkit.reduce(total, op='mean')" in text
    for name in ("correct", "seen", "batches"):
        assert f"{name} = ddpkit.reduce({name})" in text


def test_a_training_sum_over_the_whole_dataset_is_summed_and_a_mean_over_local_batches_is_not():
    # a sum of batch means over every sample: with the global batch kept, each rank takes as many steps as one
    # process, so the ranks' sums are averaged (summed, it was N times one process's: the eleventh held-out set)
    text = lines(convert(TRAIN_EVAL.replace("    return step, total", "    return total / len(loader.dataset)")))
    assert "total = ddpkit.reduce(total, op='mean')" in text
    # a mean over this rank's batches: every rank took as many, so the ranks' means are averaged (the twelfth
    # session: rank 0's alone was printed before); the step count itself is never reduced
    text = lines(convert(TRAIN_EVAL.replace("    return step, total", "    return total / step")))
    assert "total = ddpkit.reduce(total, op='mean')" in text
    assert not any(t.startswith("step = ddpkit.reduce") for t in text)


def test_x_equals_x_plus_is_a_sum_and_an_index_divisor_leaves_the_evaluation_plain():
    source = TRAIN_EVAL.replace("correct += (model(x)", "correct = correct + (model(x)")
    assert "correct = ddpkit.reduce(correct)" in lines(convert(source))
    source = TRAIN_EVAL.replace("        for x, y in loader:\n            correct", "        for i, (x, y) in "
                                "enumerate(loader):\n            correct").replace("return correct / seen, batches",
                                                                              "return correct / (i + 1), batches")
    result = convert(source)
    assert "val_loader = DataLoader(val_set, batch_size=8)" in lines(result) and not result.refused


def test_a_sum_started_before_an_outer_loop_is_reduced_once_after_it():
    text = convert(TRAIN_EVAL + "sq, n = 0.0, 0\nwith torch.no_grad():\n    for aug in range(3):\n"
                   "        for x, y in val_loader:\n            sq += ((model(x) - y) ** 2).sum().item()\n"
                   "            n += len(y)\nprint(sq / n)\n").text
    tail = text[text.index("for aug in range(3)"):]
    assert tail.count("sq = ddpkit.reduce(sq)") == 1 and tail.index("sq = ddpkit.reduce(sq)") > \
        tail.index("n += len(y)") and "\n    sq = ddpkit.reduce(sq)" in tail  # after the aug loop, in the with


def test_an_evaluation_after_model_eval_without_no_grad_runs_under_no_grad():
    source = TRAIN_EVAL.replace("    with torch.no_grad():\n        for x, y in loader:",
                                "    if True:\n        for x, y in loader:")
    text = convert(source).text
    assert "with torch.no_grad():\n            for x, y in loader:" in text


def test_a_loader_without_shuffle_keeps_torchs_order():
    text = lines(convert(TRAIN_EVAL.replace("batch_size=8, shuffle=True)", "batch_size=8)", 1)))
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=8, shuffle=False)" in text


def test_an_evaluation_that_keeps_per_batch_results_leaves_its_loader_plain():
    source = TRAIN_EVAL.replace("            seen += len(y)\n",
                                "            seen += len(y)\n            preds.append(y)\n")
    result = convert(source)
    assert "val_loader = DataLoader(val_set, batch_size=8)" in lines(result)
    assert not result.left and any("preds" in k.what for k in result.kept), result.kept  # right: kept, exit 0


def test_a_quickstart_test_divides_by_every_ranks_batch_count():
    result = convert("""
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_dl = DataLoader(train_set, batch_size=8, shuffle=True)
        test_dl = DataLoader(test_set, batch_size=8)
        for x, y in train_dl:
            nn.functional.cross_entropy(model(x), y).backward()
        def test(dataloader):
            num_batches = len(dataloader)
            test_loss = 0
            with torch.no_grad():
                for x, y in dataloader:
                    test_loss += nn.functional.cross_entropy(model(x), y).item()
            mean = test_loss / len(dataloader)
            return test_loss / num_batches, mean
        test(test_dl)
    """)
    text = lines(result)
    assert "num_batches = ddpkit.reduce(num_batches)" in text and "test_loss = ddpkit.reduce(test_loss)" in text
    assert "mean = test_loss / ddpkit.reduce(len(dataloader))" in text


@pytest.mark.parametrize("body, why", [
    ("import torch.distributed as dist\ndist.init_process_group('gloo')\n", "already distributed by hand"),
    ("from torch.utils.data import get_worker_info\nget_worker_info()\n", "splits its stream by worker"),
    ("model = nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=1)\nfor x in data:\n"
     "    model(x).sum().backward()\n", "fed by hand"),
    ("model = nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=1)\n"
     "loaders = {k: DataLoader(sets[k], batch_size=2) for k in ('train', 'val')}\n", "inside an expression"),
    ("model = nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=1)\n"
     "ld = DataLoader(ds, batch_sampler=bs)\nfor x in ld:\n    model(x).sum().backward()\n", "batch_sampler"),
    ("model = nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=1)\nld = DataLoader(ds, batch_size=2)\n"
     "for x in ld:\n    trainer.step(x)\n", "neither train"),
    ("def make(m):\n    return torch.optim.SGD(m.parameters(), lr=1)\n",
     "is a parameter of make(), which no line of this file calls"),
    ("opt = torch.optim.SGD(build().parameters(), lr=1)\n", "built inside the optimizer call"),
])
def test_what_would_train_differently_is_refused_and_nothing_changes(body, why):
    result = convert(body)
    assert result.refused and result.text == result.source
    assert any(why in x.what for x in result.left if x.blocks), result.left


def test_the_save_is_guarded_and_waited_for_when_the_file_is_read_back():
    text = lines(convert(TRAIN_EVAL + "torch.save(model.state_dict(), 'm.pt')\n"
                                      "model.load_state_dict(torch.load('m.pt'))\n"))
    at = text.index("torch.save(model.state_dict(), 'm.pt')")
    assert text[at - 1] == "if ddpkit.init().is_main:" and text[at + 1] == "ddpkit.barrier()"
    assert "model.load_state_dict(torch.load('m.pt', map_location=\"cpu\"))" in text


def test_a_save_in_a_branch_read_back_gets_no_barrier_in_the_branch_but_one_before_the_read():
    """The branch may be taken on one rank only: the barrier goes before the read, which every rank reaches;
    a read in a branch of its own is listed."""
    result = convert(TRAIN_EVAL + "if acc > best:\n    torch.save(model.state_dict(), 'best.pt')\n"
                     "model.load_state_dict(torch.load('best.pt'))\n")
    text = lines(result)
    assert text.count("ddpkit.barrier()") == 1 and text[text.index("ddpkit.barrier()") + 1].startswith(
        "model.load_state_dict(torch.load('best.pt'"), result.text
    result = convert(TRAIN_EVAL + "if acc > best:\n    torch.save(model.state_dict(), 'best.pt')\n"
                     "if acc:\n    model.load_state_dict(torch.load('best.pt'))\n")
    assert "ddpkit.barrier()" not in result.text and any("is read at line" in x.what for x in result.left)


def test_a_save_under_each_ranks_temporary_directory_is_not_guarded():
    result = convert(TRAIN_EVAL + "import os, tempfile\nwith tempfile.TemporaryDirectory() as tmp:\n"
                     "    best = os.path.join(tmp, 'best.pt')\n    torch.save(model.state_dict(), best)\n"
                     "    model.load_state_dict(torch.load(best))\n")
    assert "is_main" not in result.text and "ddpkit.barrier()" not in result.text


@pytest.mark.parametrize("main", [False, True])
def test_the_device_setup_becomes_init_before_the_first_print_that_would_start_ddpkit(main):
    """Also under ``if __name__ == "__main__":`` (sixth held-out set: DCGAN's ``print(opt)`` started ddpkit with
    its defaults there, and ``init(cpu=not opt.cuda)`` came too late to keep the CPU)."""
    body = "import argparse\nargs = argparse.ArgumentParser().parse_args()\nprint(args)\n" \
        "device = torch.device('cuda' if args.cuda else 'cpu')\n" + TRAIN_EVAL
    if main:
        body = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in body.splitlines())
    text = lines(convert(body))
    assert text.index("state = ddpkit.init(cpu=not args.cuda)") < text.index("ddpkit.print(args)")
    assert "device = state.device" in text


@pytest.mark.parametrize("expr, args", [
    ('torch.device("cuda" if torch.cuda.is_available() else "cpu")', ""),
    ('"cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"', ""),
    ("torch.device(args.device)", 'cpu=torch.device(args.device).type == "cpu"'),
    ('torch.device("cuda" if not args.no_cuda and torch.cuda.is_available() else "cpu")',
     "cpu=not (not args.no_cuda and torch.cuda.is_available())"),
    ('"cpu"', "cpu=True"),
])
def test_init_keeps_the_scripts_device_choice(expr, args):
    assert f"state = ddpkit.init({args})" in lines(convert(f"device = {expr}\n" + TRAIN_EVAL))


def test_a_script_with_its_own_state_and_print_keeps_them():
    result = convert("state = {'epoch': 0}\ndef print(*a):\n    pass\ndevice = torch.device('cpu')\n"
                     + TRAIN_EVAL + "print(state)\n")
    text = lines(result)
    assert "ddp_state = ddpkit.init(cpu=True)" in text and "print(state)" in text
    assert not any(t.startswith("ddpkit.print") for t in text)


def test_output_goes_to_rank_0():
    result = convert("import logging\nfrom tqdm import tqdm, trange\n"
                     "from torch.utils.tensorboard import SummaryWriter\nlog = logging.getLogger(__name__)\n"
                     "writer = SummaryWriter('runs/x')\nlogging.info('start')\nbar = tqdm(total=10)\n"
                     "for i in trange(3):\n    pass\n" + TRAIN_EVAL.replace("for x, y in loader:\n        opt",
                                                                           "for x, y in tqdm(loader):\n        opt"))
    text = lines(result)
    assert "log = ddpkit.get_logger(__name__)" in text and "writer = ddpkit.summary_writer('runs/x')" in text
    assert "ddpkit.get_logger(\"\").info('start')" in text and "for x, y in ddpkit.progress(loader):" in text
    assert "bar = tqdm(total=10, disable=not ddpkit.init().is_main)" in text and \
        "for i in ddpkit.progress(range(3)):" in text


def test_a_trainer_wraps_its_model_once_where_it_moves_it():
    result = convert("""
        class Trainer:
            def __init__(self, model):
                self.model = model
                self.device = 'cuda' if torch.cuda.is_available() else 'cpu'
                self.model = self.model.to(self.device)
            def run(self, data):
                model = self.model
                opt = model.configure_optimizers()
                loader = DataLoader(data, batch_size=4, shuffle=True)
                it = iter(loader)
                while True:
                    batch = next(it)
                    model(batch).sum().backward()
        Trainer(nn.Linear(2, 2)).run(ds)
    """)
    text = lines(result)
    assert "self.model = ddpkit.prepare_model(self.model)" in text and "model = self.model" in text
    assert "self.device = ddpkit.init().device" in text
    assert "loader = ddpkit.data_loader(data, global_batch_size=4, shuffle=True)" in text


def test_calls_that_need_the_module_get_it_unwrapped():
    text = lines(convert(TRAIN_EVAL + "import copy\nema = copy.deepcopy(model)\nassert isinstance(model, nn.Linear)\n"))
    assert "ema = copy.deepcopy(ddpkit.unwrap(model))" in text
    assert "assert isinstance(ddpkit.unwrap(model), nn.Linear)" in text


# what two reviewers found: each case failed (silently wrong, or a crash) before its fix
def test_a_metric_object_in_an_evaluation_loop_leaves_its_loader_plain():
    source = TRAIN_EVAL.replace("            seen += len(y)\n", "            seen += len(y)\n"
                                "            metric.add_batch(predictions=model(x), references=y)\n")
    assert "val_loader = DataLoader(val_set, batch_size=8)" in lines(convert(source))


@pytest.mark.parametrize("expr, args", [
    ('torch.device("cpu" if args.no_cuda else "cuda")', "cpu=args.no_cuda"),
    ('torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")', ""),
])
def test_device_forms_keep_their_direction(expr, args):
    assert f"state = ddpkit.init({args})" in lines(convert(f"device = {expr}\n" + TRAIN_EVAL))


def test_a_device_chosen_over_several_lines_or_sharing_a_line_is_refused():
    assert convert("device = 'cpu'\nif args.cuda:\n    device = 'cuda'\n" + TRAIN_EVAL).refused
    # (an upgrade when an accelerator exists is init()'s own choice: converted, tests/test_convert_fourteenth.py)
    assert not convert("device = 'cpu'\nif torch.cuda.is_available():\n    device = 'cuda'\n" + TRAIN_EVAL).refused
    assert convert("device = torch.device('cpu'); seed = 0\n" + TRAIN_EVAL).refused


def test_a_device_switch_read_after_a_print_that_starts_ddpkit_is_refused():
    """A user's switch (``--cuda``) read after the print: refused. ``torch.cuda.is_available()`` alone is the
    defaults' choice: converted (x-vector-pytorch, fifteenth set)."""
    result = convert("print('torch', torch.__version__)\nuse_cuda = args.cuda and torch.cuda.is_available()\n"
                     "device = torch.device('cuda' if use_cuda else 'cpu')\n" + TRAIN_EVAL)
    assert result.refused and any("before the device set-up" in x.what for x in result.left)
    assert not convert("print('torch', torch.__version__)\nuse_cuda = torch.cuda.is_available()\n"
                       "device = torch.device('cuda' if use_cuda else 'cpu')\n" + TRAIN_EVAL).refused


def test_positional_loader_arguments_become_keywords():
    text = lines(convert(TRAIN_EVAL.replace("DataLoader(train_set, batch_size=8, shuffle=True)",
                                            "DataLoader(train_set, 8, True)")))
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=8, shuffle=True)" in text


def test_a_comment_after_the_last_argument_and_after_the_device_line_stay():
    source = TRAIN_EVAL.replace("val_loader = DataLoader(val_set, batch_size=8)",
                                "val_loader = DataLoader(\n    val_set,\n    batch_size=8,  # small\n)")
    text = convert("device = torch.device('cpu')  # for now\n" + source).text
    assert "    batch_size=8,  # small\n" in text and "device = state.device  # for now" in text


def test_a_save_sharing_its_line_is_left_and_a_load_defined_above_still_gets_its_barrier():
    result = convert(TRAIN_EVAL + "torch.save(model.state_dict(), 'a.pt'); step = 1\n")
    assert "if ddpkit.init().is_main" not in result.text and any("other statements" in x.what for x in result.left)
    text = lines(convert("def load():\n    return torch.load('a.pt')\n" + TRAIN_EVAL +
                         "torch.save(model.state_dict(), 'a.pt')\nload()\n"))
    assert text[text.index("torch.save(model.state_dict(), 'a.pt')") + 1] == "ddpkit.barrier()"


def test_an_aliased_ddpkit_script_is_not_wrapped_twice_and_a_guarded_save_read_back_is_reported():
    again = plan("import ddpkit as dk\nimport torch\nmodel = dk.prepare_model(torch.nn.Linear(2, 2))\n"
                 "opt = torch.optim.SGD(model.parameters(), lr=1)\n")
    assert again.edits == [] and again.text == again.source
    result = plan("import ddpkit\nimport torch\nstate = ddpkit.init()\nif state.is_main:\n"
                  "    torch.save({}, 'a.pt')\nx = torch.load('a.pt')\n")
    assert any("no barrier" in x.what for x in result.left)


def test_a_training_loader_also_evaluated_trains_and_a_loop_that_does_neither_is_refused_by_line():
    """The training loader evaluated too (``evaluate(train_loader)``) trains, its evaluation's sums reduced once
    (the fourth held-out set: refused before); a loop that neither trains nor evaluates still refuses, naming it."""
    source = TRAIN_EVAL.replace("    evaluate(val_loader)", "    evaluate(val_loader)\n    evaluate(train_loader)")
    result = convert(source)
    assert not result.refused and "train_loader = ddpkit.data_loader(train_set, global_batch_size=8" in result.text
    assert result.text.count("correct = ddpkit.reduce(correct)") == 1, result.text
    result = convert(source + "for x, y in train_loader:\n    print(x.mean())\n")
    assert result.refused and any("trains" in x.what and "neither" in x.what for x in result.left), result.left


def test_print_under_another_name_is_reported():
    assert any("print is imported or renamed" in x.what for x in convert("log = print\n" + TRAIN_EVAL).left)
