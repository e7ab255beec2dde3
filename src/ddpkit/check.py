"""``ddpkit check script.py``: find the usual DP/DDP mistakes in a training script before it runs.

Static analysis with :mod:`ast` of any PyTorch script (ddpkit or not). Each finding has a severity (error:
a hang, a crash or a wrong result; warning: wrong beyond one node, or wasteful; advice), a line, a rule id,
what is wrong, why it matters and the fix. Exit 1 when an error is found (``--strict``: any finding), 0
otherwise, 2 on bad input.

Example::

    $ ddpkit check train.py
    warning: train.py:42 DDP001 DistributedSampler without set_epoch: ... Fix: call sampler.set_epoch(epoch) ...
    $ ddpkit check --json train.py
    {"findings": [{"path": "train.py", "line": 42, "rule": "DDP001", "severity": "warning", "message": "...", ...}]}
    $ ddpkit check src/ scripts/train.py          # several files and directories, as linters take them
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence

from ddpkit.check_rules import BATCHNORMS, COLLECTIVES, OPTIMIZERS, RANK_WORDS, RULES, SEVERITY, SHARDING
from ddpkit.cli import SCRIPT_FAILED, OneLineParser, UsageError, usage_error

PROG = "ddpkit check"



@dataclasses.dataclass(frozen=True)
class Finding:
    line: int
    rule: str
    severity: str  # error: hang, crash or wrong result; warning: wrong beyond one node, or wasteful; advice
    message: str
    why: str
    fix: str






def _name(node: ast.AST) -> str:
    """Dotted name of a call target: torch.utils.data.DataLoader -> 'torch.utils.data.DataLoader'."""
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _last(node: ast.Call) -> str:
    return _name(node.func).rsplit(".", 1)[-1]


def _kw(node: ast.Call, key: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == key), None)


def _mentions_rank(test: ast.AST) -> bool:
    text = ast.unparse(test).lower()
    return any(word in text for word in RANK_WORDS)


class _Visitor(ast.NodeVisitor):
    """Walks the tree once, remembering whether each node sits under a rank-dependent `if`, and in which
    function or method of the file."""

    def __init__(self):
        self.calls: list[tuple[ast.Call, bool]] = []  # (call, under a rank condition)
        self.strings: list[ast.Constant] = []
        self.buffers: set[str] = set()  # names bound to io.BytesIO (set by analyze)
        self.defined: set[str] = set()  # functions and methods defined in the file
        self.owner: dict[int, str] = {}  # id(call) -> the function or method it sits in
        self._rank_depth = 0
        self._functions: list[str] = []
        self.iterables: dict[str, str] = {}  # IterableDataset subclasses of the file -> their source, lowercase
        self.assigned: dict[str, ast.expr] = {}  # name -> the value last assigned to it (module or function level)
        self.batchnorm = False  # the file builds a BatchNorm layer (set by analyze)
        self.divisions: list[ast.BinOp] = []
        self.ddp_names: set[str] = set()  # DistributedDataParallel and the names it is imported as (set by analyze)

    def visit_ClassDef(self, node: ast.ClassDef):
        if any(_name(base).endswith("IterableDataset") for base in node.bases):
            self.iterables[node.name] = ast.unparse(node).lower()
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp):
        if isinstance(node.op, ast.Div):
            self.divisions.append(node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.assigned[target.id] = node.value
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef):
        self.defined.add(node.name)
        self._functions.append(node.name)
        depth, self._rank_depth = self._rank_depth, 0  # a body runs where it is called, not where it is defined
        self.generic_visit(node)
        self._rank_depth = depth
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If):
        ranked = _mentions_rank(node.test)
        self._rank_depth += ranked
        for child in node.body:
            self.visit(child)
        for child in node.orelse:  # `else` of `if rank == 0` is rank-dependent too
            self.visit(child)
        self._rank_depth -= ranked
        self.visit(node.test)

    def visit_Call(self, node: ast.Call):
        self.calls.append((node, self._rank_depth > 0))
        if self._functions:
            self.owner[id(node)] = self._functions[-1]
        self.generic_visit(node)

    def guarded(self) -> set[str]:
        """Functions of the file that run only under a rank condition: every call site in the file is under
        one, or in such a function. Calls from other modules or by dynamic dispatch are not seen; a function
        with no call site here is not guarded (the analysis then stays where it was: the enclosing `if`)."""
        sites: dict[str, list[tuple[ast.Call, bool]]] = {}
        for call, ranked in self.calls:
            if _last(call) in self.defined and self.owner.get(id(call)) != _last(call):  # recursion aside
                sites.setdefault(_last(call), []).append((call, ranked))
        guarded: set[str] = set()
        while True:
            more = {name for name, calls in sites.items()
                    if all(ranked or self.owner.get(id(call)) in guarded for call, ranked in calls)}
            if more <= guarded:
                return guarded
            guarded |= more

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, str):
            self.strings.append(node)


def _per_rank_path(call: ast.Call) -> bool:
    """torch.save(obj, f"out/rank{rank}.pt"): each rank writes its own file, which is fine."""
    return len(call.args) > 1 and "rank" in ast.unparse(call.args[1]).lower()


def memory_buffers(tree: ast.AST) -> set[str]:
    """Names bound to an ``io.BytesIO()`` (``buf = io.BytesIO()``, ``with BytesIO() as buf``): saving into one is
    serialisation in memory, not a file that ranks race to write.

    >>> sorted(memory_buffers(ast.parse("b = io.BytesIO()")))
    ['b']
    """
    def is_buffer(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Call) and _last(node) == "BytesIO"

    names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_buffer(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    names |= {item.optional_vars.id for n in ast.walk(tree) if isinstance(n, ast.With) for item in n.items
              if is_buffer(item.context_expr) and isinstance(item.optional_vars, ast.Name)}
    return names


def _in_memory(call: ast.Call, buffers: set[str]) -> bool:
    target = call.args[1] if len(call.args) > 1 else _kw(call, "f")
    return (isinstance(target, ast.Name) and target.id in buffers) or \
        (isinstance(target, ast.Call) and _last(target) == "BytesIO")


def analyze(source: str) -> list[Finding]:
    """All findings for a script's source text, sorted by line."""
    tree = ast.parse(source)
    v = _Visitor()
    v.visit(tree)
    names = {_last(c) for c, _ in v.calls}
    v.batchnorm = any(_last(c) in BATCHNORMS for c, _ in v.calls)
    v.ddp_names = {"DistributedDataParallel"} | {alias.asname for node in ast.walk(tree)
                                                 if isinstance(node, ast.ImportFrom) for alias in node.names
                                                 if alias.name == "DistributedDataParallel" and alias.asname}
    text = source
    distributed = any(w in text for w in ("DistributedDataParallel", "init_process_group", "torch.distributed"))
    v.buffers = memory_buffers(tree)
    guarded = v.guarded()
    v.calls = [(call, ranked or v.owner.get(id(call)) in guarded) for call, ranked in v.calls]
    found = list(_findings(v, names, text, distributed))
    return sorted(set(found), key=lambda f: (f.line, f.rule))


