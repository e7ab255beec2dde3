"""What file a path expression of the script can name, as far as its text tells: the fixed start and end of each
value it may take. Two paths in folders that cannot be one name different files, so a read of the one need not
wait for a write of the other (a GAN lesson's loss figure ``'results/train_hist.png'`` against the frames it
reads back from a sub-folder, ``'results/Fixed_results/frame_' + str(e + 1) + '.png'``). File names are not
compared: a write's name may change before the read (``np.save`` adds ``.npy``, a temporary file is renamed).

A path is followed through ``+``, f-strings, ``os.path.join``, a name bound once before its use, and a parameter
(what each call of its function passes, or its default); anything else is a piece that may be any text. What
cannot be told stays "maybe the same file": the caller then waits, as before.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("def show(path='h.png'):\\n    savefig(path)\\nshow(path='r/hist.png')\\n"
    ...                    "for e in range(3):\\n    imread('r/frames/f' + str(e) + '.png')\\n"))
    >>> write, read = facts.calls[0], next(c for c in facts.calls if c.name == "imread")
    >>> maybe_same(facts, write, first_path(write), read, first_path(read))
    False
"""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.scan import Call, Facts, Scope

DEPTH = 3  # names and parameters followed from one path: a script's paths are built in a line or two


@dataclasses.dataclass(frozen=True)
class Shape:
    """The text a path starts and ends with; ``exact``: the whole path, when it is a fixed string."""
    start: str = ""
    end: str = ""
    exact: str | None = None


ANY = Shape()


def first_path(call: Call) -> cst.BaseExpression | None:
    """The path a write or read call is given: its first positional argument (``fp=`` / ``path=`` by name)."""
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    named = [a.value for a in call.node.args if a.keyword is not None and
             a.keyword.value in ("fname", "fp", "file", "path", "path_or_buf", "filepath_or_buffer", "uri")]
    return positional[0] if positional else named[0] if named else None


def maybe_same(facts: Facts, write: Call, written: cst.BaseExpression | None, read: Call,
               reading: cst.BaseExpression | None) -> bool:
    """Whether the read may open the file the write writes (True unless their shapes cannot agree)."""
    if written is None or reading is None:
        return True
    ones = shapes(facts, written, write.scope, write.line)
    others = shapes(facts, reading, read.scope, read.line)
    # ``open(p, 'w')`` then ``open(q)`` or another reader: an opened file's name is the one given, and no name
    # changes before the read unless the script renames a file (the SSD tutorial's ``TRAIN_images.json`` written,
    # ``test.txt`` read; SparseTSF's ``result.txt`` appended, a ``.../checkpoint.pth`` loaded: false waits)
    # (nor does torch.save's: it writes the name it is given, ``last.pth`` saved is no ``best.pth`` read)
    named = (write.name in OPENERS or write.name == "torch.save" and isinstance(
        written, (cst.SimpleString, cst.FormattedString))) and not any(c.name in RENAMES for c in facts.calls)
    return any(_agree(a, b) and (not named or _same_end(a, b)) for a in ones for b in others)


OPENERS = ("open", "io.open", "builtins.open")
RENAMES = ("os.rename", "os.replace", "shutil.move", "shutil.copy", "shutil.copyfile", "shutil.copy2")


def _same_end(a: Shape, b: Shape) -> bool:
    """Whether two shapes' known ends (their files' names, as far as known) may be one name."""
    ea = _plain(a.exact) if a.exact is not None else a.end
    eb = _plain(b.exact) if b.exact is not None else b.end
    return ea.endswith(eb) or eb.endswith(ea)


def shapes(facts: Facts, node: cst.BaseExpression, scope: Scope, line: int, depth: int = 0) -> list[Shape]:
    """Every shape ``node`` may take at ``line`` of ``scope``."""
    if isinstance(node, cst.SimpleString) and isinstance(node.evaluated_value, str):
        text = _plain(node.evaluated_value)
        return [Shape(text, text, text)]
    if isinstance(node, cst.FormattedString):
        parts = node.parts
        start = parts[0].value if parts and isinstance(parts[0], cst.FormattedStringText) else ""
        end = parts[-1].value if parts and isinstance(parts[-1], cst.FormattedStringText) else ""
        exact = _plain(start) if len(parts) == 1 and start else None
        return [Shape(_plain(start), end, exact)]
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
        return _joined(facts, [node.left, node.right], scope, line, depth, "")
    if isinstance(node, cst.Call) and dotted(node.func) in ("os.path.join", "path.join", "join") and node.args:
        return _joined(facts, [a.value for a in node.args], scope, line, depth, "/")
    name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
    if name is None or depth >= DEPTH:
        return [ANY]
    return _named(facts, name, scope, line, depth)


