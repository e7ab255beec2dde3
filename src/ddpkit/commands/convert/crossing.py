"""Names that cross the modules of a project: the model and the training loader that one file trains with and
another builds, at module level (a course's ``Arch/model.py``: ``model = Net()``; ``Data/data.py``: ``train_loader
= DataLoader(...)``; ``train.py``: ``from Arch.model import model`` and the loop).

A file's plan asks for what it cannot convert itself (:class:`Ask`: ``model`` of ``Arch.model`` is a model,
``train_loader`` of ``Data.data`` a training loader); :func:`settle` hands each ask to the file of that module,
whose plan then converts the name where it is built (:class:`Crossing` ``wants``), and tells the asking file what
was done there (``provided``), so that it says so instead of leaving it to the user. Only module-level names of
the project's own files; a loader a function of such a module returns (``train_loader, test_loader = get_loaders(64)``)
is asked as that function's return value (:func:`returned`). A name imported from a library stays left to you.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> files = {"model.py": "import torch\\nnet = torch.nn.Linear(2, 2)\\n",
    ...          "train.py": "import torch\\nfrom model import net\\nopt = torch.optim.SGD(net.parameters(), lr=1)\\n"}
    >>> done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    >>> done["model.py"].text.splitlines()[-1], done["train.py"].left
    ('net = ddpkit.prepare_model(torch.nn.Linear(2, 2))', [])
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from ddpkit.commands.convert.constants import odd_numbers
from ddpkit.commands.convert.packages import absolute, exports, package_of
from ddpkit.commands.convert.project import local

MODEL, TRAIN, EVAL = "model", "training loader", "evaluation loader"
NOT_PASSED = "not converted"  # ``done`` of a file that calls a trainer asking for its loader, and did not convert it
HANDED = "a loader handed in"  # an Ask's name: a training loop over a parameter fed from another module
# an Ask's name's head: an optimizer over a parameter of ``function`` (``a model handed in:train_model:0``), which
# the files that import this one and call it pass; their wants name it ``module.function:index``
HANDED_MODEL = "a model handed in"
# an Ask's name's head: a function or method of this file that runs a training step on what its callers hand it
# (``a training step:Engine.train``); the files that import this one and call it in a loop name it
# ``module:a training step:Engine.train``, and answer done when that loop reads a training ddpkit.data_loader
STEP = "a training step"
# an Ask's kind: an argument of a function of the asked module (a loader's factory) that the asking file's training
# loop reads too (handsize.py); its want names the asking file last, for the line said there
SIZED = "a batch size read"
# an Ask's kind: two functions of the asked module the asking file calls, and whether it may run the second after
# the first (a save, then a load: calledorder.py); its want names the asking file last
ORDER = "an order of calls"


@dataclasses.dataclass(frozen=True)
class Ask:
    """The asking file's line ``line`` needs ``name`` of module ``module`` (dotted, as imported) converted as a
    ``kind`` (:data:`MODEL`, :data:`TRAIN`; :data:`EVAL`: read by a loop that does not train, to stay as it
    is, said so there) where it is built."""
    module: str
    name: str
    kind: str
    line: int


@dataclasses.dataclass
class Crossing:
    """For one file's plan: ``wants``, its module-level names other files need converted (name -> kind);
    ``provided``, the imported names converted in their own module (:func:`key` -> that file)."""
    wants: dict[str, str] = dataclasses.field(default_factory=dict)
    provided: dict[str, str] = dataclasses.field(default_factory=dict)
    own: frozenset[str] = frozenset()  # the project's top-level module names (its ``datasets.py`` is its own)
    imported: bool = False  # another file of the project imports this one: its ``__main__`` block is a demo
    package: str = ""  # the file's package (``bert_pytorch.trainer``): what its relative imports start from
    exported: dict[str, str] = dataclasses.field(default_factory=dict)  # packages' re-exports (:mod:`.packages`)
    modules: frozenset[str] = frozenset()  # the project's modules by dotted name (``pkg.data``, ``pkg`` of its init)
    # the names the project's other files write (a function none of them names is called by none); None: not read
    elsewhere: frozenset[str] | None = None
    others: tuple[frozenset[str], ...] | None = None  # each other file's names (one that names two functions)
    seeded: frozenset[str] = frozenset()  # the project's modules that seed torch's generator (:mod:`.seeded`)
    twice: str = ""  # a file of the project that differentiates a model's output twice (:mod:`.gradpen`)
    # the project's functions that return ddpkit's device once converted (``utils.get_device``: plan.Plan.devices)
    devices: frozenset[str] = frozenset()
    # the classes of the project's other modules that sum a loss over the batch (``loss.YoloLoss``: :func:`summing`)
    summed: frozenset[str] = frozenset()
    # a module this file imports builds a training loader told what its loss averages over (``batch_count=``)
    counted: bool = False
    # the project's files beside this one (importing it, imported by it, or imported by one file with it) that read a
    # file with ``torch.load``: what this file saves, they may read next (:func:`.waits.loaded_elsewhere`)
    loads: frozenset[str] = frozenset()
    # odd whole numbers the modules this file imports set at their top level (:mod:`.constants`), the names it reads
    odd: dict[str, int] = dataclasses.field(default_factory=dict)


def settle(files: list[str], convert: Callable[[str, Crossing | None], Any],
           root_outer: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every file's plan (``convert(rel, crossing)``), with the asks between them settled: each file of a module
    asked for converts the names asked, then the asking files are told which were, until nothing changes (a
    solver's loader handed in is asked of the entry that builds the solver, which asks the data module that
    builds the loader: each answer is a round). ``files``: paths relative to the project's root, ``/``-separated;
    ``root_outer``: the package paths of the root (:func:`.project.outer`), under which a file may import its
    neighbours."""
    own = frozenset(rel.split("/")[0].removesuffix(".py") for rel in files)
    own |= frozenset(o.split(".")[0] for o in root_outer)  # (``from pkg.common import f`` inside pkg/: its own)
    modules = frozenset(rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in files)
    base = {rel: Crossing(own=own, package=package_of(rel), modules=modules) for rel in files}
    plans = {rel: convert(rel, base[rel]) for rel in files}
    sources = {rel: getattr(result, "source", "") for rel, result in plans.items()}
    exported = exports(sources)
    names = {rel: _names_in(source) for rel, source in sources.items()}
    for rel in files:  # (a package's ``__init__.py`` re-exports a module's name: read through it)
        # (a model's loss method, which another file may call: :func:`.methods.loss_methods` names it then)
        if exported or getattr(plans[rel], "left", None) or getattr(plans[rel], "kept", None) or \
                LOSS_METHOD.search(sources[rel]) and "prepare_model" in getattr(plans[rel], "text", "") or \
                any(a.name.startswith(HANDED_MODEL) or a.kind == ORDER for a in getattr(plans[rel], "asks", ())):
            others = tuple(n for other, n in names.items() if other != rel)
            base[rel] = dataclasses.replace(base[rel], exported=exported, elsewhere=frozenset().union(*others),
                                            others=others)
            plans[rel] = convert(rel, base[rel])

    def module_file_of(module: str) -> str | None:
        return module_file(files, local(module, root_outer, lambda m: module_file(files, m) is not None))

    def imported(rel: str, source: str) -> set[str]:
        return {local(m, root_outer, lambda m: module_file(files, m) is not None)
                for m in _imported(source, package_of(rel), exported)}

    # (a module that seeds torch's generator, and imports this one or is imported by it: a settings module seeding
    # at import, or the main script seeding before it calls this module's training function; its noise is drawn
    # alike on every rank)
    seeding = {rel for rel, source in sources.items() if SEEDING.search(source)}
    loading = {rel for rel, source in sources.items() if "torch.load(" in source}
    uses = {rel: set(filter(None, map(module_file_of, imported(rel, sources[rel])))) for rel in sources}
    twice = next((rel for rel, source in sources.items() if "create_graph=True" in source), "")
    devices = {rel: frozenset(f"{rel[:-3].replace('/', '.')}.{f}" for f in getattr(result, "devices", ()))
               for rel, result in plans.items()}
    for rel in files:
        # (or both imported by one module: main.py calls utils.seed_all(0), then gan.py's training; review 30)
        linked = [s for s in seeding if s != rel and (rel in uses[s] or s in uses[rel] or
                                                      any(rel in used and s in used for used in uses.values()))]
        seeded = frozenset(s[:-3].replace("/", ".") for s in linked) if "rand" in sources[rel] else frozenset()
        told = twice if twice != rel and "prepare_model" in getattr(plans[rel], "text", "") else ""
        sums = frozenset(c for other in uses[rel] for c in summing(sources.get(other, ""), other))
        # (set 26's fix in data.py: told in the builder this file calls, not anywhere in the module: review 41)
        counts = any(name == "*" or name in names[rel] for other in uses[rel] for name in counting(sources[other]))
        # (``device = utils.get_device()``, which utils.py's conversion makes ddpkit's: not refused as unread)
        returning = frozenset().union(*(d for other, d in devices.items() if other != rel)) \
            if getattr(plans[rel], "left", None) else frozenset()
        # (a save at the end of train_part.train(), then eval_part.evaluate() loads it, both called by main.py)
        loads = frozenset(r for r in loading if r != rel and (rel in uses[r] or r in uses[rel] or any(
            rel in used and r in used for used in uses.values()))) if "torch.save" in sources[rel] else frozenset()
        # (set 29's ``batch_size = 1`` of settings.py, read through ``from settings import *``)
        odd = {k: v for other in uses[rel] for k, v in odd_numbers(sources[other], other).items()
               if k.rsplit(".", 1)[-1] in names[rel]} if "DataLoader" in sources[rel] else {}
        if seeded or told or returning or sums or counts or loads or odd:
            base[rel] = dataclasses.replace(base[rel], seeded=seeded, twice=told, devices=returning, summed=sums,
                                            counted=counts, loads=loads, odd=odd)
            plans[rel] = convert(rel, base[rel])

    for rel, result in plans.items():  # a module another file imports: its ``if __name__ == "__main__"`` is a demo
        for target in filter(None, map(module_file_of, imported(rel, getattr(result, "source", "")))):
            if target != rel and not base[target].imported:
                base[target] = dataclasses.replace(base[target], imported=True)
                plans[target] = convert(target, base[target])
    given = dict(base)
    for _ in range(ROUNDS):
        crossings = _crossings(plans, module_file_of, imported, base)
        changed = [rel for rel in files if crossings.get(rel, base[rel]) != given[rel]]
        if not changed:
            break
        for rel in changed:
            given[rel] = crossings.get(rel, base[rel])
            plans[rel] = convert(rel, given[rel])
    return plans