def _finding(rule: str, line: int) -> Finding:
    message, why, fix = RULES[rule]
    return Finding(line, rule, SEVERITY[rule], message, why, fix)


def _findings(v: _Visitor, names: set[str], text: str, distributed: bool) -> Iterator[Finding]:
    for call, ranked in v.calls:
        last, line = _last(call), call.lineno
        if last == "DistributedSampler":
            shuffle = _kw(call, "shuffle")
            if "set_epoch" not in names and not (isinstance(shuffle, ast.Constant) and shuffle.value is False):
                yield _finding("DDP001", line)  # (an unshuffled sampler has nothing to reseed)
            if call.args and any(w in ast.unparse(call.args[0]).lower() for w in ("val", "test", "eval")):
                yield from _eval_sampler(call, v)
        if last == "DataLoader" and _kw(call, "sampler") is not None:
            shuffle = _kw(call, "shuffle")
            if isinstance(shuffle, ast.Constant) and shuffle.value is True:
                yield _finding("DDP002", line)
        if last == "cuda" and call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value == 0:
            yield _finding("DDP004", line)
        if last in v.ddp_names and v.batchnorm and "SyncBatchNorm" not in text:
            yield _finding("DDP005", line)  # at the wrap, where the fix goes, not at the layer
        if distributed and not ranked and last == "SummaryWriter":
            yield _finding("DDP006", line)
        if distributed and not ranked and _name(call.func) == "torch.save" and not _per_rank_path(call) \
                and not _in_memory(call, v.buffers):
            yield _finding("DDP007", line)
        if ranked and last in COLLECTIVES and _name(call.func).split(".")[0] in ("dist", "torch", "distributed",
                                                                                 "ddpkit"):
            yield _finding("DDP008", line)
        if last == "init_process_group":
            rank = _kw(call, "rank")
            if rank is not None and "local" in ast.unparse(rank).lower():
                yield _finding("DDP009", line)
            backend = _kw(call, "backend") or (call.args[0] if call.args else None)
            if backend is not None and "nccl" in ast.unparse(backend) and "set_device" not in names:
                yield _finding("DDP013", line)
        if _name(call.func) == "torch.load" and _kw(call, "map_location") is None:
            yield _finding("DDP010", line)
        if last == "DataParallel":
            yield _finding("DDP011", line)
        if last == "add_argument" and any(isinstance(a, ast.Constant) and a.value == "--local_rank" for a in call.args):
            if not any(isinstance(a, ast.Constant) and a.value == "--local-rank" for a in call.args):
                yield _finding("DDP012", line)
    for const in v.strings:
        if isinstance(const.value, str) and const.value.strip() == "cuda:0":
            yield _finding("DDP004", const.lineno)
    yield from _sharding_findings(v, text)
    if distributed:
        yield from _stream_findings(v)
        yield from _metric_findings(v)


