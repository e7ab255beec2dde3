"""Docs that run: every fenced block of README.md and docs/*.md is run by this test or carries a marker that
says why not. A doc that drifts from the code fails `make test`.

The marker is an HTML comment on the line right above the fence:

- ``<!-- doc-test: run -->``: shell blocks run command by command in a scratch directory where ``train.py`` is
  the README quickstart (built from its diff) and ``examples/`` is the repository's; a trailing comment that
  shows output (``# PASS: ...``, ``# accuracy=...``) is compared. Python blocks run after the harness of the
  same name in HARNESS (``run harness=NAME``), which defines what the snippet assumes.
- ``<!-- doc-test: parse: why -->``: ddpkit commands go through the command's real argument parser (a flag
  that no longer exists fails), but do not run, for the reason given (needs GPUs, another machine, minutes).
- ``<!-- doc-test: skip: why -->``: not run (sample output, a cluster, a make target CI runs anyway).
"""
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import ROOT, ok, run_cmd

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- doc-test: (run(?: harness=(\w+))?|parse: .+|skip: .+) -->$")

QUICKSTART_DATA = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_g = torch.Generator().manual_seed(0)
train_set = TensorDataset(torch.randn(256, 8, generator=_g), torch.randint(0, 3, (256,), generator=_g))
test_set = TensorDataset(torch.randn(61, 8, generator=_g), torch.randint(0, 3, (61,), generator=_g))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    def forward(self, x):
        return self.body(x)
loss_fn = nn.CrossEntropyLoss()
"""

HARNESS = {
    "plain": "",  # a block that is a whole script
    "evaluate": QUICKSTART_DATA + """
import ddpkit
ddpkit.init()
model = ddpkit.prepare_model(Net()).eval()
""",
    "accumulate": QUICKSTART_DATA + """