# torch's generator seeded: ``torch.manual_seed(0)``, ``seed_everything(0)``; not a generator of the script's own
# (``torch.Generator().manual_seed(0)``, ``g.manual_seed(0)``: set 27's synthetic data, said to seed every rank alike)
SEEDING = re.compile(r"\btorch\.(cuda\.)?manual_seed(_all)?\(|(?<![.\w])manual_seed\(|\bseed_everything\(")
LOSS_METHOD = re.compile(r"def \w*(loss|criterion)\w*\(\s*self\b")
ROUNDS = 8  # asks answered in turn: a loader handed to a solver, built by the entry from a data module, takes five


def _crossings(plans: dict[str, Any], module_file_of: Callable[[str], str | None],
               imported: Callable[[str, str], set[str]], base: dict[str, Crossing]) -> dict[str, Crossing]:
    """What each file is asked for and told, from the plans as they are now."""
    wants: dict[str, dict[str, str]] = {}
    asked: dict[str, list[tuple[str, Ask, str]]] = {}  # the file asked -> (asking file, its ask, the want)
    for rel, result in plans.items():
        for ask in getattr(result, "asks", ()):
            want = _handed_want(rel, ask)
            if want is not None:  # a model or a loader handed in: asked of every file that imports this one
                for other, p in plans.items():
                    if other != rel and rel[:-3].replace("/", ".") in imported(other, getattr(p, "source", "")):
                        kind = MODEL if ask.name.startswith(HANDED_MODEL) else ask.kind
                        if wants.setdefault(other, {}).get(want) != TRAIN:  # trained on there and evaluated: TRAIN
                            wants[other][want] = kind
                        asked.setdefault(other, []).append((rel, ask, want))
                continue
            target = module_file_of(ask.module) if ask.name != HANDED else None
            if target is not None and target != rel and ask.kind in (SIZED, ORDER):
                want = json.dumps([*json.loads(ask.name), rel])
                wants.setdefault(target, {})[want] = ask.kind
                asked.setdefault(target, []).append((rel, ask, want))
            elif target is not None and target != rel:
                names = wants.setdefault(target, {})
                if names.get(ask.name) != TRAIN:  # one file trains on it, another evaluates: a training loader
                    names[ask.name] = ask.kind
                asked.setdefault(target, []).append((rel, ask, ask.name))
    provided: dict[str, dict[str, str]] = {}
    handed: dict[tuple[str, str], list[bool]] = {}  # (a file fed by its callers, by what): each caller's answer
    for target, triples in asked.items():
        for rel, ask, want in triples:
            done = want in plans[target].done
            fed = key("", HANDED) if ask.name.startswith(f"{HANDED}:") else \
                key("", ask.name) if ask.name.startswith(f"{STEP}:") else None
            if fed is not None and ask.kind == TRAIN:  # said fed when every caller converted it
                if done or f"{want} {NOT_PASSED}" in plans[target].done:  # (a file that only imports it: no say)
                    handed.setdefault((rel, fed), []).append(done)
                if done:
                    provided.setdefault(rel, {}).setdefault(fed, target)
            elif done:
                provided.setdefault(rel, {})[key(ask.module, ask.name)] = target
    for (rel, fed), answers in handed.items():
        if not all(answers):  # a caller that hands in a list of batches, or what it does not convert
            provided.get(rel, {}).pop(fed, None)
    return {rel: dataclasses.replace(base[rel], wants=wants.get(rel, {}), provided=provided.get(rel, {}))
            for rel in set(wants) | set(provided)}


