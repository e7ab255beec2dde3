"""Several files converted as one project: ``ddpkit convert DIR`` (every ``.py`` file under it) or
``ddpkit convert --imports train.py`` (the script and the modules of its folder that it imports, and theirs: a
minGPT-style project whose ``Trainer`` lives in ``mingpt/trainer.py``).

Each file is converted as a script is (:func:`~ddpkit.commands.convert.command.convert_file`): ``ddpkit.init()``
goes where that file chooses its device (a second call returns the same state), ``prepare_model`` where its
optimizer's model is, the loaders where they are built. Nothing is written unless every file converts: one
refused file leaves the whole project as it was. ``-o OUT`` is then a directory that receives every file of the
project at its relative path (changed or not, so its imports resolve there); ``--write`` rewrites the changed files
in place.

Example::

    $ ddpkit convert --imports chargpt.py -o converted/     # chargpt.py, mingpt/trainer.py, mingpt/model.py, ...
    $ ddpkit launch --nproc-per-node 2 converted/chargpt.py
"""

from __future__ import annotations

import ast
import os
import shutil
import sys
from collections.abc import Callable, Iterator

from ddpkit.core.errors import UsageError

# folders under a project that hold no code of its own
SKIP = {"__pycache__", "node_modules", "site-packages", "build", "dist", "venv", "env"}
LIMIT_FILES = 500  # a directory of more .py files is no training project (a checkout of a library?)
# what ``-o OUT`` copies beside the converted files (configs, small data): a dataset is left where it is
COPY_FILE_BYTES = 16 << 20
COPY_TOTAL_BYTES = 256 << 20


def files_of(target: str, imports: bool) -> tuple[str, list[str]]:
    """(the project's root folder, its files relative to it, the entry script first when there is one).

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "pkg").mkdir()
    >>> _ = (root / "train.py").write_text("from pkg.trainer import Trainer\\nimport helpers, os\\n")
    >>> _ = (root / "pkg" / "__init__.py").write_text(""); _ = (root / "helpers.py").write_text("")
    >>> _ = (root / "pkg" / "trainer.py").write_text("from .model import GPT\\n")
    >>> _ = (root / "pkg" / "model.py").write_text("import torch\\n")
    >>> files_of(str(root / "train.py"), imports=True)[1]
    ['train.py', 'helpers.py', 'pkg/__init__.py', 'pkg/model.py', 'pkg/trainer.py']
    """
    if os.path.isdir(target):
        root = os.path.abspath(target)
        found = sorted(_walk(root))
        if not found:
            raise UsageError(f"{target} holds no .py file; expected a folder of training code or a script")
    else:
        root = os.path.dirname(os.path.abspath(target))
        entry = os.path.basename(target)
        wider = _put_on_path(root, entry) if imports else None
        wider = wider or (_package_parent(root, entry) if imports else None)
        if wider is not None:  # (AGCRN's model/Run.py puts the repository on sys.path for ``lib.dataloader``)
            root, entry = wider, os.path.relpath(os.path.abspath(target), wider).replace(os.sep, "/")
        found = [entry, *sorted(_imported(root, entry) - {entry})] if imports else [entry]
    if len(found) > LIMIT_FILES:
        raise UsageError(f"{target} holds {len(found)} .py files, more than {LIMIT_FILES}; convert the training "
                         "script with --imports (it and the modules it imports), not the whole tree")
    return root, found


def _package_parent(root: str, entry: str) -> str | None:
    """The folder above the package ``entry`` belongs to when it imports relatively (``from .data import
    get_loader`` in ``src/train.py``, run as ``python -m src.train``): the project's root, so that the converted
    package keeps its folder and its ``__init__.py`` (set 27's extra five: written flat, its imports failed)."""
    try:
        with open(os.path.join(root, entry), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    if not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)) or \
            not os.path.exists(os.path.join(root, "__init__.py")):
        return None
    # (an entry that also imports a module of its folder by its plain name, ``import utils``, runs as a script
    # there too: a dual-mode ``try: from .data ... except ImportError: from data ...``; review 43)
    plain = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    if any(_has_module(root, name) for name in plain if name):
        return None
    top = root
    while os.path.exists(os.path.join(os.path.dirname(top), "__init__.py")) and os.path.dirname(top) != top:
        top = os.path.dirname(top)
    return os.path.dirname(top)


def _put_on_path(root: str, entry: str) -> str | None:
    """The folder above the script's (up to two levels) that it puts on ``sys.path`` to import modules its own
    folder lacks (``sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))`` then ``from
    lib.dataloader import get_dataloader``), or None: the project's root is then that folder.

    >>> import tempfile, pathlib
    >>> top = pathlib.Path(tempfile.mkdtemp()); (top / "model").mkdir(); (top / "lib").mkdir()
    >>> _ = (top / "lib" / "data.py").write_text("")
    >>> _ = (top / "model" / "run.py").write_text("import sys\\nsys.path.append('..')\\nfrom lib.data import get\\n")
    >>> _put_on_path(str(top / "model"), "run.py") == str(top)
    True
    """
    try:
        with open(os.path.join(root, entry), "rb") as f:
            source = f.read()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if b"sys.path" not in source:
        return None
    heads = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    heads |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    missing = {h for h in heads if h not in sys.stdlib_module_names and not _has_module(root, h)}
    above = root
    for _ in range(2):
        above = os.path.dirname(above)
        if any(_has_module(above, h) for h in missing):
            return above
    return None


