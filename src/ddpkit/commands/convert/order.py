"""Whether a read of a file runs before a write that rank 0 alone makes, so that no barrier is owed between them:
``main()`` reads ``--resume`` once and then calls ``train()``, which saves every epoch; a trainer's ``__init__``
loads a checkpoint before its ``train()`` method saves one (each called once). A path's text tells nothing: a save
to ``p + '.tmp'`` renamed to ``p``, numpy's ``np.save('w')`` that writes ``w.npy``.

Example (``main()`` reads, then calls ``train()``, which saves)::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("def train():\\n    torch.save(m, 'c.pt')\\ndef main():\\n    torch.load('c.pt')\\n"
    ...                    "    train()\\nmain()\\n"))
    >>> load, save = (next(c for c in facts.calls if c.name == n) for n in ("torch.load", "torch.save"))
    >>> read_first(facts, load, save)
    True
"""

from __future__ import annotations

from typing import Any

from ddpkit.commands.convert.flow import callee
from ddpkit.commands.convert.scan import Facts, Scope

__all__ = ["read_first"]


def read_first(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` runs before ``write`` in every run, or reads another file (a different file name ending)."""
    return read.scope is not write.scope and bool(read.scope.name) and \
        (_runs_before(facts, read, write.scope) or _constructs(facts, read, write))


def _runs_before(facts: Facts, read: Any, target: Scope) -> bool:
    """``read``, in no loop of a function called in no loop, is above every call of that function that leads
    to ``target`` (the writing function), and there is one such call."""
    scope = read.scope
    if read.loops or not _called_once(facts, scope):
        return False
    leading = [c.line for c in facts.calls if c.scope is scope and _reaches(facts, c, target)]
    return bool(leading) and min(leading) > read.line


def _constructs(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` in a class's ``__init__`` (built in no loop), ``write`` in another method of that class: an object
    is made before its methods run."""
    scope = read.scope
    return scope.name.endswith(".__init__") and bool(scope.cls) and write.scope.cls == scope.cls and \
        write.scope is not scope and not read.loops and _called_once(facts, scope)


def _called_once(facts: Facts, scope: Scope) -> bool:
    """One call of the function (one object built), in no loop: a second (``stage(1); stage(2)``, a ``Trainer``
    built again to load what the first saved) would read after the write."""
    sites = [c for c in facts.calls if (callee(facts, c) or (None,))[0] is scope]
    return len(sites) == 1 and not sites[0].loops


def _reaches(facts: Facts, call: Any, target: Scope) -> bool:
    """The call runs ``target``, itself or through the script's functions it calls (four deep at most)."""
    found = callee(facts, call)
    seen, todo = set(), [found[0]] if found else []
    for _ in range(5):
        if any(s is target for s in todo):
            return True
        seen |= {id(s) for s in todo}
        todo = [f[0] for s in todo for c in facts.calls if c.scope is s
                if (f := callee(facts, c)) is not None and id(f[0]) not in seen]
    return False