REDUCTIONS = {"all_reduce", "reduce", "all_gather", "gather", "all_gather_object", "gather_object", "reduce_scatter"}


def _metric_findings(v: _Visitor) -> Iterator[Finding]:
    """DDP017: ``print(... loss ...)`` outside a rank check. DDP018: ``correct / len(test_loader.dataset)`` where
    ``correct`` goes through no reduction anywhere in the file."""
    for call, ranked in v.calls:
        text = " ".join(ast.unparse(arg) for arg in call.args)
        # a line that names its rank ("[GPU{gpu_id}] ... loss") is per-rank output on purpose
        if not ranked and _name(call.func) == "print" and ("loss" in text.lower() or ".item()" in text) \
                and not any(word in text.lower() for word in RANK_WORDS):
            yield _finding("DDP017", call.lineno)
    reduced = " ".join(ast.unparse(c) for c, _ in v.calls if _last(c) in REDUCTIONS)
    for node in v.divisions:
        size = node.right
        if isinstance(node.left, ast.Name) and isinstance(size, ast.Call) and _name(size.func) == "len" \
                and size.args and any(w in ast.unparse(size.args[0]).lower() for w in ("dataset", "_set", "data")) \
                and node.left.id not in reduced:
            yield _finding("DDP018", node.lineno)


def _stream_findings(v: _Visitor) -> Iterator[Finding]:
    """DDP016: ``DataLoader(Stream(...))`` or ``DataLoader(stream)`` with ``stream = Stream(...)``, where ``Stream``
    subclasses IterableDataset in this file and its body never mentions a rank or the loader worker."""
    unsplit = {name for name, body in v.iterables.items()
               if not any(word in body for word in (*RANK_WORDS, "get_worker_info", "split_dataset_by_node"))}
    for call, _ in v.calls:
        if _last(call) != "DataLoader" or not call.args:
            continue
        source = call.args[0]
        made = v.assigned.get(source.id) if isinstance(source, ast.Name) else source
        if isinstance(made, ast.Call) and _last(made) in unsplit:
            yield _finding("DDP016", call.lineno)


