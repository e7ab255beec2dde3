"""Odd whole numbers a project's module sets once at its top level (a settings file's ``batch_size = 1``): a file
that imports such a name and hands it to its training loader as the batch size keeps that batch per process, as a
literal odd batch is kept (a global batch of 1 or 9 splits over no even number of processes: the converted script
would stop at its first loader).

Example::

    >>> odd_numbers("batch_size = 1\\nepochs = 4\\nlr = 0.1\\nn = 3\\nn = 5\\n", "cfg/settings.py")
    {'cfg.settings.batch_size': 1}
"""

from __future__ import annotations

import ast


def odd_numbers(source: str, rel: str) -> dict[str, int]:
    """``module.name`` -> value for each top-level name of module ``rel`` bound once, to an odd integer literal
    (``name = 9``, ``name: int = 9``); a name bound twice, or to anything else, is no constant."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}
    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
    bound: dict[str, list[ast.expr | None]] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    bound.setdefault(name.id, []).append(value if target is name else None)
    return {f"{module}.{name}": values[0].value for name, values in bound.items()
            if len(values) == 1 and isinstance(values[0], ast.Constant) and type(values[0].value) is int and
            values[0].value % 2}
