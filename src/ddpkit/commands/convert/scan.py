"""What ``ddpkit convert`` reads off a script before it changes anything: every call, binding and loop, with
the function (scope), loops, ``if`` tests and ``no_grad`` blocks around it, names resolved through the
script's imports (``DataLoader`` -> ``torch.utils.data.DataLoader``).

The decisions (which binding is the model, whether a loader trains or evaluates) are
:mod:`ddpkit.commands.convert.plan`'s; this module only records. It works on a libcst tree (comments and
formatting kept for the rewrite) and never runs the script.

Example::

    >>> facts = scan(parse("from torch.utils.data import DataLoader\\nfor x in DataLoader(d):\\n    pass\\n"))
    >>> [c.name for c in facts.calls], len(facts.loops)
    (['torch.utils.data.DataLoader'], 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from ddpkit.commands.convert.names import (
    dotted,
    import_aliases,
    names_in,
    resolve,
)

# methods that keep what a loop hands them (a list, a metric object, a meter): their totals are per rank
# ``preds = np.concatenate((preds, out))``: calls that return their arguments joined
JOINING = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "column_stack", "append"})
_ROWS = (cst.List, cst.ListComp, cst.Tuple)  # what ``xs += ...`` extends a list by
ACCUMULATING = ("append", "extend", "add_batch", "update", "add", "accumulate", "record", "push", "insert",
                "update_state", "log", "add_scalar", "add_scalars")


def parse(source: str) -> MetadataWrapper:
    """The script's tree wrapped for positions (``scan`` and the rewrite must share this one wrapper: the
    rewrite finds the scanned nodes by identity)."""
    return MetadataWrapper(cst.parse_module(source))


@dataclasses.dataclass(eq=False)
class Scope:
    """A function (``train``, ``Trainer.run``) or the module (``""``); ``params`` in order, ``self`` included."""

    name: str
    node: cst.CSTNode
    cls: str | None = None
    params: list[str] = dataclasses.field(default_factory=list)
    outer: Scope | None = None  # the function a nested one is defined in (its closure reads that one's names)


@dataclasses.dataclass(eq=False)
class Loop:
    node: cst.For | cst.While
    scope: Scope
    line: int
    end: int  # the loop's last line: what reads a sum after the loop comes below it
    iter_names: set[str]  # dotted names read by a for loop's iterable (``enumerate(train_loader)``: train_loader)
    no_grad: bool
    calls: list[Call] = dataclasses.field(default_factory=list)  # every call in the body, nested loops included
    augmented: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # ``x += value`` targets, lines
    counted: list[str] = dataclasses.field(default_factory=list)  # ``n += 1``: a count of the loop's steps
    outer: list[Loop] = dataclasses.field(default_factory=list)  # the loops around this one, outermost first
    targets: set[str] = dataclasses.field(default_factory=set)  # what ``for i, (x, y) in ...`` binds
    breaks: bool = False  # a ``break`` in its own body: it may end before its loader does
    stored: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # ``m[k] += ...``, ``xs.append()``

    def over_count(self) -> bool:
        """The loop runs over a count (``for epoch in range(n)``, ``trange(n)``), not over data."""
        it = self.node.iter if isinstance(self.node, cst.For) else None
        return isinstance(it, cst.Call) and dotted(it.func) in ("range", "trange", "tqdm.trange")


@dataclasses.dataclass(eq=False)
class Call:
    node: cst.Call
    name: str | None  # dotted, through the imports; None for ``f()()`` and the like
    last: str  # the called attribute or name: ``backward`` in ``scaler.scale(loss).backward()``
    scope: Scope
    line: int
    stmt: cst.SimpleStatementLine | None
    loops: list[Loop]
    tests: list[str]  # the code of every enclosing ``if`` test, outermost first
    no_grad: bool
    loader_class: str | None = None  # a library's DataLoader subclass (PyG's): its name in the script


# DataLoader subclasses of libraries that only bring their own collate: a DataLoader, built with that class's
# collate (``ddpkit.data_loader(..., loader_class=DataLoader)``)
LIBRARY_LOADERS = ("torch_geometric.loader.DataLoader", "torch_geometric.data.DataLoader",
                   "torch_geometric.loader.dataloader.DataLoader")


@dataclasses.dataclass(eq=False)
class Binding:
    """``target = value`` (``value`` None: a parameter, a loop variable or a ``with ... as``)."""

    target: str
    value: cst.BaseExpression | None
    stmt: cst.SimpleStatementLine | None
    scope: Scope
    line: int
    whole: cst.BaseExpression | None = None  # ``a, b = f()``: ``f()``, of which this is element ``index``
    index: int = -1


@dataclasses.dataclass(eq=False)
class Facts:
    module: cst.Module
    aliases: dict[str, str]
    scopes: dict[str, Scope]
    calls: list[Call]
    bindings: list[Binding]
    loops: list[Loop]
    reads: list[tuple[str, Scope, int, Any]]  # every dotted name read: (name, scope, line, the node)
    imports: list[cst.SimpleStatementLine]  # the module's top-level import lines
    returns: list[tuple[Scope, cst.BaseExpression]] = dataclasses.field(default_factory=list)
    statements: list[tuple[cst.SimpleStatementLine, Scope, int]] = dataclasses.field(default_factory=list)
    import_lines: list[int] = dataclasses.field(default_factory=list)
    modules: dict[str, str] = dataclasses.field(default_factory=dict)  # ``import a.b as m``: m -> a.b
    # a project's own top-level modules named like a library (its ``datasets.py``): they shadow it, so followed
    own: frozenset[str] = frozenset()
    exported: dict[str, str] = dataclasses.field(default_factory=dict)  # a package's re-exports (packages.py)
    # the calls that run another module's training step (``engine.train(x, y)``: stepped.py): they train
    steps: set[int] = dataclasses.field(default_factory=set)
    eval_steps: set[int] = dataclasses.field(default_factory=set)  # (``engine.eval(x, y)``: they evaluate)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)


def _joins(value: cst.BaseExpression, name: str) -> bool:
    """``value`` joins ``name`` with more (``torch.cat([name, out])``, ``np.append(name, out)``)."""
    if not isinstance(value, cst.Call) or not isinstance(value.func, (cst.Attribute, cst.Name)):
        return False
    last = value.func.attr.value if isinstance(value.func, cst.Attribute) else value.func.value
    return last in JOINING and any(name in names_in(a.value) for a in value.args)


def _targets(target: cst.BaseExpression) -> Iterator[tuple[str, int]]:
    """Each dotted target of an assignment with its position in a tuple (-1: the whole value)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        for i, element in enumerate(target.elements):
            name = dotted(element.value)
            if name:
                yield name, i
    else:
        name = dotted(target)
        if name:
            yield name, -1