def _named(facts: Facts, name: str, scope: Scope, line: int, depth: int) -> list[Shape]:
    bound = flow.binding_of(facts, name, scope, line)
    if bound is None:
        return [ANY]
    if bound.value is not None:  # (every value it was given there: ``save_dir = 'debug/'`` under an ``if`` too)
        values = [b for b in facts.bindings if b.target == name and b.scope is bound.scope and b.line <= bound.line]
        if any(b.value is None for b in values):
            return [ANY]
        # (none found: a binding of another scope's, ``self.best_path`` set in ``__init__``: anything)
        return [s for b in values if b.value is not None for s in shapes(facts, b.value, b.scope, b.line, depth + 1)] \
            or [ANY]
    if bound.stmt is not None or name not in scope.params:
        return [ANY]  # (``for name in ...``, ``with ... as name``: anything)
    found: list[Shape] = []  # a parameter: what each call passes, or its default
    sites = flow.callers(facts, scope)
    skip = 1 if scope.cls and scope.params[:1] == ["self"] else 0
    if any(a.star for site in sites for a in site.node.args):
        return [ANY]  # (``show(**cfg)``: it may pass anything)
    for site in sites:
        passed = flow.argument_for(site, name, scope, skip)
        found += shapes(facts, passed, site.scope, site.line, depth + 1) if passed is not None else \
            _default(facts, scope, name, depth)
    return found or [ANY]


def _default(facts: Facts, scope: Scope, name: str, depth: int) -> list[Shape]:
    node = scope.node
    params = node.params.params if isinstance(node, cst.FunctionDef) else ()
    default = next((p.default for p in params if p.name.value == name and p.default is not None), None)
    return shapes(facts, default, scope, 0, depth + 1) if default is not None else [ANY]


def _joined(facts: Facts, pieces: list[cst.BaseExpression], scope: Scope, line: int, depth: int,
            sep: str) -> list[Shape]:
    found = [Shape("", "", "")]
    for i, piece in enumerate(pieces):
        options = shapes(facts, piece, scope, line, depth + 1)[:8]  # (a few values each: enough to tell files)
        found = [_then(a, b, sep if i else "") for a in found for b in options][:32]
    return found


def _then(a: Shape, b: Shape, sep: str) -> Shape:
    """``a`` followed by ``sep`` and ``b``."""
    if a.exact is not None and b.exact is not None:
        whole = a.exact + sep + b.exact
        return Shape(whole, whole, whole)
    start = a.exact + sep + b.start if a.exact is not None else a.start
    end = a.end + sep + b.exact if b.exact is not None else b.end
    return Shape(start, end, None)


def _agree(a: Shape, b: Shape) -> bool:
    """Whether two shapes may name one file. Only folders tell them apart: a file's own name may change between
    its write and its read (``np.save('w')`` writes ``w.npy``; a save to ``p + '.tmp'`` renamed to ``p``), its
    folder does not. Apart: folders known to differ (``runs/`` and ``res/``), or one a sub-folder of the other's
    exact folder (``results/hist.png`` and ``results/frames/...``)."""
    da, db = _folder(a), _folder(b)
    if not (da.startswith(db) or db.startswith(da)):
        return False
    deeper = db.startswith(da) and len(db) > len(da) and a.exact is not None or \
        da.startswith(db) and len(da) > len(db) and b.exact is not None
    return not deeper


def _folder(shape: Shape) -> str:
    """The folder a shape's file is in, as far as its known start goes (``results/frames/`` of
    ``results/frames/f`` + anything: at least that deep; exact for an exact path)."""
    text = _plain(shape.exact if shape.exact is not None else shape.start)
    return text[:text.rfind("/") + 1]


def _plain(text: str) -> str:
    """``./results/x``, ``results//x`` (``os.path.join('results/', 'x')``) and ``results/./x`` name ``results/x``.

    >>> _plain("./results//./x.png")
    'results/x.png'
    """
    while "//" in text or "/./" in text:
        text = text.replace("//", "/").replace("/./", "/")
    while text.startswith("./"):
        text = text[2:]
    return text


def path_open(facts: Facts, call: Call) -> bool:
    """``path.open("a")`` of pathlib (set 27's CSV history logger, ``self.path.open("a", newline="")``): a path
    made by ``Path(...)``, or a name that says it is one (``csv_path``, ``self.path``)."""
    func = call.node.func
    if call.last != "open" or not isinstance(func, cst.Attribute) or call.name in OPENERS:
        return False
    base = dotted(func.value) or ""
    made = [b.value for b in facts.bindings if base and b.target == base and b.value is not None]
    calls = [c for v in made for c in m.findall(v, m.Call()) if isinstance(c, cst.Call)]
    if isinstance(func.value, cst.Call):
        calls.append(func.value)
    return any((resolve(dotted(c.func), facts.aliases) or "").endswith("Path") for c in calls) or \
        "path" in base.rsplit(".", 1)[-1].lower()
