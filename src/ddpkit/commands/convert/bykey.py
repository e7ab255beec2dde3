"""Loaders held in a dict by their split's string: the tutorials' ``dataloaders = {x: DataLoader(image_datasets[x],
...) for x in ['train', 'val']}`` read by ``for phase in ['train', 'val']: ... for inputs, labels in
dataloaders[phase]:`` with the step under ``if phase == 'train':``, and ``loaders = {'train': DataLoader(...),
'test': DataLoader(...)}`` read as ``loaders['train']``. Which keys are trained on comes from the loops that read
the dict: a key written out (``loaders['train']``, or handed to a function of the script whose loop trains), or
the loop variable over the splits' strings that the ``if`` around the step tests.

The keys trained on become sharded loaders, the others stay whole (each rank evaluates every batch, which is
right). A loop over every split sums its shard for the trained ones only, so its sums are reduced under the same
test (``running_loss = ddpkit.reduce(running_loss) if phase == 'train' else running_loss``).

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("dl = {x: DataLoader(ds[x]) for x in ['train', 'val']}\\nfor p in ['train', 'val']:\\n"
    ...                "    for b in dl[p]:\\n        if p == 'train':\\n            b.backward()\\n"))
    >>> held = holder(f, f.calls[0].node)
    >>> held.name, held.key, sorted(held.strings)
    ('dl', None, ['train', 'val'])
    >>> keys, loops, picker = trained(f, held)
    >>> keys, [(lp.line, key) for lp, key in loops], picker
    ({'train'}, [(3, None)], 'p')
"""

from __future__ import annotations

import dataclasses
from typing import Any

import libcst as cst
from libcst import matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Binding, Facts, Loop


@dataclasses.dataclass(frozen=True)
class Held:
    """The dict ``name`` (its ``binding``) holding a loader: under ``key`` in a literal, or for every string of
    ``strings`` in a comprehension over them (``key`` None, ``param`` its variable); ``evaluated``: held by a name
    that evaluation loops also read on their own (``test_loader``, put in the dict and looped by a last test)."""
    name: str
    binding: Binding
    key: str | None
    param: str | None
    strings: frozenset[str]
    evaluated: bool = False


def _string(node: Any) -> str | None:
    return node.evaluated_value if isinstance(node, cst.SimpleString) and \
        isinstance(node.evaluated_value, str) else None


def over_strings(node: Any) -> frozenset[str]:
    """The strings a list or tuple of them holds (empty: anything else)."""
    if not isinstance(node, (cst.List, cst.Tuple)) or not node.elements:
        return frozenset()
    values = [_string(e.value) for e in node.elements]
    return frozenset(v for v in values if v is not None) if None not in values else frozenset()


def holder(facts: Facts, node: cst.Call) -> Held | None:
    """The dict ``node`` is held in (:class:`Held`), directly or by the name nothing else reads it by; None when it
    is not a value of a dict literal with string keys, or of a comprehension over a list of strings keyed by its
    variable, bound to a plain name."""
    named = _named(facts, node)
    for b in facts.bindings:
        value = b.value
        if b.index >= 0 or "." in b.target or "[" in b.target:
            continue
        if isinstance(value, cst.Dict):
            keys = [_string(e.key) if isinstance(e, cst.DictElement) else None for e in value.elements]
            mine = [k for e, k in zip(value.elements, keys) if isinstance(e, cst.DictElement) and (
                e.value is node or named is not None and named.scope is b.scope and named.line <= b.line and
                dotted(e.value) == named.target)]
            if mine and None not in keys:
                evaluated = named is not None and bool(flow.loops_reading(facts, named.target, named.scope,
                                                                          since=named))
                return Held(b.target, b, mine[0], None, frozenset(k for k in keys if k is not None), evaluated)
        if isinstance(value, cst.DictComp) and value.value is node and value.for_in.inner_for_in is None and \
                not value.for_in.ifs and isinstance(value.for_in.target, cst.Name) and \
                dotted(value.key) == value.for_in.target.value and over_strings(value.for_in.iter):
            return Held(b.target, b, None, value.for_in.target.value, over_strings(value.for_in.iter))
    return None


def _named(facts: Facts, node: cst.Call) -> Binding | None:
    """The name ``node``'s loader is bound to when nothing but a dict then reads it (``train_loader =
    DataLoader(...)``, then ``loaders = {'train': train_loader, 'val': val_loader}``: the tutorials' other
    spelling); None when a loop that trains reads the name itself (one that evaluates may: the loader then stays
    whole, for both)."""
    bound = next((b for b in facts.bindings if b.value is node and b.index < 0 and "." not in b.target), None)
    if bound is None or any(flow.trains(facts, lp) for lp in flow.loops_reading(facts, bound.target, bound.scope,
                                                                                 since=bound)):
        return None
    return bound


