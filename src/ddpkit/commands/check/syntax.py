"""What ``ddpkit check`` reads from a script's syntax tree: call names, rank conditions, evaluation-data names.

One walk of the tree (:class:`Visitor`) records every call with whether it sits under a rank-dependent
condition, which side of it (rank 0's or the others'), and in which function; the rules in
:mod:`ddpkit.commands.check.command` and :mod:`ddpkit.commands.check.metrics` are decisions over that record.

>>> v = Visitor(); v.visit(ast.parse("if rank == 0:\\n    dist.barrier()"))
>>> [(name(c.func), ranked, v.side[id(c)]) for c, ranked in v.calls]
[('dist.barrier', True, 'main')]
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from ddpkit.commands.check.rules import RANK_WORDS

# whole words of a name that mark evaluation data; "retrieval" or "interval" hold "val" and are not
EVAL_WORDS = {"val", "valid", "validation", "eval", "evaluation", "test", "testing", "dev"}
EVAL_SUFFIXES = ("", "set", "sets", "data", "dataset", "ds", "loader")  # testset, valdata, evalds: one word


def name(node: ast.AST) -> str:
    """Dotted name of a call target: torch.utils.data.DataLoader -> 'torch.utils.data.DataLoader'."""
    if isinstance(node, ast.Attribute):
        return f"{name(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return name(node.func)
    return ""


def last(node: ast.Call) -> str:
    return name(node.func).rsplit(".", 1)[-1]


def kw(node: ast.Call, key: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == key), None)


def mentions_rank(test: ast.AST) -> bool:
    text = ast.unparse(test).lower()
    return any(word in text for word in RANK_WORDS)


def eval_data(node: ast.AST | None) -> bool:
    """Whether an expression names evaluation data, by whole words split on ``_``, dots and camelCase.

    >>> [eval_data(ast.parse(s).body[0].value) for s in ("val_set", "retrieval_set", "testset", "dsValid")]
    [True, False, True, True]
    """
    if node is None:
        return False
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", ast.unparse(node)).lower()
    return any(word.removesuffix(suffix) in EVAL_WORDS for word in re.split(r"[^a-z0-9]+", text)
               for suffix in EVAL_SUFFIXES if word.endswith(suffix) and word != suffix)


def side(test: ast.expr) -> str | None:
    """Which ranks a rank condition selects: ``"main"`` (rank 0 takes the branch), ``"others"`` (every rank but
    0), or None when it cannot tell. ``-1`` is Hugging Face's "not distributed", which rank 0's side includes.

    >>> [side(ast.parse(s).body[0].value) for s in ("local_rank not in [-1, 0]", "rank == 0", "not state.is_main")]
    ['others', 'main', 'others']
    """
    flip = {"main": "others", "others": "main", None: None}
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return flip[side(test.operand)]
    if isinstance(test, ast.BoolOp):
        sides = {side(value) for value in test.values if mentions_rank(value)}
        return sides.pop() if len(sides) == 1 else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        zero = any(isinstance(n, ast.Constant) and n.value == 0 for n in ast.walk(test.comparators[0]))
        if zero and isinstance(test.ops[0], (ast.Eq, ast.In)):
            return "main"
        if zero and isinstance(test.ops[0], (ast.NotEq, ast.NotIn, ast.Gt)):
            return "others"
        return None
    if isinstance(test, (ast.Name, ast.Attribute, ast.Call)) and mentions_rank(test):
        return "main"  # state.is_main, is_main_process(), args.is_master
    return None


class Visitor(ast.NodeVisitor):
    """Walks the tree once, remembering whether each node sits under a rank-dependent `if`, and in which
    function or method of the file."""

    def __init__(self):
        self.calls: list[tuple[ast.Call, bool]] = []  # (call, under a rank condition)
        self.side: dict[int, str | None] = {}  # id(call) -> the side of its innermost rank condition
        self.strings: list[ast.Constant] = []
        self.defined: set[str] = set()  # functions and methods defined in the file
        self.owner: dict[int, str] = {}  # id(call) -> the function or method it sits in
        self._rank_tests: list[str | None] = []  # the side of each enclosing rank condition, innermost last
        self._functions: list[str] = []
        self.iterables: dict[str, str] = {}  # IterableDataset subclasses of the file -> their source, lowercase
        self.assigned: dict[str, ast.expr] = {}  # name -> the value last assigned to it (module or function level)
        self.divisions: list[ast.BinOp | ast.AugAssign] = []  # a / b and a /= b

    def visit_ClassDef(self, node: ast.ClassDef):
        if any(name(base).endswith("IterableDataset") for base in node.bases):
            self.iterables[node.name] = ast.unparse(node).lower()
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp):
        if isinstance(node.op, ast.Div):
            self.divisions.append(node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign):
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
        tests, self._rank_tests = self._rank_tests, []  # a body runs where it is called, not where it is defined
        self.generic_visit(node)
        self._rank_tests = tests
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _branches(self, test: ast.expr, body: Sequence[ast.AST], orelse: Sequence[ast.AST]):
        ranked = mentions_rank(test)
        for children, flipped in ((body, False), (orelse, True)):  # `else` of `if rank == 0` is rank-dependent
            which = side(test) if ranked else None
            if ranked:
                self._rank_tests.append({"main": "others", "others": "main"}.get(which or "") if flipped else which)
            for child in children:
                self.visit(child)
            if ranked:
                self._rank_tests.pop()
        self.visit(test)

    def visit_If(self, node: ast.If):
        self._branches(node.test, node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp):
        """``SummaryWriter() if local_rank in [-1, 0] else None`` guards as an ``if`` does."""
        self._branches(node.test, [node.body], [node.orelse])

    def visit_Call(self, node: ast.Call):
        self.calls.append((node, bool(self._rank_tests)))
        self.side[id(node)] = self._rank_tests[-1] if self._rank_tests else None
        if self._functions:
            self.owner[id(node)] = self._functions[-1]
        self.generic_visit(node)

    def guarded(self) -> set[str]:
        """Functions of the file that run only under a rank condition: every call site in the file is under
        one, or in such a function. Calls from other modules or by dynamic dispatch are not seen; a function
        with no call site here is not guarded (the analysis then stays where it was: the enclosing `if`)."""
        sites: dict[str, list[tuple[ast.Call, bool]]] = {}
        for call, ranked in self.calls:
            if last(call) in self.defined and self.owner.get(id(call)) != last(call):  # recursion aside
                sites.setdefault(last(call), []).append((call, ranked))
        guarded: set[str] = set()
        while True:
            more = {fn for fn, calls in sites.items()
                    if all(ranked or self.owner.get(id(call)) in guarded for call, ranked in calls)}
            if more <= guarded:
                return guarded
            guarded |= more

    def visit_Constant(self, node: ast.Constant):
        if isinstance(node.value, str):
            self.strings.append(node)


def memory_buffers(tree: ast.AST) -> set[str]:
    """Names bound to an ``io.BytesIO()`` (``buf = io.BytesIO()``, ``with BytesIO() as buf``): saving into one is
    serialisation in memory, not a file that ranks race to write.

    >>> sorted(memory_buffers(ast.parse("b = io.BytesIO()")))
    ['b']
    """
    def is_buffer(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Call) and last(node) == "BytesIO"

    names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_buffer(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    names |= {item.optional_vars.id for n in ast.walk(tree) if isinstance(n, ast.With) for item in n.items
              if is_buffer(item.context_expr) and isinstance(item.optional_vars, ast.Name)}
    return names


def aliases(tree: ast.AST) -> dict[str, str]:
    """What each imported name stands for, dotted: ``import torch.distributed as dist`` -> dist:
    torch.distributed; ``from ddpkit import reduce`` -> reduce: ddpkit.reduce.

    >>> aliases(ast.parse("import torch.distributed as dist\\nfrom ddpkit import barrier as b"))
    {'dist': 'torch.distributed', 'b': 'ddpkit.barrier'}
    """
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return found


def resolved(call: ast.Call, names: dict[str, str]) -> str:
    """A call's dotted name with its first part resolved through the imports (see :func:`aliases`):
    ``all_reduce(t)`` after ``from torch.distributed import all_reduce`` -> 'torch.distributed.all_reduce'."""
    head, _, rest = name(call.func).partition(".")
    head = names.get(head, head)
    return f"{head}.{rest}" if rest else head


def uses_ddpkit(tree: ast.AST) -> set[str] | None:
    """The names a script imports from ddpkit (``from ddpkit import print``), or None when it never imports it.

    >>> sorted(uses_ddpkit(ast.parse("import ddpkit\\nfrom ddpkit import print")))
    ['print']
    """
    imported: set[str] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ddpkit" for a in node.names):
            imported = imported or set()
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ddpkit":
            imported = (imported or set()) | {a.asname or a.name for a in node.names}
    return imported