def _eval_sampler(call: ast.Call, v: _Visitor) -> Iterator[Finding]:
    """An evaluation DistributedSampler: it pads (DDP003), or with drop_last=True it drops the tail, which is
    fine when the file evaluates the remainder through a Subset of the same dataset (torch's ImageNet example's
    aux_val_loader), and a skipped tail otherwise (DDP019)."""
    drop = _kw(call, "drop_last")
    if not (isinstance(drop, ast.Constant) and drop.value is True):
        yield _finding("DDP003", call.lineno)
        return
    dataset = ast.unparse(call.args[0])
    if not any(_last(c) == "Subset" and c.args and ast.unparse(c.args[0]) == dataset for c, _ in v.calls):
        yield _finding("DDP019", call.lineno)


def _sharding_findings(v: _Visitor, text: str) -> Iterator[Finding]:
    """DDP014: ``opt = SGD(model.parameters())`` above ``prepare_model(model)`` / ``fully_shard(model)``.
    DDP015: ``state_dict()`` under a rank condition, in a script that shards."""
    sharded_at = {ast.unparse(call.args[0]): call.lineno for call, _ in v.calls
                  if _last(call) in ("prepare_model", "fully_shard") and call.args}
    for call, ranked in v.calls:
        params = call.args[0] if call.args else None
        if _last(call) in OPTIMIZERS and isinstance(params, ast.Call) and _last(params) == "parameters" \
                and isinstance(params.func, ast.Attribute):
            model = ast.unparse(params.func.value)
            if sharded_at.get(model, 0) > call.lineno:
                yield _finding("DDP014", call.lineno)
        if ranked and _last(call) == "state_dict" and any(word in text for word in SHARDING):
            yield _finding("DDP015", call.lineno)


def scripts(paths: Sequence[str]) -> list[str]:
    """The .py files named, and those under the directories named (hidden and virtualenv folders skipped)."""
    found: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            found.append(path)
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")) and d not in ("venv", "env"))
            found += [os.path.join(root, name) for name in sorted(files) if name.endswith(".py")]
    return found


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description="Find the usual DP/DDP mistakes in training scripts (static analysis).")
    p.add_argument("--json", action="store_true", help='one JSON object: {"findings": [{"path", "line", ...}]}')
    p.add_argument("--strict", action="store_true", help="exit 1 on any finding (default: on errors only)")
    p.add_argument("paths", nargs="+", help="scripts and directories (their .py files, recursively)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        files = scripts(ns.paths)
        if not files:
            raise UsageError(f"no .py file under {' '.join(ns.paths)}; pass scripts or directories holding them")
    except UsageError as exc:
        return usage_error(PROG, exc)
    found: list[tuple[str, Finding]] = []
    for path in files:
        try:
            with open(path) as f:
                found += [(path, finding) for finding in analyze(f.read())]
        except (OSError, SyntaxError, UnicodeDecodeError) as exc:
            return usage_error(PROG, f"cannot analyse {path}: {exc}")
    if ns.json:
        print(json.dumps({"findings": [{"path": path, **dataclasses.asdict(item)} for path, item in found]}))
    else:
        for path, item in found:
            print(f"{item.severity}: {path}:{item.line} {item.rule} {item.message}: {item.why}. Fix: {item.fix}")
        counts = {level: sum(item.severity == level for _, item in found) for level in ("error", "warning", "advice")}
        summary = ", ".join(f"{n} {level}(s)" for level, n in counts.items() if n)
        print(f"{summary} in {len(files)} file(s)" if found else f"no findings in {len(files)} file(s)",
              file=sys.stderr)
    failing = found if ns.strict else [f for f in found if f[1].severity == "error"]
    return SCRIPT_FAILED if failing else 0