def _key(loop: Loop, facts: Facts | None = None) -> tuple[str | None, str | None] | None:
    """How the loop's iterable picks its item: (a string, None) for ``d['train']``, (None, the name) for
    ``d[phase]``, also through a name bound to it just above (``data_loader = data_loaders[split]``, a language
    model's); None for neither (the loop reads an item handed to its function)."""
    source: cst.CSTNode = loop.node.iter if isinstance(loop.node, cst.For) else cst.Name("_")
    if isinstance(source, cst.Name) and facts is not None:
        bound = flow.binding_of(facts, source.value, loop.scope, loop.line)
        if bound is not None and isinstance(bound.value, cst.Subscript) and \
                all(o.line <= bound.line for o in loop.outer[-1:]):  # (bound in the loop over the splits)
            source = bound.value
    for sub in m.findall(source, m.Subscript(value=m.Name() | m.Attribute())):
        assert isinstance(sub, cst.Subscript)
        index = sub.slice[0].slice if len(sub.slice) == 1 else None
        if isinstance(index, cst.Index):
            return _string(index.value), dotted(index.value) if isinstance(index.value, cst.Name) else None
    return None


def _handed(facts: Facts, held: Held) -> dict[int, set[str]]:
    """The loops of the script's functions that an item written out is handed to (``train_epoch(loaders['train'],
    ...)``): each loop's id, the keys (``evaluate(loaders['train'])`` and ``evaluate(loaders['test'])``: both)."""
    found: dict[int, set[str]] = {}
    for call in facts.calls:
        target = flow.callee(facts, call)
        if target is None or not flow.visible(facts, held.name, held.binding.scope, call.scope):
            continue
        for param in target[0].params:
            arg = flow.argument_for(call, param, target[0], target[1])
            if isinstance(arg, cst.Subscript) and dotted(arg.value) == held.name and len(arg.slice) == 1 and \
                    isinstance(arg.slice[0].slice, cst.Index) and _string(arg.slice[0].slice.value) is not None:
                for loop in flow.loops_reading(facts, param, target[0], 1):
                    found.setdefault(id(loop.node), set()).add(str(_string(arg.slice[0].slice.value)))
    return found


def _outer_strings(loop: Loop, param: str) -> frozenset[str]:
    """The strings of the loop around ``loop`` whose variable is ``param`` (``for phase in ['train', 'val']``)."""
    for outer in loop.outer:
        if outer.targets == {param} and isinstance(outer.node, cst.For):
            return over_strings(outer.node.iter)
    return frozenset()


def trained(facts: Facts, held: Held) -> tuple[set[str], list[tuple[Loop, str | None]], str | None] | None:
    """The keys trained on, the loops over them (each with its key written out, None in a loop over every split:
    those that train, and the evaluations of a trained key, whose sums are then this rank's shard's), and the loop
    variable that picks the split in a loop over every split (None: each loop reads one key written out). None
    when it cannot be told: a loop over the dict by a key neither written nor a loop over the same strings, a step
    no ``if`` on that variable tells apart, or an evaluation over every split that takes in a trained one."""
    handed = _handed(facts, held)
    keys: set[str] = set()
    loops: list[tuple[Loop, str | None]] = []
    evaluations: list[tuple[Loop, str | None]] = []
    picker: str | None = None
    reading = flow.loops_reading(facts, held.name, held.binding.scope, since=held.binding)
    for b in facts.bindings:  # (``data_loader = data_loaders[split]`` in the loop over the splits, then its loop)
        if isinstance(b.value, cst.Subscript) and dotted(b.value.value) == held.name and b.line > held.binding.line:
            reading += [lp for lp in flow.loops_reading(facts, b.target, b.scope, since=b) if lp not in reading]
    for loop in reading:
        if id(loop.node) in handed:  # one split or more, written out where the function is called
            if flow.trains(facts, loop):
                keys |= handed[id(loop.node)]
            (loops if flow.trains(facts, loop) else evaluations).extend((loop, k) for k in handed[id(loop.node)])
            continue
        key = _key(loop, facts)
        if key is None:
            return None
        if key[0] is not None:  # one split, written out
            if flow.trains(facts, loop):
                keys.add(key[0])
            (loops if flow.trains(facts, loop) else evaluations).append((loop, key[0]))
            continue
        param = key[1]
        if param is None or not _outer_strings(loop, param) or not _outer_strings(loop, param) <= held.strings:
            return None
        steps = [c for c in loop.calls if c.last == "backward"]
        if not steps and not flow.trains(facts, loop):
            evaluations.append((loop, None))  # an evaluation over every split
            continue
        tested = [{v for test in c.tests for v in equals(test, param)} for c in steps]
        if not steps or any(not t for t in tested) or picker not in (None, param):
            return None
        keys |= set().union(*tested) & held.strings
        loops.append((loop, None))
        picker = param
    if any(key is None for _, key in evaluations) and keys:
        return None  # (its sums would mix a trained split's shard with the whole others under no one test)
    return keys, loops + [(loop, key) for loop, key in evaluations if key in keys], picker


def equals(test: str, param: str) -> set[str]:
    """The strings ``test`` compares ``param`` to with ``==`` or ``in`` a tuple/list of strings (``phase ==
    'train'``)."""
    try:
        node = cst.parse_expression(test)
    except cst.ParserSyntaxError:
        return set()
    found: set[str] = set()
    for c in m.findall(node, m.Comparison()):
        assert isinstance(c, cst.Comparison)
        if dotted(c.left) != param or len(c.comparisons) != 1:
            continue
        operator, right = c.comparisons[0].operator, c.comparisons[0].comparator
        if isinstance(operator, cst.Equal) and _string(right) is not None:
            found.add(str(_string(right)))
        elif isinstance(operator, cst.In):
            found |= over_strings(right)
    return found
