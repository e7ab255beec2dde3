"""A project's modules by their full dotted names: relative imports (``from .trainer import BERTTrainer``) read
from the importing file's package, and names a package's ``__init__.py`` re-exports (``from .pretrain import
BERTTrainer``) followed to the module that defines them.

BERT-pytorch's ``bert_pytorch/__main__.py`` builds its loaders and hands them to ``BERTTrainer``, which it imports
as ``from .trainer import BERTTrainer``; the class lives in ``bert_pytorch/trainer/pretrain.py``. Without this the
trainer's file never learns that its caller made the training loader a ``ddpkit.data_loader``.

Example::

    >>> absolute("trainer", 1, "bert_pytorch"), absolute("model", 2, "bert_pytorch.trainer"), absolute("", 3, "a")
    ('bert_pytorch.trainer', 'bert_pytorch.model', None)
    >>> exports({"pkg/__init__.py": "from .pretrain import Trainer as T\\nimport os\\n"})
    {'pkg.T': 'pkg.pretrain.Trainer'}
"""

from __future__ import annotations

import ast
import re

# how many ``__init__.py`` re-exports one name is followed through (``a.X`` -> ``a.b.X`` -> ``a.b.c.X``)
HOPS = 4


def package_of(rel: str) -> str:
    """The dotted package of a project file (its folder): ``bert_pytorch/trainer/pretrain.py`` ->
    ``bert_pytorch.trainer``; a package's ``__init__.py`` is its package's own.

    >>> package_of("bert_pytorch/trainer/pretrain.py"), package_of("train.py")
    ('bert_pytorch.trainer', '')
    """
    return ".".join(rel.split("/")[:-1])


def absolute(module: str, level: int, package: str) -> str | None:
    """The full name of ``from <level dots><module> import ...`` written in ``package``; None when the dots climb
    above the project's root or name nothing (``from . import x`` at the root: then ``x`` itself is the module)."""
    parts = package.split(".") if package else []
    if level - 1 > len(parts):
        return None
    found = ".".join([*parts[:len(parts) - level + 1], *([module] if module else [])])
    return found or None


def exports(sources: dict[str, str]) -> dict[str, str]:
    """``package.Name`` -> ``package.module.Name`` for every name a package's ``__init__.py`` imports at its top
    level from another module (relative or by its full name), followed through nested re-exports; and
    ``*module.Name`` for each name a module star-imported by any file defines (which of two stars gives it)."""
    found: dict[str, str] = {}
    for rel, source in sources.items():
        if not rel.endswith("__init__.py"):
            continue
        package = package_of(rel)
        for node in _top_imports(source):
            base = absolute(node.module or "", node.level, package) if node.level else node.module
            if not base or not package:
                continue
            for alias in node.names:
                if alias.name != "*":
                    found[f"{package}.{alias.asname or alias.name}"] = f"{base}.{alias.name}"
                for name in _defined(sources, base) if alias.name == "*" else ():  # (``from .loop import *``)
                    found.setdefault(f"{package}.{name}", f"{base}.{name}")
    for rel, source in sources.items():  # (``from helpers import *`` beside another star: which defines what)
        for node in _top_imports(source):
            base = absolute(node.module or "", node.level, package_of(rel)) if node.level else node.module
            if base and any(alias.name == "*" for alias in node.names):
                for name in _defined(sources, base):
                    found.setdefault(f"*{base}.{name}", f"{base}.{name}")
    for name in list(found):
        for _ in range(HOPS):  # (``a.X`` -> ``a.b.X``, which ``a/b/__init__.py`` takes from ``a.b.c``)
            if found[name] not in found or found[found[name]] == found[name]:
                break
            found[name] = found[found[name]]
    return found


def _defined(sources: dict[str, str], module: str) -> list[str]:
    """The public names a project module defines at its top level (a class, a function, an assignment), what
    ``from module import *`` binds (its ``__all__`` is not read: a star import of a project module is rare)."""
    source = sources.get(module.replace(".", "/") + ".py")
    try:
        tree = ast.parse(source) if source is not None else None
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    found = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))] \
        if tree is not None else []
    found += [t.id for n in (tree.body if tree is not None else []) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)]
    return [n for n in found if not n.startswith("_")]


def _top_imports(source: str) -> list[ast.ImportFrom]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    return [node for node in tree.body if isinstance(node, ast.ImportFrom)]


def full_name(written: str, package: str, exported: dict[str, str]) -> str:
    """An alias as ``scan`` records it (``.trainer.BERTTrainer`` for ``from .trainer import BERTTrainer``;
    ``..BERT`` for ``from .. import BERT``) as the project's full name, through the re-exports.

    >>> full_name(".trainer.BERTTrainer", "bert_pytorch", {"bert_pytorch.trainer.BERTTrainer": "x.y.BERTTrainer"})
    'x.y.BERTTrainer'
    >>> full_name("..vocab", "pkg.data", {}), full_name("torch.nn.Linear", "pkg", {}), full_name("...x", "", {})
    ('pkg.data.vocab', 'torch.nn.Linear', '...x')
    """
    name = written
    head = re.match(r"\.+", written)
    if head is not None:
        rest = written[head.end():]
        module, _, last = rest.rpartition(".")
        # scan writes ``<dots><module>.<name>``: a bare ``<dots>.<name>`` has one dot more than the import's level
        level = head.end() if module else head.end() - 1
        base = absolute(module, level, package)
        if base is None and not module and level == 1 and not package:
            return last  # ``from . import x`` at the root: ``x``
        if base is None:
            return written
        name = f"{base}.{last}"
    return exported.get(name, name)