import argparse, ddpkit
ddpkit.init()
model = ddpkit.prepare_model(Net())
loader = ddpkit.data_loader(train_set, batch_size=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum, args = 4, argparse.Namespace(precision="bf16")
""",
    "control": """
import time, ddpkit
ddpkit.init()
root = "data"
def prepare_data(root):
    pass
def evaluate(epoch):
    return abs(epoch - 5) + 1.0
""",
    "sharding": QUICKSTART_DATA + """
import ddpkit
state = ddpkit.init()
""",
    "checkpoint": QUICKSTART_DATA + """
import ddpkit
ddpkit.init()
model = ddpkit.prepare_model(Net())
loader = ddpkit.data_loader(train_set, batch_size=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)
epochs = 2
""",
}


def blocks(path: Path):
    """(line number, language, marker, text) of every fenced block."""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            yield i + 1, lines[i][3:].strip(), (lines[i - 1] if i else "").strip(), "\n".join(lines[i + 1:end])
            i = end + 1
        else:
            i += 1


ALL = [(path, *block) for path in DOCS for block in blocks(path)]
IDS = [f"{path.name}:{line}" for path, line, *_ in ALL]


def quickstart() -> str:
    """The README quickstart as a script: the harness, then the diff's context and added lines."""
    readme = (ROOT / "README.md").read_text()
    diff = next(text for _, lang, _, text in blocks(ROOT / "README.md") if lang == "diff")
    assert "## Quickstart" in readme
    body = "\n".join(line[1:] for line in diff.split("\n") if line[:1] in (" ", "+"))
    return QUICKSTART_DATA + body + "\n"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    (folder / "train.py").write_text(quickstart())
    (folder / "examples").symlink_to(ROOT / "examples")
    return folder


def commands(text: str):
    """(argv with env assignments split off, claimed output) per command of a shell block."""
    for line in text.replace("\\\n", " ").split("\n"):
        command, _, comment = line.partition("#")
        if command.strip():
            words = shlex.split(command)
            env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
            yield words[len(env):], env, comment.strip()


def executable(argv):
    program = {"ddpkit": [sys.executable, "-m", "ddpkit"], "python": [sys.executable]}
    return program.get(argv[0], [argv[0]]) + argv[1:]


@pytest.mark.parametrize("path, line, lang, marker, text", ALL, ids=IDS)
def test_block(path, line, lang, marker, text, scratch, monkeypatch):
    found = MARKER.match(marker)
    assert found, f"{path.name}:{line}: a fenced block needs a `<!-- doc-test: run|parse: why|skip: why -->` above it"
    kind = found.group(1).split(":")[0].split(" ")[0]
    if kind == "skip":
        return
    if lang == "python":
        assert kind == "run", f"{path.name}:{line}: python blocks run"
        ok(run_cmd([sys.executable, "-c", HARNESS[found.group(2)] + text], cwd=scratch, timeout=120))
        return
    assert lang == "bash", f"{path.name}:{line}: only bash and python blocks can run or parse"
    for argv, env, claim in commands(text):
        if kind == "parse":
            monkeypatch.chdir(scratch)
            parse(argv)
            continue
        r = ok(run_cmd(executable(argv), env=env, cwd=scratch, timeout=240))
        shown = claim.split("(")[0].split("...")[0].strip()
        if re.match(r"^(PASS|FAIL|accuracy|at [\d.]+ [MG]B per rank)", shown):
            assert (r.stdout.strip().splitlines() or [""])[-1].startswith(shown), (argv, r.stdout[-500:])


def parse(argv):
    """Run a ddpkit command's argument parser on the documented flags (nothing starts)."""
    assert argv[0] == "ddpkit", f"parse markers are for ddpkit commands, got {argv}"
    command, rest = argv[1], argv[2:]
    if command == "launch":
        from ddpkit.commands.launch import parse_args

        parse_args(rest, gpus=8, cpus=8, environ={})
    else:
        from ddpkit.commands.cli import COMMANDS

        module = __import__(COMMANDS[command][0], fromlist=["build_parser"])
        module.build_parser().parse_args(rest)


def test_readme_quickstart_passes_verify_at_2_and_3_processes(scratch):
    """Issue 19: verify seeds nothing and pads nothing the one-process run does not see."""
    for nproc in (2, 3):
        r = ok(run_cmd([sys.executable, "-m", "ddpkit", "verify", "--nproc-per-node", str(nproc), "train.py"],
                       cwd=scratch, timeout=240))
        assert r.stdout.startswith(f"PASS: {nproc} processes match 1 process"), r.stdout


# Docs that list the modes come from the table (issue 27): a list of modes is checked against
# ddpkit.strategy.STRATEGIES, so a new mode (or a renamed one) fails here until every list names it.
MODES_MARKER = "<!-- doc-test: modes -->"  # above a paragraph or bullet list that presents the modes
MODE_WORD = r"`?[a-z][a-z0-9_]*`?"
ENUMERATION = re.compile(rf"{MODE_WORD}(?:(?:, |\|| / ){MODE_WORD}){{2,}}")


def mode_enumerations(text: str):
    """Runs of three or more words joined by ``, ``, ``|`` or `` / `` of which two or more are mode names.

    >>> [sorted(found) for found in mode_enumerations("DDPKIT_MODE=dp|ddp|x and `single`, `dp`, `ddp`, ...")]
    [['ddp', 'dp', 'x'], ['ddp', 'dp', 'single']]
    """
    from ddpkit.strategy import STRATEGIES

    for match in ENUMERATION.finditer(text):
        words = {w.strip("`") for w in re.split(r", |\||/", match.group(0).replace(" / ", "/"))}
        if len(words & set(STRATEGIES)) >= 2:
            yield words


def marked_lists(path: Path):
    """(line number, text) of each paragraph or list right under a MODES_MARKER line."""
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.strip() == MODES_MARKER:
            end = next((j for j in range(i + 1, len(lines)) if not lines[j].strip()), len(lines))
            yield i + 2, "\n".join(lines[i + 1:end])


def test_every_list_of_the_modes_names_each_mode_of_the_table_and_no_other():
    from ddpkit.strategy import STRATEGIES

    wrong = [f"{path.name}: {sorted(words)} is not the table's {sorted(STRATEGIES)} (+ auto)"
             for path in DOCS for words in mode_enumerations(path.read_text())
             if words - {"auto"} != set(STRATEGIES)]
    lists = [(path, line, text) for path in DOCS for line, text in marked_lists(path)]
    assert len(lists) >= 3, f"the README and guide.md present the modes under {MODES_MARKER!r}: {lists}"
    for path, line, text in lists:
        missing = [name for name in STRATEGIES if f"`{name}`" not in text]
        bullets = [x for x in text.split("\n") if x.startswith("- ")]
        if bullets:  # a list: one bullet per mode, each with its title (how the start-up line names it)
            missing += [s.title for s in STRATEGIES.values() if s.title not in text]
            missing += [f"{len(STRATEGIES)} bullets, not {len(bullets)}"] * (len(bullets) != len(STRATEGIES))
        if missing:
            wrong.append(f"{path.name}:{line}: the list of modes lacks {missing}")
    assert not wrong, "\n".join(wrong)


def test_the_launch_help_lists_the_modes_of_the_table(capsys):
    from ddpkit.commands.launch import parse_args
    from ddpkit.strategy import STRATEGIES

    with pytest.raises(SystemExit):
        parse_args(["--help"], gpus=0, cpus=2, environ={})
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert all(f"{name} ({s.title}" in shown for name, s in STRATEGIES.items()), shown


def test_the_architecture_map_names_every_module():
    """docs/architecture.md names each module of src/ddpkit in its folder's row (``commands/verify/`` names the
    modules of that folder; ``verify*`` would cover verify_ files), so a module added, moved or renamed without the
    map fails here, and so does a folder without a row."""
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().split("\n"):
        if line.startswith("| `") or line.startswith("| verbs"):
            layer = line.split("|")[1].strip().strip("`").rstrip("/").split(" ")[0]
            rows[layer] = set(re.findall(r"`([\w*]+)(?:\.py)?`", line))
    src = ROOT / "src" / "ddpkit"
    missing = []
    for path in sorted(src.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        layer = path.parent.relative_to(src).as_posix() if path.parent != src else "verbs"  # commands/verify
        names = rows.get(layer, set())
        if path.stem not in names and not any(n.endswith("*") and path.stem.startswith(n[:-1]) for n in names):
            missing.append(f"{layer}/{path.name}")
    assert not missing, f"docs/architecture.md does not name these in their layer's row: {missing}"
