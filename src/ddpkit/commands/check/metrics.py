"""``ddpkit check``'s evaluation rules: metrics printed or computed per rank, evaluation data a sampler pads
or cuts short.

DDP017: ``print(... loss ...)`` on every rank. DDP018: a count summed on this rank's shard divided by the
whole dataset's size (``100. * correct / len(test_loader.dataset)``, ``test_loss /= len(loader.dataset)``)
and never reduced. DDP003 / DDP019: an evaluation ``DistributedSampler`` that pads, or drops a tail that no
``Subset`` evaluates.

>>> src = "correct = 0\\nfor x in loader:\\n    correct += x.sum().item()\\nacc = correct / len(loader.dataset)"
>>> sorted(atoms(ast.parse(src).body[-1].value.left)), sorted(counted(ast.parse(src)))
(['correct'], ['correct'])
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.commands.check.flow import Loaders, Reductions, atoms, targets
from ddpkit.commands.check.rules import RANK_WORDS, Finding, finding
from ddpkit.commands.check.syntax import Visitor, eval_data, kw, last, name

COUNTING = {"sum", "item", "count_nonzero", "numel", "size"}  # calls whose result, assigned, is a local count


def counted(tree: ast.AST) -> set[str]:
    """Variables that hold a count or sum made on this rank: ``correct += ...``, ``n = mask.sum()``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
            found |= targets(node)
        elif isinstance(node, ast.Assign) and any(isinstance(c, ast.Call) and last(c) in COUNTING
                                                  for c in ast.walk(node.value)):
            found |= targets(node)
    return found


def metric_findings(tree: ast.AST, v: Visitor, rank0_print: bool) -> Iterator[Finding]:
    """DDP017 and DDP018 (see the module docstring). ``rank0_print``: ``print`` is ddpkit's (imported from it)."""
    for call, ranked in v.calls:
        text = " ".join(ast.unparse(arg) for arg in call.args)
        # a line that names its rank ("[GPU{gpu_id}] ... loss") is per-rank output on purpose
        if not ranked and not rank0_print and name(call.func) == "print" \
                and ("loss" in text.lower() or ".item()" in text) and not any(w in text.lower() for w in RANK_WORDS):
            yield finding("DDP017", call.lineno)
    counts, done, loaders = counted(tree), Reductions(tree), Loaders(tree, v)
    for node in v.divisions:
        top, size = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
        scope = done.scope.get(id(node))
        parts = {part for part in atoms(top) & counts if not done.at(part, scope, node.lineno)}
        reduced_here = any(isinstance(c, ast.Call) and done.is_reduction(c) for c in ast.walk(top))
        if parts and not reduced_here and id(node) not in done.summed and loaders.whole_dataset(size, scope):
            yield finding("DDP018", node.lineno)


def _tail_of_own_loader(subset: ast.Call) -> bool:
    """``Subset(X.dataset, range(len(X.sampler) * world_size, len(X.dataset)))``: the samples X's sampler
    dropped, whatever X is called or wherever it was built (torch's ImageNet example's shape)."""
    of, rest = subset.args[0], subset.args[1:]
    if not (isinstance(of, ast.Attribute) and of.attr == "dataset" and rest and isinstance(rest[0], ast.Call)
            and last(rest[0]) == "range"):
        return False
    return f"len({ast.unparse(of.value)}.sampler)" in ast.unparse(rest[0])


def _remainder_evaluated(dataset: str, v: Visitor) -> bool:
    """A ``Subset`` of this dataset somewhere in the file: of it by name, or of ``loader.dataset`` where
    ``loader`` is a DataLoader over it (torch's ImageNet example: ``Subset(val_loader.dataset, range(...))``
    in ``validate(val_loader, ...)``, whose argument is the loader built in ``main_worker``)."""
    for call, _ in v.calls:
        if last(call) != "Subset" or not call.args:
            continue
        of = call.args[0]
        if ast.unparse(of) == dataset or _tail_of_own_loader(call):
            return True
        if isinstance(of, ast.Attribute) and of.attr == "dataset" and isinstance(of.value, ast.Name):
            loader = v.assigned.get(of.value.id)
            source = (loader.args[0] if loader.args else kw(loader, "dataset")) \
                if isinstance(loader, ast.Call) and last(loader) == "DataLoader" else None
            if source is not None and ast.unparse(source) == dataset:
                return True
    return False


def eval_sampler(call: ast.Call, v: Visitor) -> Iterator[Finding]:
    """An evaluation DistributedSampler (``DistributedSampler(val_set)``, ``(dataset=test_set)``): it pads
    (DDP003), or with drop_last=True it drops the tail, which is fine when the file evaluates the remainder
    through a Subset of the same dataset (torch's ImageNet example's aux_val_loader), and a skipped tail
    otherwise (DDP019)."""
    data = call.args[0] if call.args else kw(call, "dataset")
    if data is None or not eval_data(data):
        return
    drop = kw(call, "drop_last")
    if not (isinstance(drop, ast.Constant) and drop.value is True):
        yield finding("DDP003", call.lineno)
    elif not _remainder_evaluated(ast.unparse(data), v):
        yield finding("DDP019", call.lineno)
