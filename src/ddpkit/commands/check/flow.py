"""Where values and data go in a script, for ``ddpkit check``'s metric rule (DDP018): which names hold a value
reduced over ranks, from which line on, and which loaders surely do not shard.

A reduction reduces a name only where its result lands, or in place for torch.distributed's own calls:
``n = ddpkit.reduce(n)`` and ``dist.all_reduce(t)`` reduce ``n`` and ``t``; ``ddpkit.reduce(n)`` alone (its
result dropped) reduces nothing. A value computed from a reduced name is reduced too, from its line on.

>>> src = "import ddpkit\\nc = 1\\nddpkit.reduce(c)\\nt = ddpkit.reduce(c)\\nu = t + 1"
>>> r = Reductions(ast.parse(src)); [(n, r.at(n, None, 9)) for n in ("c", "t", "u")]
[('c', False), ('t', True), ('u', True)]
"""

from __future__ import annotations

import ast
from collections import defaultdict

from ddpkit.commands.check.syntax import Visitor, aliases, kw, last, mentions_rank, name, resolved

REDUCTIONS = {"all_reduce", "reduce", "all_gather", "gather", "all_gather_object", "gather_object", "reduce_scatter"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
Scope = ast.AST | None  # the innermost function around a node; None at module level


def scopes(tree: ast.AST) -> dict[int, Scope]:
    """id(node) -> the innermost function it sits in (iterative: deep expressions do not recurse)."""
    found: dict[int, Scope] = {}
    stack: list[tuple[ast.AST, Scope]] = [(tree, None)]
    while stack:
        node, fn = stack.pop()
        found[id(node)] = fn
        inner = node if isinstance(node, FUNCTIONS) else fn
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return found


def atoms(node: ast.AST) -> set[str]:
    """The variables an expression reads, dotted (``self.sum``), without the functions it calls:
    ``100. * correct.item() / float(n)`` -> {'correct', 'n'}."""
    found: set[str] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):  # correct.item(): the variable is correct
                stack.append(node.func.value)
            stack.extend((*node.args, *(k.value for k in node.keywords)))
        elif isinstance(node, (ast.Name, ast.Attribute)) and name(node):
            found.add(name(node))
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


def targets(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> set[str]:
    nodes = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {name(t) for target in nodes for t in ast.walk(target) if isinstance(t, (ast.Name, ast.Attribute))
            and name(t)}


class Reductions:
    """Which names hold a reduced value, and from which line of which function (see the module docstring)."""

    def __init__(self, tree: ast.AST):
        self.names, self.scope = aliases(tree), scopes(tree)
        self.helpers: set[str] = set()
        self.helpers = {fn.name for fn in ast.walk(tree) if isinstance(fn, FUNCTIONS) and self._reduces_argument(fn)}
        self.events: dict[str, list[tuple[int, int]]] = defaultdict(list)  # name -> (id(scope), line)
        self.summed: set[int] = set()  # id of divisions inside a sum over ranks: each rank's share, added up
        self._propagate(tree)

    def is_reduction(self, call: ast.Call) -> bool:
        full = resolved(call, self.names)
        return (last(call) in REDUCTIONS and full != "torch.gather") or full in self.helpers

    def returns(self, call: ast.Call) -> bool:
        """ddpkit's reductions and the file's helpers return the reduced value; torch.distributed's work in place."""
        return resolved(call, self.names).startswith("ddpkit.") or name(call.func) in self.helpers

    def _reduces_argument(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """timm's ``def reduce_tensor(t): rt = t.clone(); dist.all_reduce(rt); return rt``."""
        derived = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))),
                           key=lambda n: n.lineno):
            if node.value is not None and atoms(node.value) & derived:
                derived |= targets(node)
        returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))
        return returns and any(isinstance(c, ast.Call) and self.is_reduction(c) and atoms(c) & derived
                               for c in ast.walk(fn))

    def at(self, variable: str, scope: Scope, line: int) -> bool:
        """Whether ``variable`` holds a reduced value at ``line`` of ``scope``. A reduction in another function
        counts wherever (the order of calls is not known); in the same one, only from its line on."""
        return any(s != id(scope) or at <= line for s, at in self.events[variable])

    def _propagate(self, tree: ast.AST) -> None:
        """A worklist over assignments: each is looked at again only when a name it reads gets reduced."""
        queue: list[str] = []

        def reduce(variable: str, node: ast.Call | ast.Assign | ast.AugAssign | ast.AnnAssign) -> None:
            self.events[variable].append((id(self.scope.get(id(node))), node.lineno))
            queue.append(variable)

        assigns: list[ast.Assign | ast.AugAssign | ast.AnnAssign] = []
        readers: dict[str, list[int]] = defaultdict(list)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and self.is_reduction(node):
                self._sums(node)
                if not self.returns(node):  # dist.all_reduce(t): t now holds the sum
                    for variable in atoms(ast.Tuple(elts=[*node.args, *(k.value for k in node.keywords)])):
                        reduce(variable, node)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value:
                if any(isinstance(c, ast.Call) and self.is_reduction(c) for c in ast.walk(node.value)):
                    for variable in targets(node):
                        reduce(variable, node)
                    continue
                for variable in atoms(node.value):
                    readers[variable].append(len(assigns))
                assigns.append(node)
        done: set[int] = set()
        while queue:
            variable = queue.pop()
            for i in readers[variable]:
                node = assigns[i]
                if i not in done and self.at(variable, self.scope.get(id(node)), node.lineno):
                    done.add(i)
                    for target in targets(node):
                        reduce(target, node)

    def _sums(self, call: ast.Call) -> None:
        op = kw(call, "op") or (call.args[1] if len(call.args) > 1 and self.returns(call) else None)
        if op is not None and any(w in ast.unparse(op).lower() for w in ("mean", "avg")):
            return  # the mean over ranks of each rank's share of the whole set is 1/N of the truth
        self.summed |= {id(n) for arg in call.args for n in ast.walk(arg) if isinstance(n, ast.BinOp)}


