"""The house rule (docs/architecture.md): layers as folders, imports one way, no cycles, not even behind a
function-level import. Every ``import`` statement counts, wherever it stands (a function body, ``if
TYPE_CHECKING:``), except the package facade's lazy exports, which name modules as strings."""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "ddpkit"
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

# bottom to top; a module may import its own layer and the layers before it
LAYERS = ["core", "strategies", "runtime", "data", "checkpoint", "verbs", "launcher", "commands", "facade"]
VERBS = {"ddpkit.model", "ddpkit.output", "ddpkit.precision", "ddpkit.strategy"}
# inside commands/: a command's folder may import another command's folder only here (convert runs check's
# analysis on its result and reads check's rule tables); the one-file modules beside the folders import none
COMMAND_USES = {"convert": {"check"}}


def command_folder(module: str, folders: set[str]) -> str | None:
    """The command folder a module is in: ``ddpkit.commands.verify.hooks`` -> verify; None outside one."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "commands" and parts[2] in folders else None


def command_folders(root: pathlib.Path) -> set[str]:
    """The sub-packages of ``commands/`` (one per command with parts)."""
    return {p.parent.name for p in (root / "commands").glob("*/__init__.py")}


def crossings(edges: dict[str, set[str]], folders: set[str]) -> list[str]:
    """Imports between command folders that COMMAND_USES does not allow, and imports of a folder from outside any
    (the modules beside the folders)."""
    out = []
    for a, targets in edges.items():
        for b in targets:
            fa, fb = command_folder(a, folders), command_folder(b, folders)
            if fb is not None and fa != fb and fb not in COMMAND_USES.get(fa or "", set()):
                out.append(f"{a} imports {b}")
    return sorted(out)


def layer(module: str) -> str:
    """The layer of a module: ``ddpkit.data.streams`` -> data, ``ddpkit.model`` -> verbs, ``ddpkit`` -> facade."""
    if module in VERBS:
        return "verbs"
    if module in ("ddpkit", "ddpkit.__main__"):
        return "facade"
    return module.split(".")[1]


def modules(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join((package, *parts))
        found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The known modules ``name`` imports, with ``from pkg import mod`` resolved to the module."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` imports a.b.c; an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name and not (name == package and target == package):
                out.add(target)
    return out


def graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
    known = modules(root, package)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    # importing a package's submodule runs the package's __init__ first: a real edge only when it imports
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's members (Tarjan's strongly connected components of more than one module, or a self-loop)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_a_layer_above_its_own():
    edges = graph(SRC, "ddpkit")
    upward = sorted(f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, targets in edges.items() for b in targets
                    if b.startswith("ddpkit") and LAYERS.index(layer(b)) > LAYERS.index(layer(a)))
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("root,package", [(SRC, "ddpkit"), (BENCHMARKS, "benchmarks")])
def test_no_import_cycle_even_behind_a_function_level_import(root, package):
    edges = graph(root, package)
    if package == "benchmarks":  # the benchmarks import each other by their bare names (a scripts folder)
        bare = {name.split(".")[-1]: name for name in edges}
        for path_name, path in modules(root, package).items():
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                edges[path_name] |= {bare[n] for n in names if n in bare and bare[n] != path_name}
    assert not cycles(edges), cycles(edges)


def test_a_command_folder_imports_no_other_command_folder_but_the_known_ones():
    folders = command_folders(SRC)
    assert folders == {"convert", "check", "verify", "bench", "plan"}, folders
    bad = crossings(graph(SRC, "ddpkit"), folders)
    assert not bad, "\n".join(bad)
    for folder in folders:  # a folder's __init__ is a docstring: importing one part loads no other
        body = ast.parse((SRC / "commands" / folder / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"commands/{folder}/__init__.py"


def test_every_module_is_in_a_layer():
    unknown = sorted(name for name in modules(SRC, "ddpkit") if layer(name) not in LAYERS)
    assert not unknown, f"modules outside the layers of docs/architecture.md: {unknown}"


def test_the_bottom_layer_does_not_import_torch_at_module_level():
    heavy = []
    for name, path in modules(SRC, "ddpkit").items():
        if layer(name) != "core":
            continue
        for node in ast.parse(path.read_text()).body:  # module level only: a function may load torch when asked
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            heavy += [f"{name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not heavy, heavy


def test_the_exit_codes_are_defined_once():
    defined = []
    for name, path in modules(SRC, "ddpkit").items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                defined += [(t.id, name) for t in node.targets if isinstance(t, ast.Name)
                            and t.id in ("SCRIPT_FAILED", "USAGE_ERROR", "HANG", "NOT_EQUIVALENT", "CANNOT_COMPARE")]
    assert {module for _, module in defined} == {"ddpkit.core.errors"}, defined


def test_a_planted_upward_import_and_cycle_are_caught(tmp_path):
    """The checks can fail: a core module importing a command, and two modules importing each other."""
    pkg = tmp_path / "ddpkit"
    (pkg / "core").mkdir(parents=True)
    (pkg / "commands").mkdir()
    for folder in (pkg, pkg / "core", pkg / "commands"):
        (folder / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ddpkit.commands import b\n")
    (pkg / "commands" / "b.py").write_text("from ddpkit.core import a\n")
    edges = graph(pkg, "ddpkit")
    assert "ddpkit.commands.b" in edges["ddpkit.core.a"]
    assert cycles(edges) == [["ddpkit.commands.b", "ddpkit.core.a"]]


def test_a_planted_import_between_command_folders_is_caught(tmp_path):
    """verify's part importing bench's part, and the CLI importing a part, are caught; convert -> check is not."""
    pkg = tmp_path / "ddpkit"
    for folder in ("verify", "bench", "convert", "check"):
        (pkg / "commands" / folder).mkdir(parents=True)
        (pkg / "commands" / folder / "__init__.py").write_text('"""docstring"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "commands" / "bench" / "stats.py").write_text("")
    (pkg / "commands" / "check" / "rules.py").write_text("")
    (pkg / "commands" / "verify" / "hooks.py").write_text("def f():\n    from ddpkit.commands.bench import stats\n")
    (pkg / "commands" / "convert" / "rules.py").write_text("from ddpkit.commands.check.rules import X\n")
    (pkg / "commands" / "cli.py").write_text("import ddpkit.commands.verify.hooks\n")
    bad = crossings(graph(pkg, "ddpkit"), command_folders(pkg))
    assert bad == ["ddpkit.commands.cli imports ddpkit.commands.verify.hooks",
                   "ddpkit.commands.verify.hooks imports ddpkit.commands.bench.stats"], bad