def _handed_want(rel: str, ask: Ask) -> str | None:
    """What a caller of ``rel``'s function is asked for a training step it runs (:data:`STEP`:
    ``engine:a training step:Engine.train``), for a model handed in (``trainer.train_model:0=model``: the model it
    passes as argument 0 or ``model=``), or for a training loader handed in (``solver:Solver.__init__:0:loader``:
    what it passes to ``Solver(...)`` as argument 0 or ``loader=``); None for
    another ask.

    >>> _handed_want("solver.py", Ask("", f"{HANDED}:Solver.__init__:0:loader", TRAIN, 9))
    'solver:Solver.__init__:0:loader'
    """
    module = rel[:-3].replace("/", ".")
    if ask.name.startswith(f"{STEP}:"):  # (``engine:a training step:Engine.train``)
        return f"{module}:{ask.name}"
    if ask.name.startswith(f"{HANDED}:"):
        return f"{module}:{ask.name.split(':', 1)[1]}"
    if not ask.name.startswith(f"{HANDED_MODEL}:"):
        return None
    function, index = ask.name.split(":")[1:]
    return f"{module}.{function}:{index}"


@dataclasses.dataclass(frozen=True)
class Want:
    """A want of a caller's file read back: a training step it runs (``engine:a training step:Engine.train``), or
    what it hands a function (``trainer:train:1:train_loader``: argument 1, or ``train_loader=``)."""
    module: str
    function: str
    step: bool
    index: int = -1
    param: str = ""