def _plain_loader(call: ast.AST | None) -> bool:
    """A DataLoader without a sampler: each rank iterates the whole dataset."""
    return isinstance(call, ast.Call) and last(call) == "DataLoader" and len(call.args) < 4 \
        and kw(call, "sampler") is None and kw(call, "batch_sampler") is None


class Loaders:
    """Which data a script shards across ranks, to tell a per-rank count from a whole one.

    >>> src = "dl = DataLoader(test_set)\\ndef ev(loader):\\n    return len(loader.dataset)\\nev(dl)"
    >>> tree = ast.parse(src); v = Visitor(); v.visit(tree); fn = tree.body[1]
    >>> Loaders(tree, v).unsharded(fn.body[0].value.args[0], fn)
    True
    """

    def __init__(self, tree: ast.AST, v: Visitor):
        self.v = v
        self.scope = scopes(tree)
        # any sharding at all: a DistributedSampler, ddpkit's loader, a Subset picked by rank
        self.shards = any(last(c) in ("DistributedSampler", "data_loader", "split_dataset_by_node")
                          or (last(c) == "Subset" and mentions_rank(c)) for c, _ in v.calls)

    def unsharded(self, data: ast.expr, scope: Scope, depth: int = 0) -> bool:
        """Whether an expression surely holds an unsharded loader, or the dataset of one: a plain DataLoader,
        a name assigned one, ``loader.dataset`` of such, or a parameter that every call site fills with one."""
        if isinstance(data, ast.Attribute) and data.attr == "dataset":
            return self.unsharded(data.value, scope, depth)
        if _plain_loader(data) or depth > 4 or not isinstance(data, ast.Name):
            return _plain_loader(data)
        params = [a.arg for a in scope.args.args] if isinstance(scope, FUNCTIONS) else []
        if data.id in params:
            assert isinstance(scope, FUNCTIONS)
            # a method's call sites (self.evaluate(loader)) do not pass self
            position = params.index(data.id) - (params[0] == "self")
            sites = [c for c, _ in self.v.calls if name(c.func) in (scope.name, f"self.{scope.name}")]
            args = [kw(c, data.id) or (c.args[position] if 0 <= position < len(c.args) else None) for c in sites]
            return bool(sites) and all(a is not None and self.unsharded(a, self.scope.get(id(a)), depth + 1)
                                       for a in args)
        return _plain_loader(self.v.assigned.get(data.id))

    def only_through_plain_loaders(self, dataset: ast.Name) -> bool:
        """``test_set`` handed to nothing but plain DataLoaders (its own ``len`` aside)."""
        uses = [c for c, _ in self.v.calls if last(c) != "len" and any(
            isinstance(a, ast.Name) and a.id == dataset.id for a in (*c.args, *(k.value for k in c.keywords)))]
        return bool(uses) and all(_plain_loader(c) for c in uses)

    def whole_dataset(self, size: ast.expr, scope: Scope) -> bool:
        """``len(test_loader.dataset)``, ``len(test_set)``: the size of every rank's data together, in a script
        that shards some data. Not ``len(loader)`` (this rank's batches), nor the data of a plain DataLoader
        (each rank then evaluates everything itself)."""
        if not (isinstance(size, ast.Call) and name(size.func) == "len" and size.args) or not self.shards:
            return False
        data = size.args[0]
        text = ast.unparse(data).lower()
        if isinstance(data, ast.Attribute) and data.attr == "dataset":
            return not self.unsharded(data, scope)
        made = self.v.assigned.get(data.id) if isinstance(data, ast.Name) else None
        if "loader" in text or "sampler" in text or (isinstance(made, ast.Call) and last(made) in (
                "DataLoader", "data_loader", "DistributedSampler")):
            return False  # this rank's number of batches or samples
        if not any(w in text for w in ("dataset", "_set", "data")):
            return False
        return not (isinstance(data, ast.Name) and self.only_through_plain_loaders(data))
