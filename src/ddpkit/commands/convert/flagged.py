"""A loop that trains or evaluates by a flag: every backward of its function is in the body of ``if train:``
(a parameter), and a call that passes ``train=False`` runs it as an evaluation (BERT-pytorch's ``iteration(epoch,
data_loader, train=True)``, called by ``test()`` as ``iteration(epoch, self.test_data, train=False)``).

What such a call hands in is evaluated, not trained: it is not asked of the callers as a training loader (they keep
it whole, every rank reading all of it). A sum the loop reduces across ranks (summed, not averaged) would then count
that whole set N times: said, left to the user.

Example::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> f = scan(parse("def it(ld, train=True):\\n    for x in ld:\\n        if train:\\n            x.backward()\\n"
    ...                "it(a)\\nit(b, train=False)\\n"))
    >>> [switched_off(f, c, f.scopes["it"], 0) for c in f.calls if c.name == "it"]
    [False, True]
    >>> g = scan(parse("def it(ld, ev=False):\\n    for x in ld:\\n        if ev:\\n            pass\\n        else:\\n"
    ...                "            x.backward()\\nit(a)\\nit(b, True)\\n"))
    >>> [switched_off(g, c, g.scopes["it"], 0) for c in g.calls if c.name == "it"]
    [False, True]
    >>> h = scan(parse("def it(ld, opt=None):\\n    for x in ld:\\n        if opt is not None:\\n"
    ...                "            x.backward()\\nit(a, sgd)\\nit(b, None)\\nit(c)\\n"))
    >>> [switched_off(h, c, h.scopes["it"], 0) for c in h.calls if c.name == "it"]
    [False, True, True]
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.scan import Call, Facts, Scope


def argument_for(call: Call, param: str, scope: Scope, skip: int) -> cst.BaseExpression | None:
    """The expression ``call`` passes as ``param`` of ``scope`` (``skip``: 1 when ``self`` is not written)."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    for arg in call.node.args:
        if arg.keyword is not None and arg.keyword.value == param:
            return arg.value
    index = scope.params.index(param) - skip if param in scope.params else -1
    return positional[index].value if 0 <= index < len(positional) else None


def switched_off(facts: Facts, site: Call, scope: Scope, skip: int) -> bool:
    """``site`` runs ``scope`` with its every backward switched off: each is in the body of an ``if flag:`` on a
    parameter ``flag`` that ``site`` passes as ``False`` (or leaves at a default of False), or each is in its
    ``else`` and ``site`` passes ``True`` (``if evaluate: ... else: loss.backward()``)."""
    backwards = [c for c in facts.calls if c.scope is scope and c.last == "backward"]
    if not backwards or any(a.star for a in site.node.args):  # (``step(*batch, True)``: what lands where, unknown)
        return False
    for flag, off in _guarding(scope, backwards):
        passed = argument_for(site, flag, scope, skip)
        if passed is None:
            passed = _default(scope, flag)
        if isinstance(passed, cst.Name) and passed.value in off:
            return True
    return False


def _guarding(scope: Scope, backwards: list[Call]) -> list[tuple[str, tuple[str, ...]]]:
    """(``p``, the values that switch the backward off) for each parameter ``p`` of ``scope`` such that every
    backward is inside the body (off: ``False`` or ``None``), or every one inside the ``else`` (off: ``True``), of an
    ``if p:``; or inside the body of ``if p is not None:`` / the ``else`` of ``if p is None:`` (off: ``None``, a
    helper handed no optimizer to evaluate: ``run_epoch(model, dev_loader, optimiser=None)``)."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in m.findall(scope.node, m.If()):
        assert isinstance(node, cst.If)
        flag, offs = _flag(node.test)
        if flag not in scope.params:
            continue
        for part, off in zip((node.body, node.orelse), offs):
            inside = {id(c) for c in m.findall(part, m.Call())} if isinstance(part, (cst.BaseSuite, cst.Else)) \
                else set()
            if off and all(id(c.node) in inside for c in backwards) and (flag, off) not in found:
                found.append((flag, off))
    return found


def _flag(test: cst.BaseExpression) -> tuple[str | None, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The parameter an ``if`` tests, and the values that make it take the body, the ``else`` off (``if p:``:
    False or None off the body, True off the ``else``)."""
    if isinstance(test, cst.Name):
        return test.value, (("False", "None"), ("True",))
    if isinstance(test, cst.Comparison) and isinstance(test.left, cst.Name) and len(test.comparisons) == 1 and \
            isinstance(test.comparisons[0].comparator, cst.Name) and test.comparisons[0].comparator.value == "None":
        if isinstance(test.comparisons[0].operator, cst.IsNot):
            return test.left.value, (("None",), ())
        if isinstance(test.comparisons[0].operator, cst.Is):
            return test.left.value, ((), ("None",))
    return None, ((), ())


def _default(scope: Scope, param: str) -> cst.BaseExpression | None:
    """The default value ``param`` has in the definition of ``scope`` (None: none, or not a function)."""
    params: Any = getattr(scope.node, "params", None)
    for found in [*params.params, *params.kwonly_params] if params is not None else []:
        if found.name.value == param:
            return found.default
    return None
