"""A script converted alone (``ddpkit convert train.py``) that calls what a module of its folder defines and that
module writes files (RAdam's ``Logger(path)`` in utils/logger.py, randomized smoothing's ``log(filename, text)``):
the conversion does not read that module, so its writes stay every rank's. Said, with the fix: ``--imports``.

Example::

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (root / "utils.py").write_text("def log(p, t):\\n    f = open(p, 'a')\\n    f.write(t)\\n")
    >>> _ = (root / "train.py").write_text("from utils import log\\nlog('log.txt', 'x')\\n")
    >>> writers(str(root / "train.py"), ["utils.py"], (root / "train.py").read_text())[0][:60]
    "log (utils.py:2, open(..., 'a')) writes a file from a module"
"""

from __future__ import annotations

import ast
import os

# the calls that write a file (a mode that writes is checked for ``open``)
WRITES = {"save", "savefig", "save_image", "imwrite", "imsave", "mimsave", "to_csv", "to_json", "dump", "savez",
          "savetxt", "copyfile", "write_text", "write_bytes"}
LIMIT = 1 << 20  # a module larger than this is not read here (converting it together reads it)


def writers(script: str, modules: list[str], source: str) -> list[str]:
    """One sentence per name the script uses that a module of ``modules`` (paths relative to the script's folder)
    defines at its top level with a file write inside; [] when none."""
    used = _names(source)
    root = os.path.dirname(os.path.abspath(script))
    found = []
    for rel in modules:
        tree = _tree(os.path.join(root, rel))
        for node in tree.body if tree is not None else []:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name not in used:
                continue
            write = next((c for c in ast.walk(node) if isinstance(c, ast.Call) and _writes(c)), None)
            if write is not None:
                what = "open(..., 'w')" if _name(write) == "open" else f"{_name(write)}(...)"
                what = f"open(..., {_mode(write)!r})" if _name(write) == "open" else what
                found.append(f"{node.name} ({rel}:{write.lineno}, {what}) writes a file from a module this "
                             "conversion does not read: every rank would write it")
    return found


def _tree(path: str) -> ast.Module | None:
    try:
        if os.path.getsize(path) > LIMIT:
            return None
        with open(path, "rb") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _names(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def _name(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")


def _mode(call: ast.Call) -> str:
    given = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return given.value if isinstance(given, ast.Constant) and isinstance(given.value, str) else "r"


def _writes(call: ast.Call) -> bool:
    name = _name(call)
    if name == "open":
        return any(c in _mode(call) for c in "wax")
    return name in WRITES and not (name in ("dump", "save") and not call.args)
