"""How ``ddpkit convert`` names what a script reads: dotted names of attribute chains, the names an expression
reads, and the script's imports resolved to full names (``nn.Linear`` -> ``torch.nn.Linear``).

:mod:`ddpkit.commands.convert.scan` records every call and binding under these names.

Example::

    >>> aliases, _, _ = import_aliases(cst.parse_module("from torch import nn\\nimport numpy as np\\n"))
    >>> resolve("nn.Linear", aliases), resolve("np.mean", aliases)
    ('torch.nn.Linear', 'numpy.mean')
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m


def unpacked(value: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The elements of a tuple or list (``return train_dl, test_dl``: what ``a, b = f()`` binds one by one), or the
    value alone.

    >>> [dotted(e) for e in unpacked(cst.parse_expression("a, b")) + unpacked(cst.parse_expression("c"))]
    ['a', 'b', 'c']
    """
    return [e.value for e in value.elements] if isinstance(value, (cst.Tuple, cst.List)) else [value]


def dotted(node: cst.CSTNode | None) -> str | None:
    """``torch.cuda.is_available`` for the attribute chain, None for anything else.

    >>> dotted(cst.parse_expression("self.model.fc")), dotted(cst.parse_expression("f().x"))
    ('self.model.fc', None)
    """
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def names_in(node: cst.CSTNode) -> set[str]:
    """Every dotted name (and each of its prefixes) read in an expression: ``enumerate(tqdm(self.loader))``
    reads ``enumerate``, ``tqdm``, ``self`` and ``self.loader``."""
    found: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            name = dotted(node)
            if name:
                found.add(name)
            node.value.visit(self)
            return False  # ``.cuda`` of ``torch.cuda`` is no name of its own

        def visit_Name(self, node: cst.Name) -> None:
            found.add(node.value)

    node.visit(Names())
    return found



def heads(node: cst.CSTNode) -> set[str]:
    """The first name of each dotted name read in an expression (``x.size(0) * self.k``: ``x``, ``self``).

    >>> sorted(heads(cst.parse_expression("x.size(0) * self.k")))
    ['self', 'x']
    """
    return {n.split(".")[0] for n in names_in(node)}

def import_aliases(module: cst.Module) -> tuple[dict[str, str], list[cst.SimpleStatementLine], dict[str, str]]:
    """(local name -> dotted full name, the import lines, modules bound by ``import`` statements: as the script
    spells them -> their full names: ``import pkg.data`` gives ``pkg.data``, ``import pkg.data as d`` ``d``)."""
    aliases: dict[str, str] = {}
    modules: dict[str, str] = {}
    lines = []
    for stmt in module.body:
        if isinstance(stmt, cst.Try):  # ``try: from torch.utils.tensorboard import SummaryWriter`` / ``except``
            _tried(stmt, aliases)
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                lines.append(stmt)
                for alias in small.names:
                    full = dotted(alias.name) or ""
                    local = alias.asname.name.value if alias.asname else full.split(".")[0]  # type: ignore[union-attr]
                    aliases[local] = full if alias.asname else local
                    modules[local if alias.asname else full] = full
            elif isinstance(small, cst.ImportFrom) and isinstance(small.names, cst.ImportStar):
                lines.append(stmt)  # ``from torch.utils.data import *``: the names convert looks for
                module_name = dotted(small.module) or ""
                for name in STARRED.get(module_name, ()):
                    aliases.setdefault(name, f"{module_name}.{name}")
                if not small.relative and module_name.split(".")[0] not in LIBRARIES:  # a module of the project's
                    modules[f"* {module_name}"] = module_name  # (a key no name has: imported_from reads it)
                elif not small.relative:  # a library's: ``tqdm`` of ``from tqdm import *`` is no project name
                    modules[f"** {module_name}"] = module_name
            elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                lines.append(stmt)
                base = "." * len(small.relative) + (dotted(small.module) or "")  # ``from .model import``: kept
                # (a library a module of the project imports and hands on: ``from common import torch, nn``; its
                # classes only beside such a module, a project's own ``DataLoader`` class stays the project's)
                names = {dotted(alias.name) for alias in small.names}
                handing = bool(names & {"torch", "nn", "optim", "F"}) and base.split(".")[0] not in LIBRARIES and \
                    not small.relative
                for alias in small.names:
                    name = dotted(alias.name) or ""
                    local = dotted(alias.asname.name) if alias.asname else name
                    aliases[local or name] = f"{base}.{name}"
                    # (a module, ``np`` or ``plt``, is the library's wherever it is handed on)
                    if name in HANDED_ON and (handing or name in MODULES_HANDED_ON and not small.relative and
                                              base.split(".")[0] not in LIBRARIES):
                        aliases[local or name] = HANDED_ON[name]
                        if name in MODULES_HANDED_ON:
                            modules[local or name] = HANDED_ON[name]
    _nested(module, aliases)
    return aliases, lines, modules


