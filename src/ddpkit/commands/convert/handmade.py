"""A script distributed by hand the way Hugging Face's examples of 2019-2021 were (run_glue.py and the many
fine-tuning repositories written from it): a ``--local_rank`` argument, -1 by default, and every distributed line
under a test of it (``if args.local_rank != -1: model = DistributedDataParallel(...)``, ``RandomSampler(ds) if
args.local_rank == -1 else DistributedSampler(ds)``, ``if args.local_rank in [-1, 0]: torch.save(...)``).

Run without a launcher, ``local_rank`` stays -1 and the script is a single-device one. :func:`single_device` is that
script: every test of ``local_rank`` decided for -1 and the branch it takes kept. ``ddpkit convert`` then converts
it as any single-device script (its prints and saves made rank 0's, its DataParallel undone, its loaders sharded).
The converted script never passes ``--local_rank``, so any read of it left says -1 as before.

Example::

    >>> text = single_device("if args.local_rank == -1:\\n    sampler = RandomSampler(ds)\\nelse:\\n"
    ...                      "    sampler = DistributedSampler(ds)\\n")
    >>> text
    'sampler = RandomSampler(ds)\\n'
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import libcst as cst

from ddpkit.commands.convert.names import dotted

__all__ = ["single_device", "line_map"]

# what only a hand-distributed script calls: left in the live code, the script is not this idiom (refused as ever)
_DISTRIBUTED = re.compile(r"init_process_group|DistributedDataParallel|DistributedSampler|torch\.distributed\.")
# ``dist.`` is torch.distributed only where the script imports it so (a ``dist = torch.cdist(...)`` is no call)
_ALIASED = re.compile(r"import\s+torch\.distributed\s+as\s+dist\b|from\s+torch\s+import\s+distributed\s+as\s+dist\b")
_OPS: dict[type, Callable[[Any, Any], bool]] = {
    cst.Equal: operator.eq, cst.NotEqual: operator.ne, cst.LessThan: operator.lt, cst.GreaterThan: operator.gt,
    cst.LessThanEqual: operator.le, cst.GreaterThanEqual: operator.ge, cst.In: lambda a, b: a in b,
    cst.NotIn: lambda a, b: a not in b}


def single_device(source: str) -> str | None:
    """``source`` with every test of ``local_rank`` decided for -1; None when it has no such test, or when a
    distributed call is left in the code that runs (not this idiom: the script is refused as before)."""
    if "local_rank" not in source or not _DISTRIBUTED.search(source):
        return None
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return None
    if not _minus_one_by_default(module):
        return None
    folder = _Fold()
    text = module.visit(folder).code
    live = _code_only(text)
    if not folder.decided or _DISTRIBUTED.search(live) or _ALIASED.search(source) and re.search(r"\bdist\.", live):
        return None
    return text


def _minus_one_by_default(module: cst.Module) -> bool:
    """Every ``add_argument("--local_rank", ...)`` of the script defaults to -1 (another default, or none, and the
    script's own run without a launcher is not the single-device path)."""
    found = _Arguments()
    module.visit(found)
    return all(value == -1 for value in found.defaults)


class _Arguments(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.defaults: list[Any] = []

    def visit_Call(self, node: cst.Call) -> None:
        if not (isinstance(node.func, cst.Attribute) and node.func.attr.value == "add_argument"):
            return
        names = [a.value.value for a in node.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        if any(n.strip("'\"").lstrip("-").replace("-", "_") == "local_rank" for n in names):
            default = next((a.value for a in node.args if a.keyword is not None and a.keyword.value == "default"),
                           None)
            self.defaults.append(_number(default) if default is not None else None)
            if default is not None and self.defaults[-1] is None and _env_minus_one(default):
                self.defaults[-1] = -1  # ``int(os.environ.get("LOCAL_RANK", -1))``: -1 run without a launcher


def _env_minus_one(node: Any) -> bool:
    """``os.environ.get("LOCAL_RANK", -1)`` (inside ``int(...)`` too): -1 where no launcher set the variable."""
    while isinstance(node, cst.Call) and dotted(node.func) == "int" and node.args:
        node = node.args[0].value
    return isinstance(node, cst.Call) and (dotted(node.func) or "").endswith("environ.get") and \
        len(node.args) == 2 and _number(node.args[1].value) == -1


def line_map(source: str, single: str) -> list[int]:
    """For each line of ``single`` (from 1; index 0 unused), the line of ``source`` it came from: equal lines
    matched in order, a kept branch's dedented lines too; a line with no match takes the one above it."""
    old = [line.strip() for line in source.splitlines()]
    new = [line.strip() for line in single.splitlines()]
    mapped = [0] * (len(new) + 1)
    for tag, a1, a2, b1, b2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag in ("equal", "replace"):  # a line rewritten in place (a conditional expression decided) is its own
            for k in range(min(a2 - a1, b2 - b1)):
                mapped[b1 + k + 1] = a1 + k + 1
    for j in range(1, len(mapped)):
        mapped[j] = mapped[j] or mapped[j - 1] or 1
    return mapped


def _code_only(text: str) -> str:
    """``text`` without its comments, strings and imports (a ``# torch.distributed`` remark, an unused import of
    DistributedSampler, is no call)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError:
        return text
    return module.visit(_Strip()).code


class _Strip(cst.CSTTransformer):
    def leave_Import(self, original: cst.Import, updated: cst.Import) -> Any:
        return cst.Pass()

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> Any:
        return cst.Pass()

    def leave_Comment(self, original: cst.Comment, updated: cst.Comment) -> Any:
        return updated.with_changes(value="#")

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> Any:
        return updated.with_changes(value='""')


class _Fold(cst.CSTTransformer):
    """Decides each ``if`` / conditional expression whose test reads ``local_rank``."""

    def __init__(self) -> None:
        super().__init__()
        self.decided = 0
        self._elifs: set[int] = set()

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self._elifs.add(id(node.orelse))

    def leave_If(self, original: cst.If, updated: cst.If) -> Any:
        if id(original) in self._elifs:  # decided with the chain it ends
            return updated
        branches: list[tuple[Any, Any]] = []
        node: Any = updated
        while isinstance(node, cst.If):
            branches.append((node.test, node.body))
            node = node.orelse
        rest = node.body if isinstance(node, cst.Else) else None
        kept: list[tuple[Any, Any]] = []
        changed = False
        for test, body in branches:
            value = _fold(test)
            changed = changed or value is not test
            if value is True and not kept:
                self.decided += 1
                return _statements(body)
            if value is True:  # always taken once reached: the branches below it never run
                self.decided += 1
                rest = body
                break
            if value is False:
                self.decided += 1
                continue
            kept.append((value, body))
        if not kept:
            return _statements(rest) if rest is not None else cst.RemovalSentinel.REMOVE
        return _chain(kept, rest, updated) if changed else updated

    def leave_IfExp(self, original: cst.IfExp, updated: cst.IfExp) -> Any:
        value = _fold(updated.test)
        if value is True or value is False:
            self.decided += 1
            return (updated.body if value else updated.orelse).with_changes(lpar=updated.lpar, rpar=updated.rpar)
        return updated

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> Any:
        if not updated.body:  # every statement of the block was a branch not taken
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return updated


def _statements(body: Any) -> Any:
    if isinstance(body, cst.SimpleStatementSuite):
        return cst.FlattenSentinel([cst.SimpleStatementLine(body=body.body)])
    return cst.FlattenSentinel(body.body) if body.body else cst.RemovalSentinel.REMOVE


def _chain(kept: Sequence[tuple[Any, Any]], rest: Any, template: cst.If) -> cst.If:
    orelse: Any = cst.Else(body=rest) if rest is not None else None
    for test, body in reversed(kept[1:]):
        orelse = cst.If(test=test, body=body, orelse=orelse)
    test, body = kept[0]
    return template.with_changes(test=test, body=body, orelse=orelse)


def _reads_rank(node: Any) -> bool:
    return isinstance(node, (cst.Name, cst.Attribute)) and (dotted(node) or "").split(".")[-1] == "local_rank"


def _number(node: Any) -> Any:
    """A literal int (``-1``, ``0``) or a list / tuple / set of them; None otherwise."""
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and \
            isinstance(node.expression, cst.Integer):
        return -int(node.expression.value)
    if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
        values = [_number(e.value) for e in node.elements]
        return None if any(v is None or isinstance(v, list) for v in values) else values
    return None


def _fold(node: Any) -> Any:
    """True / False where ``node`` is decided by ``local_rank == -1``; else the node, its decided parts taken out
    (``args.local_rank == -1 or args.no_cuda`` is True; ``x and args.local_rank != -1`` is False)."""
    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
        target = node.comparisons[0]
        op = _OPS.get(type(target.operator))
        left, right = node.left, target.comparator
        if op is not None and (_reads_rank(left) and _number(right) is not None or
                               _reads_rank(right) and _number(left) is not None):
            a = -1 if _reads_rank(left) else _number(left)
            b = -1 if _reads_rank(right) else _number(right)
            try:
                return bool(op(a, b))
            except TypeError:  # ``local_rank in 0``: not a test this script can mean
                return node
        return node
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        inner = _fold(node.expression)
        return (not inner) if isinstance(inner, bool) else node
    if isinstance(node, cst.BooleanOperation):
        left, right = _fold(node.left), _fold(node.right)
        if isinstance(node.operator, cst.Or):
            if left is True or right is True:
                return True
            if left is False:
                return right
            return left if right is False else node
        if left is False or right is False:
            return False
        if left is True:
            return right
        return left if right is True else node
    return node
