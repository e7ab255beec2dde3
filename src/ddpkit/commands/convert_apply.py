"""The rewrite of ``ddpkit convert``: the plan's edits applied to the scanned libcst tree, which keeps every
comment, blank line and quote the plan does not touch.

Edits find their node by identity (the node the scan saw), so the scan and the rewrite share one
:class:`libcst.metadata.MetadataWrapper`. An edit is a function of the node as already rewritten below it
(a ``print`` inside a rewritten ``if`` is rewritten too).

Example::

    >>> from ddpkit.commands.convert_scan import parse
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


@dataclasses.dataclass
class Edits:
    expr: dict[int, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)  # node -> new node
    replace: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements (code)
    guard: dict[int, str] = dataclasses.field(default_factory=dict)  # statement -> ``if <test>:`` around it
    after: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements after it
    before: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # statement -> statements before it
    imports: list[str] = dataclasses.field(default_factory=list)  # lines after the module's last import

    def __bool__(self) -> bool:
        return bool(self.expr or self.replace or self.guard or self.after or self.before)


def statement(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code if code.endswith("\n") else code + "\n")


class _Rewrite(cst.CSTTransformer):
    def __init__(self, edits: Edits, last_import: cst.CSTNode | None):
        super().__init__()
        self.edits, self.last_import = edits, last_import

    def on_leave(self, original_node: Any, updated_node: Any) -> Any:
        key = id(original_node)
        edits = self.edits
        if key in edits.expr:
            updated_node = edits.expr[key](updated_node)
        if not isinstance(original_node, cst.BaseStatement):
            return updated_node
        out: list[Any] = [updated_node]
        if key in edits.replace:
            out = [statement(code) for code in edits.replace[key]]
            out[0] = out[0].with_changes(leading_lines=updated_node.leading_lines)
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


def rewrite(wrapper: MetadataWrapper, edits: Edits, last_import: cst.CSTNode | None = None) -> str:
    """The script's text with ``edits`` made (the ``imports`` go after ``last_import``, or first)."""
    module = wrapper.module.visit(_Rewrite(edits, last_import))
    if edits.imports and last_import is None:
        module = module.with_changes(body=[*(statement(c) for c in edits.imports), *module.body])
    return module.code