def _nested(module: cst.Module, aliases: dict[str, str]) -> None:
    """Names a library import below the top level binds (``from torchvision.utils import save_image`` inside the
    block that saves, a function's ``import matplotlib.pyplot as plt``; set 27's course lab), where the top level
    binds none of that name: the calls they make are the library's."""
    top = {id(small) for stmt in module.body if isinstance(stmt, cst.SimpleStatementLine) for small in stmt.body}
    # (not a name the file defines itself at its top level: its own ``class DataLoader``, review 42)
    own = {stmt.name.value for stmt in module.body if isinstance(stmt, (cst.ClassDef, cst.FunctionDef))} | \
        {t.target.value for stmt in module.body if isinstance(stmt, cst.SimpleStatementLine) for small in stmt.body
         if isinstance(small, cst.Assign) for t in small.targets if isinstance(t.target, cst.Name)}
    for small in m.findall(module, m.ImportFrom() | m.Import()):
        if id(small) in top or isinstance(small, cst.ImportFrom) and (
                small.relative or isinstance(small.names, cst.ImportStar) or
                (dotted(small.module) or "").split(".")[0] not in LIBRARIES):
            continue
        assert isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar)
        for alias in small.names:
            name = dotted(alias.name) or ""
            if isinstance(small, cst.Import) and alias.asname is None:
                if name.split(".")[0] not in own:
                    aliases.setdefault(name.split(".")[0], name.split(".")[0])
                continue
            local = dotted(alias.asname.name) if alias.asname else name
            base = f"{dotted(small.module)}." if isinstance(small, cst.ImportFrom) else ""
            if (local or name) not in own:
                aliases.setdefault(local or name, f"{base}{name}")


# what a module of the project imports by habit and another imports from it as if from the library
HANDED_ON = {"torch": "torch", "nn": "torch.nn", "optim": "torch.optim", "F": "torch.nn.functional", "np": "numpy",
             "numpy": "numpy", "plt": "matplotlib.pyplot", "DataLoader": "torch.utils.data.DataLoader",
             "Dataset": "torch.utils.data.Dataset", "TensorDataset": "torch.utils.data.TensorDataset",
             "torchvision": "torchvision", "transforms": "torchvision.transforms"}
MODULES_HANDED_ON = ("torch", "nn", "optim", "F", "np", "numpy", "plt", "torchvision", "transforms")


def _tried(stmt: cst.Try, aliases: dict[str, str]) -> None:
    """The names a top-level ``try:`` imports in its body (the import that runs where the package is there), each
    unless the script imports it plainly too; not its import lines (``import ddpkit`` goes below the plain ones,
    never into the ``try``)."""
    body = [s for s in stmt.body.body if isinstance(s, cst.SimpleStatementLine)]
    found, _, _ = import_aliases(cst.Module(body=body))
    for local, full in found.items():
        aliases.setdefault(local, full)