def want_of(want: str) -> Want | None:
    """The :class:`Want` a want names; None for another kind of want (a module's name, a model handed in, a JSON
    ask).

    >>> want_of("engine:a training step:Engine.train").function, want_of("trainer:train:1:loader").param
    ('Engine.train', 'loader')
    >>> want_of("get_loaders()[0]") is None
    True
    """
    module, _, rest = want.partition(":")
    if rest.startswith(f"{STEP}:"):
        return Want(module, rest[len(STEP) + 1:], True)
    parts = want.split(":")
    if len(parts) == 4 and parts[2].isdigit():
        return Want(parts[0], parts[1], False, int(parts[2]), parts[3])
    return None


def key(module: str, name: str) -> str:
    """How ``provided`` names a module's name: ``Arch.model:model`` (two modules may both build a ``model``)."""
    return f"{module}:{name}"


def _imported(source: str, package: str = "", exported: dict[str, str] | None = None) -> set[str]:
    """Every module a file imports by name (``import a.b``, ``from a import b``: ``a``, ``a.b``; ``from .m import
    x`` in ``package``: ``package.m``, ``package.m.x``), and where a package's ``__init__.py`` takes a name from
    (``exported``: ``pkg.X`` -> ``pkg.mod.X`` adds ``pkg.mod``); also one named by a string to
    ``importlib.import_module`` (a sweep that runs ``train.main()`` again and again).

    >>> sorted(_imported("import importlib\\nrun = importlib.import_module('train')\\n"))
    ['importlib', 'train']
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node.module or "", node.level, package) if node.level else node.module
            if module:
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)
            elif node.level == 1 and not package:  # ``from . import data`` at the root
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and _dynamic(node.func):  # (a sweep's ``import_module("train")``)
            found.add(node.args[0].value.removesuffix(".py").replace("/", "."))
    for name, source in (exported or {}).items():  # (a package imported runs its init, which imports these)
        if name in found or name.rpartition(".")[0] in found:
            found.update({source.rpartition(".")[0], source})
    return found


def _dynamic(func: ast.expr) -> bool:
    """A call that imports a module named by a string: ``importlib.import_module``, ``__import__`` (not runpy's
    ``run_path(..., run_name="__main__")``, which runs the file's main block as its own training)."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in ("import_module", "__import__")


def summing(source: str, rel: str) -> frozenset[str]:
    """The classes of module ``rel`` whose code sums a loss over the batch (``nn.MSELoss(reduction="sum")``, the old
    ``size_average=False``) and divides nothing (YOLO's loss.py: ``self.mse = nn.MSELoss(reduction="sum")``, its
    terms added up): ``module.Class``, as the files importing it read it.

    >>> sorted(summing("import torch.nn as nn\\nclass L(nn.Module):\\n    def __init__(self):\\n"
    ...                "        self.f = nn.MSELoss(reduction='sum')\\n", "pkg/loss.py"))
    ['pkg.loss.L']
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return frozenset()
    found = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call)]
        summed = any(isinstance(k.value, ast.Constant) and (k.arg == "reduction" and k.value.value == "sum" or
                                                              k.arg == "size_average" and k.value.value is False)
                     for c in calls for k in c.keywords)
        divides = any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.FloorDiv)) for n in ast.walk(cls)) \
            or any(isinstance(c.func, ast.Attribute) and c.func.attr in ("div", "div_", "true_divide", "mean")
                   for c in calls)  # (``.div(pred.size(0))``: review 40)
        if summed and not divides:
            found.add(f"{rel[:-3].replace('/', '.')}.{cls.name}")
    return frozenset(found)


def counting(source: str) -> frozenset[str]:
    """The module's top-level functions and classes that build a loader told what its loss averages over
    (``ddpkit.data_loader(..., batch_count=...)``); ``*`` where the module builds one at its top level. A comment or
    an unrelated keyword of that name tells nothing.

    >>> sorted(counting("import ddpkit\\ndef lm(ds):\\n    return ddpkit.data_loader(ds, batch_count=len)\\n"
    ...                 "def plain(ds):  # batch_count= some day\\n    return ddpkit.data_loader(ds)\\n"))
    ['lm']
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()

    def tells(node: ast.AST) -> bool:
        return any(isinstance(c, ast.Call) and (isinstance(c.func, ast.Attribute) and c.func.attr == "data_loader" or
                                                isinstance(c.func, ast.Name) and c.func.id == "data_loader")
                   and any(k.arg in ("count", "batch_count") for k in c.keywords) for c in ast.walk(node))
    defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    found = {n.name for n in tree.body if isinstance(n, defined) and tells(n)}
    for _ in range(3):  # (a builder that hands off to a helper of its module that tells: review 42)
        found |= {n.name for n in tree.body if isinstance(n, defined) and any(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in found for c in ast.walk(n))}
    if any(not isinstance(n, defined) and tells(n) for n in tree.body):
        found.add("*")
    return frozenset(found)


def _names_in(source: str) -> frozenset[str]:
    """Every name and attribute a file reads or writes (``init_optim``, ``self.fit``: ``fit``), and what it imports
    under another name."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # (``from m import fit as f``: a use of ``f`` is one of ``fit``; a name imported and never used is no call)
    found |= {a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names if a.asname}
    return frozenset(found)


def returned(function: str, index: int) -> str:
    """How an ask names what a function returns: ``get_loaders()[0]`` (element 0 of a returned tuple), ``get()``.

    >>> returned("get_loaders", 0), returned("get", -1)
    ('get_loaders()[0]', 'get()')
    """
    return f"{function}()" + (f"[{index}]" if index >= 0 else "")


def module_file(files: list[str], module: str) -> str | None:
    """The project file of a dotted module name (``Arch.model`` -> ``Arch/model.py``), or None.

    >>> module_file(["train.py", "Arch/model.py"], "Arch.model"), module_file(["train.py"], "torch.nn")
    ('Arch/model.py', None)
    >>> module_file(["main.py", "datasets/__init__.py"], "datasets")  # (a package's own functions: its init)
    'datasets/__init__.py'
    """
    path = module.replace(".", "/")
    return next((p for p in (path + ".py", path + "/__init__.py") if p in files), None)
