"""What a loop keeps across its batches, by kind (:mod:`.sums` decides what to reduce from them): the names it
adds each batch's size to (its sample counts), a collection of rows begun before it (``results = []``), the items
of a history indexed by the outer loop's variable (``hist[epoch] += ...``), and a result taken over each whole
batch as one unit (an ``argmax`` over an N-way trial).

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("n = 0\\nfor x, y in ld:\\n    n += x.size(0)\\n    k = y.argmax()\\n"))
    >>> sorted(sample_counts(f.loops[0])), batch_wide(f, f.loops[0])
    (['n'], ('y.argmax(...)', 4))
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Facts, Loop

_CODE = cst.Module(body=[])


def indexed(loop: Loop) -> list[str]:
    """The items a training loop adds to, indexed by an outer loop's variable: ``hist[epoch] += loss.item() *
    y.size(0)`` (a history list, one item per epoch: rasbt's lessons). A new item each pass of that loop, so it
    is complete, and reduced, after this one.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("for epoch in range(2):\\n    for x in ld:\\n        h[epoch] += x\\n        g['k'] += x\\n"))
    >>> indexed(f.loops[1])
    ['h[epoch]']
    """
    outer = set(loop.outer[-1].targets) if loop.outer else set()  # (the loop right around it: ``fold_loss[fold]``
    # over the epochs of a fold is a running sum, not one pass's)
    return [_CODE.code_for_node(a.target) for a in m.findall(loop.node.body, m.AugAssign(operator=m.AddAssign()))
            if isinstance(a, cst.AugAssign) and isinstance(a.target, cst.Subscript) and
            isinstance(a.target.value, cst.Name) and len(a.target.slice) == 1 and
            isinstance(a.target.slice[0].slice, cst.Index) and dotted(a.target.slice[0].slice.value) in outer
            and not isinstance(a.value, (cst.List, cst.ListComp, cst.Tuple)) and
            not (isinstance(a.value, cst.Call) and isinstance(a.value.func, cst.Attribute) and
                 a.value.func.attr.value == "tolist")]


def sample_counts(loop: Loop) -> set[str]:
    """The names ``loop`` adds its batch's size to (``total += targets.size(0)``, ``len(x)``, ``x.shape[0]``,
    ``n += bs`` of ``bs = x.size(0)`` in the loop): this rank's samples. A training loop's sum read beside one
    (``correct / total``) is then reduced with it: both whole, the ratio is the one process's.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("for x, y in ld:\\n    b = x.size(0)\\n    n += b\\n    m += len(y)\\n    k += 1\\n"))
    >>> sorted(sample_counts(f.loops[0]))
    ['m', 'n']
    """
    def size(node: cst.BaseExpression) -> bool:
        if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
                and isinstance(node.slice[0].slice.value, cst.Integer) and node.slice[0].slice.value.value == "0":
            inner = node.value  # ``x.shape[0]``, ``x.size()[0]``
            return isinstance(inner, cst.Attribute) and inner.attr.value == "shape" or \
                isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute) and \
                inner.func.attr.value == "size" and not inner.args
        return isinstance(node, cst.Call) and (
            dotted(node.func) == "len" and len(node.args) == 1 or
            isinstance(node.func, cst.Attribute) and node.func.attr.value == "size" and len(node.args) == 1 and
            isinstance(node.args[0].value, cst.Integer) and node.args[0].value.value == "0")

    sized = {dotted(a.targets[0].target) for a in m.findall(loop.node.body, m.Assign())
             if isinstance(a, cst.Assign) and len(a.targets) == 1 and size(a.value)} - {None}
    return {dotted(a.target) or "" for a in m.findall(loop.node.body, m.AugAssign(operator=m.AddAssign()))
            if isinstance(a, cst.AugAssign) and isinstance(a.target, cst.Name) and
            (size(a.value) or dotted(a.value) in sized)}


def collection(facts: Facts, loop: Loop, name: str) -> bool:
    """``name`` was last bound before the loop to a list, tuple, dict or set (``results = []``, ``list()``)."""
    before = [b for b in facts.bindings if b.target == name and b.scope is loop.scope and b.line < loop.line]
    value = before[-1].value if before else None
    return isinstance(value, (cst.List, cst.ListComp, cst.Tuple, cst.Dict, cst.DictComp, cst.Set)) or \
        isinstance(value, cst.Call) and dotted(value.func) in ("list", "dict", "tuple", "set")


def batch_wide(facts: Facts, loop: Loop) -> tuple[str, int] | None:
    """``(what, line)`` of an ``argmax`` / ``argmin`` over a whole batch in the loop's body (``np.argmax(output)``,
    ``out.argmax()``, ``torch.argmax(out, dim=0)``): a result each batch gives as one unit (an N-way trial that
    wins when its first pair scores highest), which a loader sharded sample by sample would mix across units."""
    for call in m.findall(loop.node.body, m.Call(func=m.Attribute(attr=m.Name("argmax") | m.Name("argmin")) |
                                                 m.Name("argmax") | m.Name("argmin"))):
        assert isinstance(call, cst.Call)
        func = call.func
        name = dotted(func) or (func.attr.value if isinstance(func, cst.Attribute) else "argmax")
        method = isinstance(func, cst.Attribute) and name.split(".")[0] not in ("np", "numpy", "torch")
        positional = [a.value for a in call.args if a.keyword is None]
        of = func.value if method and isinstance(func, cst.Attribute) else positional[0] if positional else None
        if isinstance(of, cst.Subscript) and len(of.slice) == 1 and isinstance(of.slice[0].slice, cst.Index):
            continue  # ``out[i].argmax()``: one sample's (``out[:, 1]`` is still the whole batch)
        if isinstance(of, cst.Name) and of.value in _rows(loop.node.body):
            continue  # ``for idx, i in enumerate(output): torch.argmax(i)``: a row, one sample's (set 29)
        axis = next((a.value for a in call.args if a.keyword is not None and a.keyword.value in ("axis", "dim")),
                    positional[0 if method else 1] if len(positional) > (0 if method else 1) else None)
        if axis is None or isinstance(axis, cst.Integer) and axis.value == "0":
            return f"{name}(...)", next((c.line for c in facts.calls if c.node is call), loop.line)
    return None


def _rows(body: cst.CSTNode) -> set[str]:
    """Names an inner loop or a comprehension binds to the items it walks (``for idx, i in enumerate(output)``,
    ``[o.argmax() for o in out]``): iterating a batch yields its rows, one sample each.

    >>> sorted(_rows(cst.parse_module("for i, row in enumerate(out):\\n    pass\\nk = [o for o, t in zip(a, b)]\\n")))
    ['i', 'o', 'row', 't']
    """
    found: set[str] = set()
    for node in m.findall(body, m.For() | m.CompFor()):
        assert isinstance(node, (cst.For, cst.CompFor))
        found |= {n.value for n in m.findall(node.target, m.Name()) if isinstance(n, cst.Name)}
    return found