def _has_module(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, f"{name}.py")) or os.path.isfile(os.path.join(folder, name,
                                                                                              "__init__.py")) or \
        os.path.isdir(os.path.join(folder, name)) and any(n.endswith(".py") for n in os.listdir(os.path.join(folder,
                                                                                                            name)))


def _walk(root: str) -> Iterator[str]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP)
        for name in names:
            if name.endswith(".py") and not os.path.islink(os.path.join(folder, name)):
                yield os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")


def _imported(root: str, entry: str) -> set[str]:
    """Every file under ``root`` that ``entry`` imports, and those import, ... (relative paths)."""
    seen, todo = {entry}, [entry]
    while todo and len(seen) <= LIMIT_FILES:
        current = todo.pop()
        for name in _imports_of(root, current):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _imports_of(root: str, rel: str) -> Iterator[str]:
    """The project files one file imports (``import a.b``, ``from a import b``, ``from .m import x``)."""
    try:
        with open(os.path.join(root, rel), "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return  # read again by the converter, which says why in one line
    package = rel.rsplit("/", 1)[0].split("/") if "/" in rel else []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _module_files(root, alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            base = (package[:len(package) - node.level + 1] if node.level else []) + \
                (node.module.split(".") if node.module else [])
            if node.level > len(package) + 1:
                continue
            yield from _module_files(root, base)
            for alias in node.names:  # from pkg import module
                yield from _module_files(root, [*base, alias.name])


def outer(root: str) -> tuple[str, ...]:
    """The dotted names under which a script may import its own folder's modules by package path, longest first:
    TCN's ``mnist_pixel/pmnist_test.py`` puts the repository's root on ``sys.path`` and writes ``from
    TCN.mnist_pixel.utils import data_generator`` for its neighbour ``utils.py``.

    >>> outer("/src/TCN/mnist_pixel")
    ('src.TCN.mnist_pixel', 'TCN.mnist_pixel', 'mnist_pixel')
    """
    folders = [part for part in os.path.abspath(root).split(os.sep) if part.isidentifier()][-3:]
    return tuple(".".join(folders[i:]) for i in range(len(folders)))


def local(module: str, root_outer: tuple[str, ...], exists: Callable[[str], bool]) -> str:
    """``module`` as the project names it: without the package path of the script's own folder (:func:`outer`)
    when what is left is a file of the project (``exists``: its dotted name -> whether it is one); else as it is
    (``torch.utils.data`` stays a library module even beside a ``data.py``).

    >>> local("TCN.mnist_pixel.utils", ("TCN.mnist_pixel", "mnist_pixel"), lambda m: m == "utils")
    'utils'
    >>> local("torch.utils", ("torch",), lambda m: False)
    'torch.utils'
    """
    for prefix in root_outer:
        rest = module[len(prefix) + 1:]
        if module.startswith(prefix + ".") and rest and exists(rest):
            return rest
    return module


def localize(text: str, root_outer: tuple[str, ...], files: list[str]) -> tuple[str, list[int]]:
    """``text`` with its imports of the project's own modules through the package path of the script's folder
    written as the folder's own (``from TCN.mnist_pixel.utils import x`` -> ``from utils import x``; ``from
    TCN.mnist_pixel import utils`` -> ``import utils``): a copy written elsewhere (``-o OUT``) has no ``TCN``
    package around it, and inside the repository it would import the original, unconverted module; (the text,
    the lines changed).

    >>> localize("import os\\nfrom TCN.pix.utils import get\\nfrom TCN.pix import model as m\\n",
    ...          ("TCN.pix", "pix"), ["train.py", "utils.py", "model.py"])
    ('import os\\nfrom utils import get\\nimport model as m\\n', [2, 3])
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return text, []
    edits = []
    for node in ast.walk(tree):  # (an import inside a function too; over several lines: the whole statement)
        new = _local_import(node, root_outer, files) if isinstance(node, (ast.Import, ast.ImportFrom)) else None
        if new is not None and isinstance(node, (ast.Import, ast.ImportFrom)):
            edits.append((node.lineno, node.col_offset, node.end_lineno or node.lineno, node.end_col_offset or 0, new))
    lines = text.splitlines(keepends=True)
    for start, col, end, end_col, new in sorted(edits, reverse=True):
        head, tail = lines[start - 1][:col], lines[end - 1][end_col:]
        lines[start - 1:end] = [head + new + tail]
    return "".join(lines), sorted(e[0] for e in edits)


def _local_import(node: ast.AST, root_outer: tuple[str, ...], files: list[str]) -> str | None:
    """The import statement ``node`` written with the folder's own module names, or None when it needs none."""
    def mine(module: str) -> str:
        return local(module, root_outer, lambda m: _in(files, m))

    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        if mine(node.module) != node.module:
            return f"from {mine(node.module)} import {names}"
        if node.module in root_outer and all(_in(files, a.name) for a in node.names):
            return f"import {names}"
    if isinstance(node, ast.Import) and all(a.asname for a in node.names if mine(a.name) != a.name) and \
            any(mine(a.name) != a.name for a in node.names):  # ``import TCN.pix.utils as u``
        return "import " + ", ".join(mine(a.name) + (f" as {a.asname}" if a.asname else "") for a in node.names)
    return None


def _in(files: list[str], module: str) -> bool:
    return module.replace(".", "/") + ".py" in files or module.replace(".", "/") + "/__init__.py" in files


def _module_files(root: str, parts: list[str]) -> Iterator[str]:
    """The file of module ``parts`` under ``root``, with the packages' ``__init__.py`` on the way; a module of
    ``root`` imported by its package path (:func:`outer`) too."""
    name = local(".".join(parts), outer(root), lambda m: _module_file(root, m.split(".")) is not None)
    parts = name.split(".") if name != ".".join(parts) else parts
    for i in range(1, len(parts) + 1):
        init = "/".join(parts[:i]) + "/__init__.py"
        if os.path.isfile(os.path.join(root, init)):
            yield init
    module = _module_file(root, parts)
    if module is not None:
        yield module


def _module_file(root: str, parts: list[str]) -> str | None:
    module = "/".join(parts) + ".py"
    return module if parts and os.path.isfile(os.path.join(root, module)) else None


def moved_file_paths(root: str, out: str, sources: dict[str, str]) -> list[str]:
    """The converted copy written at another depth than the project (``-o ddp_out`` inside it): a file that makes
    paths from its own ``__file__`` (``dirname(dirname(abspath(__file__)))``, the data two folders up) finds
    other folders there. Said, once, with the file and the fix.

    >>> moved_file_paths("/p/src", "/p/src/out", {"data.py": "r = dirname(dirname(__file__))\\n"})[0][:46]
    'data.py makes paths from __file__ (line 1), an'
    """
    depth = os.path.realpath(out).rstrip(os.sep).count(os.sep)
    if depth == os.path.realpath(root).rstrip(os.sep).count(os.sep):  # (beside the project: ``-o ../src_ddp``)
        return []
    for rel, source in sorted(sources.items()):
        line = next((n for n, text in enumerate(source.splitlines(), 1) if "__file__" in text and (
                     text.count("dirname") > 1 or ".parent.parent" in text or "'..'" in text or '".."' in text)),
                    None)  # (one that climbs out of the file's own folder: ``dirname(dirname(abspath(__file__)))``)
        if line is not None:
            beside = os.path.realpath(root) + "_ddp"
            return [f"{rel} makes paths from __file__ (line {line}), and {out} is not at the depth of {root}: the "
                    f"paths it makes there name other folders; write the copy beside the project (-o {beside}), or "
                    "link what it reads"]
    return []


def companions(root: str, files: list[str], out: str) -> tuple[int, list[str]]:
    r"""Copy the project's other files (a JSON config, a vocabulary, a small data folder) from ``root`` into ``out``
    at their relative paths, so that the converted project runs there as the original ran in ``root``: (how many
    were copied, what was not, with why). Not copied: a file over 16 MiB or past 256 MiB in all (a dataset: link
    or copy it yourself), a ``.py`` file the conversion did not read (code that trains would run unconverted: an
    ImportError says more than a silent single-process run), links, hidden and build folders, ``out`` itself.

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp()); (root / "cfg").mkdir()
    >>> _ = (root / "train.py").write_text("import json\n"); _ = (root / "cfg" / "a.json").write_text("{}")
    >>> _ = (root / "other.py").write_text("")
    >>> companions(str(root), ["train.py"], str(root / "out"))
    (1, ['other.py (a .py file the conversion did not read)'])
    """
    out_real, total, copied, skipped = os.path.realpath(out), 0, 0, []
    if out_real == os.path.realpath(root):  # written in place: its other files are there already
        return 0, []
    converted = set(files)
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP
                         and os.path.realpath(os.path.join(folder, d)) != out_real)
        for name in sorted(names):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel in converted or os.path.islink(path) or name.endswith((".pyc", ".pyo")):
                continue
            if not os.path.isfile(path):  # a named pipe, a socket: reading it could block, or mean nothing here
                skipped.append(f"{rel} (not a regular file)")
                continue
            size = os.path.getsize(path)
            why = "a .py file the conversion did not read" if name.endswith(".py") else \
                f"{size >> 20} MiB" if size > COPY_FILE_BYTES else \
                f"past {COPY_TOTAL_BYTES >> 20} MiB copied in all" if total + size > COPY_TOTAL_BYTES else None
            if why:
                skipped.append(f"{rel} ({why})")
                continue
            target = os.path.join(out, rel)
            if os.path.exists(target) and os.path.samefile(path, target):
                continue
            try:  # one file that cannot be copied is said, not an error: the converted files are written
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(path, target)
            except OSError as exc:
                skipped.append(f"{rel} ({exc.strerror or exc.__class__.__name__})")
                continue
            total, copied = total + size, copied + 1
    return copied, skipped

