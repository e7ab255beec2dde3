"""Tabs in a script's indentation that libcst reads differently from Python (improved-wgan-pytorch's ``12 spaces +
TAB + 4 spaces``, which Python takes to column 20): expanded to spaces as Python reads them, where that changes no
code, so that the converter parses what the interpreter runs."""

from __future__ import annotations

import ast


def expanded(source: str) -> str | None:
    """``source`` with the tabs of each line's indentation expanded as Python reads them (to the next multiple of
    8), where that changes no string and no code (the syntax trees compared); None where it would, or there are none.

    >>> expanded("if x:\\n        if y:\\n    \\t    z = 1\\n")
    'if x:\\n        if y:\\n            z = 1\\n'
    """
    out = []
    for line in source.splitlines(keepends=True):
        body = line.lstrip(" \t")
        indent = line[:len(line) - len(body)]
        out.append(indent.expandtabs(8) + body if "\t" in indent else line)
    expanded = "".join(out)
    if expanded == source:
        return None
    try:
        same = ast.dump(ast.parse(expanded)) == ast.dump(ast.parse(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return expanded if same else None