# builtins no project module redefines (``eval``, ``input``, ``compile`` may well be a star-imported helper's)
BUILTINS = frozenset({"enumerate", "len", "range", "zip", "print", "isinstance", "int", "float", "str", "list", "dict",
                      "tuple", "set", "min", "max", "sum", "abs", "sorted", "open", "iter", "next", "getattr",
                      "hasattr", "setattr", "type", "super", "round", "map", "filter", "any", "all", "vars", "bool",
                      "reversed", "object", "Exception", "ValueError", "RuntimeError", "KeyError", "None", "True",
                      "False"})


# what ``from <module> import *`` binds among the names convert reads (torch's modules define ``__all__``)
STARRED = {"torch.utils.data": ("DataLoader", "Dataset", "TensorDataset", "Subset", "ConcatDataset", "random_split",
                                "DistributedSampler", "RandomSampler", "SequentialSampler", "IterableDataset"),
           "torch.optim": ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam",
                           "LBFGS", "SparseAdam", "Rprop", "ASGD", "Adafactor", "Muon"),
           "torch.nn": ("DataParallel", "Module", "Linear", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
           "torch.nn.parallel": ("DataParallel", "DistributedDataParallel", "data_parallel")}

# where a name imported is no module of the script's own project
LIBRARIES = {"torch", "torchvision", "torchaudio", "torchtext", "transformers", "datasets", "numpy", "sklearn",
             "accelerate", "lightning", "pytorch_lightning", "timm", "ddpkit", "tqdm", "matplotlib", "pandas", "PIL",
             "cv2", "albumentations", "scipy", "tensorboardX", "wandb", "yaml", "omegaconf", "hydra",
             # the standard library's modules no project names its own (``code``, ``random``, ``logging``,
             # ``types`` may be a project's package: not listed, so its names are still followed)
             "os", "sys", "math", "time", "re", "argparse", "collections", "itertools", "functools", "pathlib",
             "typing", "pickle", "shutil", "datetime", "subprocess", "warnings", "abc", "dataclasses", "enum",
             "contextlib", "io", "gc", "socket", "threading", "multiprocessing", "tempfile", "heapq", "bisect",
             "operator", "textwrap", "traceback", "uuid", "hashlib", "zipfile", "tarfile", "builtins"}

# torch's modules that define what the package exports: a name imported from one is the package's
# (minGPT's ``from torch.utils.data.dataloader import DataLoader`` is torch.utils.data.DataLoader)
CANONICAL = {"torch.utils.data.dataloader.": "torch.utils.data.", "torch.utils.data.dataset.": "torch.utils.data.",
             "torch.utils.data.sampler.": "torch.utils.data."}


def resolve(name: str | None, aliases: dict[str, str]) -> str | None:
    """``nn.Linear`` -> ``torch.nn.Linear`` when the script did ``from torch import nn``; a name of a defining
    module as the package's (:data:`CANONICAL`).

    >>> resolve("DataLoader", {"DataLoader": "torch.utils.data.dataloader.DataLoader"})
    'torch.utils.data.DataLoader'
    """
    if name is None:
        return None
    head, _, rest = name.partition(".")
    full = aliases.get(head, head)
    full = f"{full}.{rest}" if rest else full
    return next((to + full[len(prefix):] for prefix, to in CANONICAL.items() if full.startswith(prefix)), full)


def measured(node: cst.CSTNode) -> str | None:
    """The name whose size ``node`` reads: X of ``len(X)``, ``X.size(0)``, ``X.shape[0]``; None for anything else.

    >>> [measured(cst.parse_expression(c)) for c in ("len(ds)", "x.size(0)", "batch.x.shape[0]", "n")]
    ['ds', 'x', 'batch.x', None]
    """
    if isinstance(node, cst.Call) and dotted(node.func) == "len" and len(node.args) == 1:
        return dotted(node.args[0].value)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "size":
        return dotted(node.func.value)
    if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Attribute) and node.value.attr.value == "shape":
        return dotted(node.value.value)
    return None
