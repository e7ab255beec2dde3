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
from collections.abc import Sequence

# the calls that write a file (a mode that writes is checked for ``open``)
WRITES = {"save", "savefig", "save_image", "imwrite", "imsave", "mimsave", "to_csv", "to_json", "dump", "savez",
          "savetxt", "copyfile", "write_text", "write_bytes"}
LIMIT = 1 << 20  # a module larger than this is not read here (converting it together reads it)


def writers(script: str, modules: list[str], source: str) -> list[str]:
    """One sentence per name the script uses that a module of ``modules`` (paths relative to the script's folder)
    defines at its top level with a file write inside; [] when none."""
    stems = {part for rel in modules for part in rel[:-3].replace("\\", "/").split("/")}
    used, any_class = _names(source, stems)
    root = os.path.dirname(os.path.abspath(script))
    trees = [(rel, _tree(os.path.join(root, rel))) for rel in modules]
    defined = [(rel, node) for rel, tree in trees for node in (tree.body if tree is not None else [])
               if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    used |= {node.name for _, node in defined if any_class and isinstance(node, ast.ClassDef)}
    used |= _bases(defined, used)
    found = []
    for rel, node in defined:
        if node.name in used:
            write = next((c for c in ast.walk(node) if isinstance(c, ast.Call) and _writes(c)), None)
            if write is not None:
                what = "open(..., 'w')" if _name(write) == "open" else f"{_name(write)}(...)"
                what = f"open(..., {_mode(write)!r})" if _name(write) == "open" else what
                found.append(f"{node.name} ({rel}:{write.lineno}, {what}) writes a file from a module this "
                             "conversion does not read: every rank would write it")
    return found


def _bases(defined: Sequence[tuple[str, ast.stmt]], used: set[str]) -> set[str]:
    """The classes of the modules that a used class of theirs derives from, at any depth (``class GCN(BasicModule)``
    whose base's ``save()`` writes the checkpoint: ``model.save()`` runs the base's)."""
    classes = {node.name: node for _, node in defined if isinstance(node, ast.ClassDef)}
    found: set[str] = set()
    todo = [name for name in used if name in classes]
    while todo:
        for base in classes[todo.pop()].bases:
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if name in classes and name not in found | used:
                found.add(name)
                todo.append(name)
    return found


def _tree(path: str) -> ast.Module | None:
    try:
        if os.path.getsize(path) > LIMIT:
            return None
        with open(path, "rb") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _names(source: str, stems: set[str]) -> tuple[set[str], bool]:
    """The names the script reads (``getattr(models, 'Net')``'s text among them), and whether it picks a class of an
    imported module by a name it computes (``getattr(models, opt.model)``: any class of the modules may be the
    model)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set(), False
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
                if a.name.split(".")[-1] in stems}  # (``getattr(args, k)``, torch's ``optim``: no project module)
    picks = [n.args[1] for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and
             n.func.id == "getattr" and len(n.args) >= 2 and getattr(n.args[0], "id", None) in imported]
    named = {p.value for p in picks if isinstance(p, ast.Constant) and isinstance(p.value, str)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | named, \
        any(not isinstance(p, ast.Constant) for p in picks)


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
