"""What counts every sample of a sharded loader, so a sum divided by it is reduced too: the dataset's size
(``len(loader.dataset)``, ``len(train_ds)``, a dict of the splits' sizes), ``len(loader) * batch_size`` with the
global batch, and ``len(loader.sampler)`` (this rank's shard once sharded: reduced with the sum).
:mod:`ddpkit.commands.convert.sums` decides from these.

Example::

    >>> stmt = cst.parse_statement("acc = correct / len(loader.dataset)\\n")
    >>> [dotted(c.args[0].value) for c in sampler_lens(stmt, {"loader"})], item_dataset(stmt, {"loader"})
    ([], False)
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Facts


def global_products(stmt: Any, loaders: set[str], batches: frozenset[str]) -> list[cst.BinaryOperation]:
    """``len(loader) * batch_size`` in ``stmt``, the batch being the global one (``batches``: its names): this
    rank's batches times the global batch, every sample."""
    def is_len(node: cst.CSTNode) -> bool:
        return isinstance(node, cst.Call) and dotted(node.func) == "len" and bool(node.args) and \
            dotted(node.args[0].value) in loaders

    return [node for node in m.findall(stmt, m.BinaryOperation(operator=m.Multiply()))
            if isinstance(node, cst.BinaryOperation) and batches and
            (is_len(node.left) and dotted(node.right) in batches or
             is_len(node.right) and dotted(node.left) in batches)]


def dataset_size(facts: Facts, stmt: Any, scope: Any, datasets: set[str], loaders: set[str],
                  batches: frozenset[str]) -> bool:
    """The statement divides by the whole dataset: ``len(X.dataset)``, ``len(train_ds)`` (the loader's own
    dataset), ``len(loader) * batch_size`` with the global batch, or a name bound to one. Not a size divided by
    something (``len(ds) / loader.batch_size``: a count of batches)."""
    def is_size(node: cst.CSTNode) -> bool:
        arg = dotted(node.args[0].value) if isinstance(node, cst.Call) and node.args else None
        return isinstance(node, cst.Call) and dotted(node.func) == "len" and (arg is not None and (
            arg.endswith(".dataset") and arg[:-len(".dataset")] in loaders or arg in datasets) or
            bool(node.args) and item_dataset(node.args[0].value, loaders)) or \
            bool(global_products(node, loaders, batches))  # (another loader's dataset: not this sum's size)

    def sizes_in(node: cst.CSTNode) -> bool:
        divided = {i for d in m.findall(node, m.BinaryOperation(operator=m.Divide() | m.FloorDivide()))
                   if isinstance(d, cst.BinaryOperation) for i in node_ids(d.left)}  # ((len(ds) + b - 1) // b)
        return any(is_size(n) and id(n) not in divided for n in m.findall(node, m.Call() | m.BinaryOperation()))

    sizes = {b.target for b in facts.bindings if b.scope is scope and b.value is not None and sizes_in(b.value)}
    by_split = size_dicts(facts, scope, loaders)
    items = any(isinstance(s, cst.Subscript) and dotted(s.value) in by_split for s in m.findall(stmt, m.Subscript()))
    return sizes_in(stmt) or bool(names_in(stmt) & sizes) or items


def item_dataset(node: Any, loaders: set[str]) -> bool:
    """``dataloaders[phase].dataset``: the dataset of an item of a dict of loaders the loop reads by key."""
    return isinstance(node, cst.Attribute) and node.attr.value == "dataset" and \
        isinstance(node.value, cst.Subscript) and dotted(node.value.value) in loaders


def size_dicts(facts: Facts, scope: Any, loaders: set[str]) -> set[str]:
    """The dicts of the splits' sizes ``scope`` sees: every value a ``len()`` of no loader (``dataset_sizes = {x:
    len(image_datasets[x]) for x in ['train', 'val']}``: ``running_loss / dataset_sizes[phase]`` divides by a
    whole split)."""
    def sizes(values: list[Any]) -> bool:
        return bool(values) and all(isinstance(v, cst.Call) and dotted(v.func) == "len" and len(v.args) == 1 and
                                    (not names_in(v.args[0].value) & loaders or item_dataset(v.args[0].value,
                                                                                            loaders)) for v in values)
    found = set()
    for b in facts.bindings:
        if b.value is None or b.index >= 0 or not (b.scope is scope or b.scope.name == ""):
            continue
        if isinstance(b.value, cst.DictComp) and sizes([b.value.value]) or isinstance(b.value, cst.Dict) and \
                sizes([e.value for e in b.value.elements if isinstance(e, cst.DictElement)]):
            found.add(b.target)
    return found


def sampler_lens(node: Any, loaders: set[str]) -> list[cst.Call]:
    """``len(loader.sampler)`` in ``node``: the samples of this rank's shard once the loader is sharded (Udacity's
    ``train_loss / len(train_loader.sampler)`` over a ``SubsetRandomSampler``), a count made every rank's by
    ``ddpkit.reduce`` where the sum it divides is."""
    return [c for c in m.findall(node, m.Call(func=m.Name("len"))) if isinstance(c, cst.Call) and len(c.args) == 1
            and (dotted(c.args[0].value) or "").endswith(".sampler")
            and str(dotted(c.args[0].value))[:-len(".sampler")] in loaders]


def global_batch_kept(work: Any) -> bool:
    """The training loader's batch is the global one (each rank's batch is B/N): this file made it so
    (``batch_size=B -> global_batch_size=B``), or the module that builds it in a project did (the loop "left as it
    is"), and the conversion keeps no batch per process."""
    return not work.per_process_batch and (
        any(e.what.startswith("batch_size=") and "global_batch_size=" in e.what for e in work.log) or
        any("is a ddpkit.data_loader where it is built" in k.why for k in work.kept))
