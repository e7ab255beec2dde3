"""The rewrite of ``ddpkit convert``: the plan's edits applied to the scanned libcst tree, which keeps every
comment, blank line and quote the plan does not touch.

Edits find their node by identity (the node the scan saw), so the scan and the rewrite share one
:class:`libcst.metadata.MetadataWrapper`. An edit is a function of the node as already rewritten below it
(a ``print`` inside a rewritten ``if`` is rewritten too).

Example::

    >>> from ddpkit.commands.convert.scan import parse
    >>> w = parse("x = f(1)\\n"); call = w.module.body[0].body[0].value
    >>> edits = Edits(); edits.expr[id(call)] = lambda node: node.with_changes(func=cst.parse_expression("g"))
    >>> rewrite(w, edits)
    'x = g(1)\\n'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper

from ddpkit.commands.convert.names import dotted


@dataclasses.dataclass
class Edits:
    expr: dict[int, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)  # node -> new node
    replace: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements (code)
    guard: dict[int, str] = dataclasses.field(default_factory=dict)  # statement -> ``if <test>:`` around it
    after: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements after it
    before: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements before it
    no_grad: set[int] = dataclasses.field(default_factory=set)  # statements to run under ``torch.no_grad()``
    remove: set[int] = dataclasses.field(default_factory=set)  # statements deleted (an ``if`` left empty goes too)
    imports: list[str] = dataclasses.field(default_factory=list)  # lines after the module's last import

    def __bool__(self) -> bool:
        return bool(self.expr or self.replace or self.guard or self.after or self.before or self.no_grad or
                    self.remove)


# torch.utils.data.DataLoader's parameters in order: what its positional arguments after the batch size are
LOADER_PARAMETERS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn",
                     "pin_memory", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator")
_NO_SPACE = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def add_keyword(call: cst.Call, name: str, value: str) -> cst.Call:
    """``f(a, b=1)`` -> ``f(a, b=1, name=value)``; before the last argument when that one ends with a comma (a
    call over several lines: its comma keeps the comment and line break after it) or is ``**kw``.

    >>> code = cst.Module(body=[]).code_for_node
    >>> code(add_keyword(cst.parse_expression("f(a, b=1)"), "c", "2")), code(add_keyword(
    ...     cst.parse_expression("f(a, **kw)"), "c", "2"))
    ('f(a, b=1, c=2)', 'f(a, c=2, **kw)')
    """
    new = cst.Arg(cst.parse_expression(value), keyword=cst.Name(name), equal=_NO_SPACE)
    args = list(call.args)
    if args and (args[-1].keyword is not None and isinstance(args[-1].comma, cst.Comma) or args[-1].star == "**"):
        comma = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else \
            cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return call.with_changes(args=[*args[:-1], new.with_changes(comma=comma), args[-1]])
    if args and isinstance(args[-1].comma, cst.Comma):  # a positional one: its comma (and comment) ends the new
        new = new.with_changes(comma=args[-1].comma)
    if args:
        args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(args=[*args, new])


def keyword_on_wraps(text: str, keyword: str, values: dict[str, str]) -> str:
    """Each ``name = ddpkit.prepare_model(...)`` of the converted ``text`` whose name ``values`` holds gets
    ``keyword=values[name]``, unless it has that keyword (``forward_methods=``, ``sync_batchnorm=``).

    >>> keyword_on_wraps("m = ddpkit.prepare_model(Net())\\n", "sync_batchnorm", {"m": "False"})
    'm = ddpkit.prepare_model(Net(), sync_batchnorm=False)\\n'
    """
    if not values:
        return text

    class Named(cst.CSTTransformer):
        def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
            target = dotted(updated.targets[0].target) if len(updated.targets) == 1 else None
            value = updated.value
            if target in values and isinstance(value, cst.Call) and dotted(value.func) == "ddpkit.prepare_model" \
                    and not any(a.keyword is not None and a.keyword.value == keyword for a in value.args):
                return updated.with_changes(value=add_keyword(value, keyword, values[target]))
            return updated

    return cst.parse_module(text).visit(Named()).code


def loader_call(call: cst.Call, keywords: dict[str, str]) -> cst.Call:
    """``DataLoader(ds, 8, True)`` -> ``ddpkit.data_loader(ds, 8, shuffle=True, **keywords)``: data_loader takes
    the dataset and the batch size by position, the rest by name."""
    args, position = [], 0
    for arg in call.args:
        if arg.keyword is None and not arg.star:
            if position >= 2:
                arg = arg.with_changes(keyword=cst.Name(LOADER_PARAMETERS[position]), equal=_NO_SPACE)
            position += 1
        args.append(arg)
    call = call.with_changes(func=cst.parse_expression("ddpkit.data_loader"), args=args)
    for name, value in keywords.items():
        given = [i for i, a in enumerate(call.args) if a.keyword is not None and a.keyword.value == name]
        if given:  # ``shuffle=None`` said: its value, replaced (a second shuffle= would not run)
            i = given[0]
            call = call.with_changes(args=[*call.args[:i], call.args[i].with_changes(
                value=cst.parse_expression(value)), *call.args[i + 1:]])
        else:
            call = add_keyword(call, name, value)
    return call


def statement(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code if code.endswith("\n") else code + "\n")


class _Rewrite(cst.CSTTransformer):
    def __init__(self, edits: Edits, last_import: cst.CSTNode | None):
        super().__init__()
        self.edits, self.last_import = edits, last_import
        self.elifs: set[int] = set()

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self.elifs.add(id(node.orelse))

    def on_leave(self, original_node: Any, updated_node: Any) -> Any:
        key = id(original_node)
        edits = self.edits
        if key in edits.remove or _emptied(original_node, updated_node, self.elifs):
            # what goes before or after a deleted line stays (``model.features = DataParallel(model.features)``
            # deleted, the wrap placed below it: the wrap was lost with it)
            kept = [statement(code) for code in (*edits.before.get(key, ()), *edits.after.get(key, ()))]
            if not kept:
                return cst.RemoveFromParent()
            kept[0] = kept[0].with_changes(leading_lines=getattr(updated_node, "leading_lines", ()))
            return kept[0] if len(kept) == 1 else cst.FlattenSentinel(kept)
        if key in edits.expr:
            updated_node = edits.expr[key](updated_node)
        if not isinstance(original_node, cst.BaseStatement):
            return updated_node
        out: list[Any] = [updated_node]
        if key in edits.replace:
            out = [statement(code) for code in edits.replace[key]]
            out[0] = out[0].with_changes(leading_lines=updated_node.leading_lines)
            if isinstance(updated_node, cst.SimpleStatementLine):  # its comment: ``device = ...  # GPU if any``
                out[-1] = out[-1].with_changes(trailing_whitespace=updated_node.trailing_whitespace)
        if key in edits.no_grad:
            body = [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(out)]
            out = [cst.With(items=[cst.WithItem(cst.parse_expression("torch.no_grad()"))],
                            body=cst.IndentedBlock(body=body), leading_lines=updated_node.leading_lines)]
        if key in edits.guard:
            body = [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(out)]
            out = [cst.If(test=cst.parse_expression(edits.guard[key]), body=cst.IndentedBlock(body=body),
                          leading_lines=updated_node.leading_lines)]
        out += [statement(code) for code in edits.after.get(key, ())]
        if key in edits.before:
            first = [statement(code) for code in edits.before[key]]
            first[0] = first[0].with_changes(leading_lines=out[0].leading_lines)
            out = first + [out[0].with_changes(leading_lines=()), *out[1:]]
        if original_node is self.last_import:
            out += [statement(code) for code in edits.imports]
        return out[0] if len(out) == 1 else cst.FlattenSentinel(out)


def first_use(module: cst.Module, edits: Edits, defined: set[str]) -> cst.BaseStatement | None:
    """The first top-level statement that runs as the script starts and may need ``ddpkit``: one with an edit in
    it, or a call of the script's own function or class (whose body may have one). ``import ddpkit`` must come
    above it: a notebook exported as a script imports again further down, below its first use."""
    keys = {*edits.expr, *edits.replace, *edits.guard, *edits.after, *edits.before, *edits.no_grad, *edits.remove}

    class Uses(cst.CSTVisitor):
        found = False

        def on_visit(self, node: cst.CSTNode) -> bool:
            calls_own = isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in defined
            self.found |= id(node) in keys or calls_own
            return not self.found

    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        uses = Uses()
        stmt.visit(uses)
        if uses.found:
            return stmt
    return None


def _emptied(original: Any, updated: Any, elifs: set[int]) -> bool:
    """An ``if`` (no ``else``, not an ``elif``) whose every statement was deleted: ``if use_cuda: net =
    nn.DataParallel(net)`` goes as a whole, not as ``if use_cuda: pass``."""
    return isinstance(updated, cst.If) and updated.orelse is None and id(original) not in elifs and \
        isinstance(updated.body, cst.IndentedBlock) and not updated.body.body and bool(original.body.body)


def rewrite(wrapper: MetadataWrapper, edits: Edits, last_import: cst.CSTNode | None = None) -> str:
    """The script's text with ``edits`` made (the ``imports`` go after ``last_import``, or first; put them in
    ``before`` to place them elsewhere)."""
    module = wrapper.module.visit(_Rewrite(edits, last_import))
    if edits.imports and last_import is None:
        module = module.with_changes(body=[*(statement(c) for c in edits.imports), *module.body])
    return module.visit(_Quotes()).code


class _Quotes(cst.CSTTransformer):
    """A string inside an f-string's braces quoted as the f-string is, which Python before 3.12 cannot read
    (``f'loss {ddpkit.reduce(m, op='mean')}'``, an edit's ``op='mean'`` in a notebook's single-quoted print: a
    SyntaxError on 3.11), takes the other quote.

    >>> print(cst.parse_module("print(f'a {f(x, op='b')}')\\n").visit(_Quotes()).code, end="")
    print(f'a {f(x, op="b")}')
    """

    def __init__(self) -> None:
        super().__init__()
        self.quotes: list[str] = []

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        self.quotes.append(node.quote)

    def leave_FormattedString(self, original: cst.FormattedString, updated: cst.FormattedString) -> Any:
        self.quotes.pop()
        return updated

    def leave_SimpleString(self, original: cst.SimpleString, updated: cst.SimpleString) -> Any:
        quote = self.quotes[-1] if self.quotes else None
        other = {"'": '"', '"': "'"}.get(quote or "")
        body = updated.value[len(updated.prefix) + 1:-1]
        if other is None or updated.quote != quote or other in body or "\\" in body:
            return updated
        return updated.with_changes(value=f"{updated.prefix}{other}{body}{other}")