def _element(value: cst.BaseExpression, index: int) -> cst.BaseExpression | None:
    if index < 0:
        return _or_none(value)
    if isinstance(value, (cst.Tuple, cst.List)) and index < len(value.elements):
        return value.elements[index].value
    return None  # ``a, b = f()``: bound, to something this scan cannot follow


def _or_none(value: cst.BaseExpression) -> cst.BaseExpression:
    """``DataLoader(...) if test_set is not None else None`` (BERT-pytorch): the call is what the name is bound to
    (when it is bound to anything: a loop over None never runs); any other value as it is."""
    if isinstance(value, cst.IfExp) and isinstance(value.body, cst.Call) and \
            isinstance(value.orelse, cst.Name) and value.orelse.value == "None":
        return value.body
    return value


class _Scanner(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, facts: Facts):
        super().__init__()
        self.facts = facts
        self.scopes: list[Scope] = [facts.scopes[""]]
        self.classes: list[str] = []
        self.loops: list[Loop] = []
        self.tests: list[str] = []
        self.no_grad = 0
        self.stmt: cst.SimpleStatementLine | None = None
        self.written: set[int] = set()

    def line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    # scopes
    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._bind(node.name.value, None, node)
        self.classes.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.classes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        cls = self.classes[-1] if self.classes and self.scopes[-1].cls is None and len(self.scopes) == 1 else None
        name = f"{cls}.{node.name.value}" if cls else node.name.value
        params = [p.name.value for p in (*node.params.posonly_params, *node.params.params)]
        self._bind(node.name.value, None, node)  # ``def print(...)``: the script's own print
        enclosing = self.scopes[-1] if self.scopes and self.scopes[-1].name and not cls else None
        scope = Scope(name, node, cls, params, enclosing)
        self.facts.scopes.setdefault(name, scope)
        for param in params + [p.name.value for p in node.params.kwonly_params]:
            self.facts.bindings.append(Binding(param, None, None, scope, self.line(node)))
        self.scopes.append(scope)
        self.no_grad += self._no_grad_decorated(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()
        self.no_grad -= self._no_grad_decorated(original_node)

    def _no_grad_decorated(self, node: cst.FunctionDef) -> bool:
        """``@torch.no_grad()`` / ``@torch.inference_mode()`` over the function."""
        names = [resolve(dotted(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator),
                         self.facts.aliases) or "" for d in node.decorators]
        return any(n.endswith(("no_grad", "inference_mode")) for n in names)

    # context
    def visit_If(self, node: cst.If) -> None:
        self.tests.append(self.facts.code(node.test))

    def leave_If(self, original_node: cst.If) -> None:
        self.tests.pop()

    def _no_grad_with(self, node: cst.With) -> bool:
        inside = [(resolve(dotted(i.item.func), self.facts.aliases) or "") if isinstance(i.item, cst.Call) else ""
                  for i in node.items]
        off = any(name.endswith("set_grad_enabled") and isinstance(i.item, cst.Call) and i.item.args and  # (False)
                  isinstance(i.item.args[0].value, cst.Name) and i.item.args[0].value.value == "False"
                  for name, i in zip(inside, node.items))
        return off or any(n.endswith(("no_grad", "inference_mode")) for n in inside)

    def visit_With(self, node: cst.With) -> None:
        self.no_grad += self._no_grad_with(node)
        for item in node.items:
            if item.asname is not None:
                for target, _ in _targets(item.asname.name):  # bound to the context manager (its __enter__)
                    self._bind(target, item.item, node)

    def leave_With(self, original_node: cst.With) -> None:
        self.no_grad -= self._no_grad_with(original_node)

    def visit_For(self, node: cst.For) -> None:
        self._enter_loop(node, names_in(node.iter))
        for name in names_in(node.target):
            self._bind(name, None, node)
        self.loops[-1].targets = names_in(node.target)

    def leave_For(self, original_node: cst.For) -> None:
        self.loops.pop()

    def visit_Break(self, node: cst.Break) -> None:
        if self.loops:
            self.loops[-1].breaks = True

    def visit_While(self, node: cst.While) -> None:
        self._enter_loop(node, set())

    def leave_While(self, original_node: cst.While) -> None:
        self.loops.pop()

    def _enter_loop(self, node: cst.For | cst.While, names: set[str]) -> None:
        where = self.get_metadata(PositionProvider, node)
        loop = Loop(node, self.scopes[-1], where.start.line, where.end.line, names, self.no_grad > 0,
                    outer=[o for o in self.loops if o.scope is self.scopes[-1]])
        self.facts.loops.append(loop)
        self.loops.append(loop)

    # statements
    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.stmt = node
        self.facts.statements.append((node, self.scopes[-1], self.line(node)))
        if node in self.facts.imports:
            self.facts.import_lines.append(self.line(node))

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.stmt = None

    def _written(self, target: cst.CSTNode) -> None:
        """Names an assignment writes are no reads (``loss_sum = 0.0`` after a loop reads nothing)."""
        if isinstance(target, (cst.Name, cst.Attribute)):
            self.written.add(id(target))
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._written(element.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        name = dotted(node.targets[0].target) if len(node.targets) == 1 else None
        value = node.value
        if name and isinstance(value, cst.BinaryOperation) and name in (dotted(value.left), dotted(value.right)):
            other = value.right if dotted(value.left) == name else value.left  # ``total = total + x``: a sum
            for loop in self.loops:
                if isinstance(value.operator, cst.Add) and isinstance(other, cst.Integer):
                    loop.counted.append(name)
                elif isinstance(value.operator, cst.Add):
                    loop.augmented.append((name, self.line(node)))
                else:
                    loop.stored.append((name, self.line(node)))
        if name and _joins(value, name):  # ``preds = np.concatenate((preds, out))``: every batch's results kept
            here = self.line(node)
            last = max((b.line for b in self.facts.bindings if b.target == name and b.scope is self.scopes[-1]
                        and b.line < here), default=None)
            for loop in self.loops:  # into a name bound before the loop (``x = torch.cat([x, x.flip(1)])``: a batch)
                if last is not None and last < loop.line and name not in loop.targets:
                    loop.stored.append((name, here))
        for target in node.targets:
            self._written(target.target)
            for name, index in _targets(target.target):
                self._bind(name, _element(node.value, index))
                self.facts.bindings[-1].whole, self.facts.bindings[-1].index = node.value, index
            self._stored(target.target)

    def visit_Return(self, node: cst.Return) -> None:
        if node.value is not None:
            self.facts.returns.append((self.scopes[-1], node.value))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        name = dotted(node.target)
        if name:  # (``self.train_dataloader: DataLoader = self.load_dataset(...)``: its callers' binding too)
            self._bind(name, node.value)
            self.facts.bindings[-1].whole = node.value

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        name = dotted(node.target)
        self._written(node.target)
        for loop in self.loops:
            if name and isinstance(node.operator, cst.AddAssign) and isinstance(node.value, cst.Integer):
                loop.counted.append(name)
            elif name and isinstance(node.operator, cst.AddAssign) and isinstance(node.value, _ROWS):
                loop.stored.append((name, self.line(node)))  # ``errs += [e]``: rows kept, not a sum (review 41)
            elif name and isinstance(node.operator, cst.AddAssign):
                loop.augmented.append((name, self.line(node)))
            elif name:  # ``x -= ...``, ``x *= ...``: not a sum this tool can reduce
                loop.stored.append((name, self.line(node)))
        self._stored(node.target)

    def _stored(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Subscript):  # ``metrics["loss"] += ...``: kept per rank, in a container
            for loop in self.loops:
                loop.stored.append((self.facts.code(target), self.line(target)))

    def _bind(self, name: str, value: cst.BaseExpression | None, at: cst.CSTNode | None = None) -> None:
        where = at or self.stmt or self.scopes[-1].node
        self.facts.bindings.append(Binding(name, value, self.stmt, self.scopes[-1], self.line(where)))

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) \
            else ""
        name = resolve(dotted(func), self.facts.aliases)
        library = self.facts.code(func) if name in LIBRARY_LOADERS else None
        call = Call(node, "torch.utils.data.DataLoader" if library else name, last, self.scopes[-1], self.line(node),
                    self.stmt, list(self.loops), list(self.tests), self.no_grad > 0, library)
        self.facts.calls.append(call)
        for loop in self.loops:
            loop.calls.append(call)
            if last in ACCUMULATING and isinstance(func, cst.Attribute):  # per-batch results kept in an object
                loop.stored.append((self.facts.code(func.value), call.line))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:  # ``f(batch_size=x.size(0))`` reads no variable ``batch_size``
            self.written.add(id(node.keyword))

    def visit_Name(self, node: cst.Name) -> None:
        if id(node) in self.written:
            return
        self.facts.reads.append((node.value, self.scopes[-1], self.line(node), node))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.written.add(id(node.attr))  # ``x.total`` reads x, not a variable ``total``
        name = dotted(node)
        if name and id(node) not in self.written:
            self.facts.reads.append((name, self.scopes[-1], self.line(node), node))


def scan(wrapper: MetadataWrapper) -> Facts:
    module = wrapper.module
    aliases, imports, modules = import_aliases(module)
    facts = Facts(module, aliases, {"": Scope("", module)}, [], [], [], [], imports, modules=modules)
    wrapper.visit(_Scanner(facts))
    return facts
