"""``ddpkit check script.py``: find the usual DP/DDP mistakes in a training script before it runs.

Static analysis with :mod:`ast` of any PyTorch script (ddpkit or not). Each finding has a severity (error:
a hang, a crash or a wrong result; warning: wrong beyond one node, or wasteful; advice), a line, a rule id,
what is wrong, why it matters and the fix. Exit 1 when an error is found (``--strict``: any finding), 0
otherwise, 2 on bad input: a path that does not exist, or a file that is not Python 3 (reported as one
``not analysed`` line; the other files are still checked). A script that imports ddpkit is checked as a
multi-process one, as is one that uses torch.distributed. The rules' decisions over the syntax tree live
in :mod:`ddpkit.commands.check.syntax` (calls, rank conditions) and :mod:`ddpkit.commands.check.metrics`
(evaluation metrics).

Example::

    $ ddpkit check train.py
    warning: train.py:42 DDP001 DistributedSampler without set_epoch: ... Fix: call sampler.set_epoch(epoch) ...
    $ ddpkit check --json train.py
    {"findings": [{"path": "train.py", "line": 42, "rule": "DDP001", "severity": "warning", ...}], "not_analysed": []}
    $ ddpkit check src/ scripts/train.py          # several files and directories, as linters take them
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import stat
import sys
import tokenize
from collections.abc import Iterator, Sequence

from ddpkit.commands.check.metrics import eval_sampler, metric_findings
from ddpkit.commands.check.rules import (
    BATCHNORMS,
    COLLECTIVES,
    OPTIMIZERS,
    RANK_WORDS,
    RULES,
    SEVERITY,
    SHARDING,
    Finding,
)
from ddpkit.commands.check.rules import finding as _finding
from ddpkit.commands.check.syntax import Visitor, aliases, kw, last, memory_buffers, name, resolved, uses_ddpkit
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.core.errors import SCRIPT_FAILED, USAGE_ERROR, UsageError

PROG = "ddpkit check"
__all__ = ["RULES", "SEVERITY", "Finding", "analyze", "main", "memory_buffers", "scripts"]


def _per_rank_path(call: ast.Call) -> bool:
    """torch.save(obj, f"out/rank{rank}.pt"): each rank writes its own file, which is fine."""
    return len(call.args) > 1 and "rank" in ast.unparse(call.args[1]).lower()


def _in_memory(call: ast.Call, buffers: set[str]) -> bool:
    target = call.args[1] if len(call.args) > 1 else kw(call, "f")
    return (isinstance(target, ast.Name) and target.id in buffers) or \
        (isinstance(target, ast.Call) and last(target) == "BytesIO")


def analyze(source: str) -> list[Finding]:
    """All findings for a script's source text, sorted by line.

    >>> [f.rule for f in analyze("import ddpkit\\nimport torch\\ntorch.save(1, 'a.pt')")]
    ['DDP007']
    """
    tree = ast.parse(source)
    v = Visitor()
    v.visit(tree)
    ddpkit_names = uses_ddpkit(tree)
    # a ddpkit script runs on every rank as a torch.distributed one does: the same rules hold
    distributed = ddpkit_names is not None or \
        any(w in source for w in ("DistributedDataParallel", "init_process_group", "torch.distributed"))
    guarded = v.guarded()
    v.calls = [(call, ranked or v.owner.get(id(call)) in guarded) for call, ranked in v.calls]
    found = list(_findings(v, tree, source, distributed))
    if distributed:
        found += metric_findings(tree, v, rank0_print="print" in (ddpkit_names or ()))
    return sorted(set(found), key=lambda f: (f.line, f.rule))


def _paired_barriers(v: Visitor) -> set[int]:
    """Barriers that come in a pair, one that only rank 0 skips and one that only rank 0 takes, in the same
    function: every rank arrives once (Hugging Face's ``if local_rank not in [-1, 0]: barrier()`` ... ``if
    local_rank == 0: barrier()``, rank 0 working first while the others wait)."""
    sides: dict[str | None, set[str | None]] = {}
    for call, _ in v.calls:
        if last(call) == "barrier":
            sides.setdefault(v.owner.get(id(call)), set()).add(v.side[id(call)])
    return {id(call) for call, _ in v.calls if last(call) == "barrier"
            and {"main", "others"} <= sides[v.owner.get(id(call))] and v.side[id(call)] is not None}


def _findings(v: Visitor, tree: ast.AST, text: str, distributed: bool) -> Iterator[Finding]:
    names = {last(c) for c, _ in v.calls}
    batchnorm = any(last(c) in BATCHNORMS for c, _ in v.calls)
    ddp_names = {"DistributedDataParallel"} | {alias.asname for node in ast.walk(tree)
                                               if isinstance(node, ast.ImportFrom) for alias in node.names
                                               if alias.name == "DistributedDataParallel" and alias.asname}
    buffers, paired, imported = memory_buffers(tree), _paired_barriers(v), aliases(tree)
    for call, ranked in v.calls:
        fn, line = last(call), call.lineno
        if fn == "DistributedSampler":
            shuffle = kw(call, "shuffle")
            if "set_epoch" not in names and not (isinstance(shuffle, ast.Constant) and shuffle.value is False):
                yield _finding("DDP001", line)  # (an unshuffled sampler has nothing to reseed)
            yield from eval_sampler(call, v)
        if fn == "DataLoader" and kw(call, "sampler") is not None:
            shuffle = kw(call, "shuffle")
            if isinstance(shuffle, ast.Constant) and shuffle.value is True:
                yield _finding("DDP002", line)
        if fn == "cuda" and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0:
            yield _finding("DDP004", line)
        if fn in ddp_names and batchnorm and "SyncBatchNorm" not in text:
            yield _finding("DDP005", line)  # at the wrap, where the fix goes, not at the layer
        if distributed and not ranked and fn == "SummaryWriter":
            yield _finding("DDP006", line)
        if distributed and not ranked and name(call.func) == "torch.save" and not _per_rank_path(call) \
                and not _in_memory(call, buffers):
            yield _finding("DDP007", line)
        # a collective by its module (dist.barrier) or imported by name (from ddpkit import barrier)
        if ranked and fn in COLLECTIVES and resolved(call, imported).split(".")[0] in ("dist", "torch", "distributed",
                                                                                       "ddpkit") \
                and id(call) not in paired and resolved(call, imported) != "torch.gather":
            yield _finding("DDP008", line)
        yield from _setup_findings(call, names)
    for const in v.strings:
        if isinstance(const.value, str) and const.value.strip() == "cuda:0":
            yield _finding("DDP004", const.lineno)
    yield from _sharding_findings(v, text)
    yield from _micro_batch_findings(tree)
    if distributed:
        yield from _stream_findings(v)


def _setup_findings(call: ast.Call, names: set[str]) -> Iterator[Finding]:
    """DDP009, 010, 011, 012, 013: how the process group is started, checkpoints loaded, ranks told apart."""
    fn, line = last(call), call.lineno
    if fn == "init_process_group":
        rank = kw(call, "rank")
        if rank is not None and "local" in ast.unparse(rank).lower():
            yield _finding("DDP009", line)
        backend = kw(call, "backend") or (call.args[0] if call.args else None)
        if backend is not None and "nccl" in ast.unparse(backend) and "set_device" not in names:
            yield _finding("DDP013", line)
    # torch.load(path, "cpu"): map_location is load's second parameter
    if name(call.func) == "torch.load" and kw(call, "map_location") is None and len(call.args) < 2:
        yield _finding("DDP010", line)
    if fn == "DataParallel":
        yield _finding("DDP011", line)
    if fn == "add_argument" and any(isinstance(a, ast.Constant) and a.value == "--local_rank" for a in call.args):
        if not any(isinstance(a, ast.Constant) and a.value == "--local-rank" for a in call.args):
            yield _finding("DDP012", line)


def _stream_findings(v: Visitor) -> Iterator[Finding]:
    """DDP016: ``DataLoader(Stream(...))`` or ``DataLoader(stream)`` with ``stream = Stream(...)``, where ``Stream``
    subclasses IterableDataset in this file and its body never mentions a rank or the loader worker."""
    unsplit = {name for name, body in v.iterables.items()
               if not any(word in body for word in (*RANK_WORDS, "get_worker_info", "split_dataset_by_node"))}
    for call, _ in v.calls:
        if last(call) != "DataLoader" or not call.args:
            continue
        source = call.args[0]
        made = v.assigned.get(source.id) if isinstance(source, ast.Name) else source
        if isinstance(made, ast.Call) and last(made) in unsplit:
            yield _finding("DDP016", call.lineno)


def _micro_batch_findings(tree: ast.AST) -> Iterator[Finding]:
    """DDP020: ``optimizer.zero_grad()`` in the body of ``for batch in step.micro_batches(...)`` (also through
    ``enumerate`` / ``zip``). One under an ``if`` (``if step.sync:`` beside ``optimizer.step()``, or before the
    first backward) is the script's decision: no finding."""
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and any(isinstance(n, ast.Call) and last(n) == "micro_batches"
                                                  for n in ast.walk(loop.iter))):
            continue
        for node in _unguarded(loop.body):
            if isinstance(node, ast.Call) and last(node) == "zero_grad":
                yield _finding("DDP020", node.lineno)


def _unguarded(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of ``body`` that run on every pass: not under an ``if`` (nor in a nested function)."""
    for statement in body:
        if isinstance(statement, (ast.If, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield from ast.walk(statement)


def _sharding_findings(v: Visitor, text: str) -> Iterator[Finding]:
    """DDP014: ``opt = SGD(model.parameters())`` above ``prepare_model(model)`` / ``fully_shard(model)``.
    DDP015: ``state_dict()`` under a rank condition, in a script that shards."""
    sharded_at = {ast.unparse(call.args[0]): call.lineno for call, _ in v.calls
                  if last(call) in ("prepare_model", "fully_shard") and call.args}
    for call, ranked in v.calls:
        params = call.args[0] if call.args else None
        if last(call) in OPTIMIZERS and isinstance(params, ast.Call) and last(params) == "parameters" \
                and isinstance(params.func, ast.Attribute):
            model = ast.unparse(params.func.value)
            if sharded_at.get(model, 0) > call.lineno:
                yield _finding("DDP014", call.lineno)
        if ranked and last(call) == "state_dict" and any(word in text for word in SHARDING):
            yield _finding("DDP015", call.lineno)


def scripts(paths: Sequence[str]) -> list[str]:
    """The .py files named, and those under the directories named, each once (by its resolved path). Hidden
    folders, caches and virtualenvs (a folder holding pyvenv.cfg) are skipped; a folder named ``env`` of
    reinforcement-learning environments is user code and is not."""
    found: dict[str, str] = {}
    for path in paths:
        if not os.path.isdir(path):
            found.setdefault(os.path.realpath(path), path)
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")) and d != "site-packages"
                             and not os.path.exists(os.path.join(root, d, "pyvenv.cfg")))
            for file in sorted(files):
                if file.endswith(".py"):
                    found.setdefault(os.path.realpath(os.path.join(root, file)), os.path.join(root, file))
    return list(found.values())


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="Find the usual DP/DDP mistakes in training scripts (static analysis).")
    p.add_argument("--json", action="store_true", help='one JSON object: {"findings": [{"path", "line", ...}]}')
    p.add_argument("--strict", action="store_true", help="exit 1 on any finding (default: on errors only)")
    p.add_argument("paths", nargs="+", help="scripts and directories (their .py files, recursively)")
    return p


ENCODING_FIX = "check reads Python 3 source, in UTF-8 unless a '# -*- coding: NAME -*-' line names the file's encoding"


def read_source(path: str) -> str:
    """A script's text as Python reads it: UTF-8, unless a ``# -*- coding: latin-1 -*-`` line (PEP 263) or a BOM
    says otherwise. Raises UnparsedFile with the line where it went wrong. Only a regular file is opened: a
    FIFO named ``p.py`` would block the run forever."""
    if not os.path.exists(path):
        raise UnparsedFile(1, "no such file (a broken symbolic link?)", "point the link at the script, or remove it")
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise UnparsedFile(1, "not a regular file (a FIFO, socket or device)", "pass the script's own file")
    with open(path, "rb") as f:
        data = f.read()
    encoding = "utf-8"
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise UnparsedFile(data[:exc.start].count(b"\n") + 1,
                           f"byte 0x{data[exc.start]:02x} is not {encoding} and no coding line names another "
                           "encoding") from None
    except SyntaxError as exc:  # an unknown encoding on the coding line, or a byte in the first two lines
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:  # say which byte, on which line, as for a later one
            raise UnparsedFile(data[:bad.start].count(b"\n") + 1, f"byte 0x{data[bad.start]:02x} is not utf-8 and "
                               "no coding line names another encoding") from None
        raise UnparsedFile(exc.lineno or 1, exc.msg) from None


class UnparsedFile(ValueError):
    """A file ``check`` cannot read as Python 3: reported as one notice for that file, the others still checked."""

    def __init__(self, line: int, reason: str, fix: str = ENCODING_FIX):
        super().__init__(reason)
        self.line, self.reason, self.fix = line, reason, fix


def _check_file(path: str) -> list[Finding]:
    try:
        return analyze(read_source(path))
    except UnparsedFile:
        raise
    except SyntaxError as exc:  # Python 2 (print "x"), or a tab/space mix
        raise UnparsedFile(exc.lineno or 1, exc.msg) from None
    except (RecursionError, MemoryError):  # valid Python nested deeper than the analyser walks (x = 1 + 1 + ...)
        raise UnparsedFile(1, "nested too deeply for the analyser", "split the deepest expression, or skip this "
                           "file (pass the others)") from None
    except ValueError as exc:  # source the parser refuses outright (a NUL byte)
        raise UnparsedFile(1, str(exc), ENCODING_FIX) from None
    except OSError as exc:
        raise UnparsedFile(1, exc.strerror or str(exc), "make the file readable, or leave it out") from None


def _notice(path: str, exc: UnparsedFile) -> str:
    stop = "" if exc.reason.endswith((".", "?", "!")) else "."
    return f"error: {path}:{exc.line} not analysed: {exc.reason}{stop} Fix: {exc.fix}"


def _print_text(results: list[tuple[str, list[Finding] | UnparsedFile]], files: int) -> None:
    """One line per finding or unreadable file, in file order; then, after an empty line, the summary on stderr
    (stdout flushed first, so that through ``2>&1 | less`` it still comes last)."""
    found = [item for _, r in results if not isinstance(r, UnparsedFile) for item in r]
    for path, result in results:
        if isinstance(result, UnparsedFile):
            print(_notice(path, result))
            continue
        for item in result:
            print(f"{item.severity}: {path}:{item.line} {item.rule} {item.message}: {item.why}. Fix: {item.fix}")
    counts = {level: sum(item.severity == level for item in found) for level in ("error", "warning", "advice")}
    summary = ", ".join(f"{n} {level}(s)" for level, n in counts.items() if n) or "no findings"
    unparsed = sum(isinstance(r, UnparsedFile) for _, r in results)
    summary += f" in {files - unparsed} file(s)" + (f"; {unparsed} file(s) not analysed" if unparsed else "")
    sys.stdout.flush()
    print(("\n" if found or unparsed else "") + summary, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        files = scripts(ns.paths)
        missing = [path for path in ns.paths if not os.path.exists(path)]
        if missing:
            raise UsageError(f"no such file or directory: {' '.join(missing)}; pass scripts or directories")
        if not files:
            raise UsageError(f"no .py file under {' '.join(ns.paths)}; pass scripts or directories holding them")
    except UsageError as exc:
        return usage_error(PROG, exc)
    results: list[tuple[str, list[Finding] | UnparsedFile]] = []
    for path in files:
        try:
            results.append((path, _check_file(path)))
        except UnparsedFile as exc:
            results.append((path, exc))
    found = [(path, item) for path, r in results if not isinstance(r, UnparsedFile) for item in r]
    unparsed = [(path, r) for path, r in results if isinstance(r, UnparsedFile)]
    if ns.json:
        print(json.dumps({"findings": [{"path": path, **dataclasses.asdict(item)} for path, item in found],
                          "not_analysed": [{"path": path, "line": exc.line, "message": exc.reason}
                                           for path, exc in unparsed]}))
    else:
        _print_text(results, len(files))
    failing = found if ns.strict else [f for f in found if f[1].severity == "error"]
    # a file left unread is bad input: exit 2 even when the others have errors, so CI cannot read it as "checked"
    return USAGE_ERROR if unparsed else SCRIPT_FAILED if failing else 0
