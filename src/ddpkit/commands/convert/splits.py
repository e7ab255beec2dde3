"""Unseeded splits and shuffles of the data, which every rank of a converted script makes on its own:
``train_test_split(X, y)`` without ``random_state=``, ``random_split(ds, [n, m])`` without ``generator=``,
``np.random.permutation(n)`` / ``np.random.shuffle(x)`` / ``random.shuffle(x)`` / ``torch.randperm(n)`` on the
data before the loader. Each rank would draw its own split: a rank's test set holds another rank's training
samples, and the shards ddpkit deals by index are shards of different orders (samples seen twice, others never).
Nothing fails and the numbers look fine, so the split gets a fixed seed (``random_state=0``,
``generator=torch.Generator().manual_seed(0)``, ``np.random.RandomState(0).permutation``) and the line says so.

A split stays as it is when its library was seeded above it with a constant (``np.random.seed(42)``,
``torch.manual_seed(0)``, ``seed_everything(42)``), under no ``if`` the split is not under too: every rank then
draws the same numbers.
A seed from a variable may differ per process (DCGAN seeds with ``random.randint`` when no seed is given), so
it does not count.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("from sklearn.model_selection import train_test_split\\n"
    ...             "a, b = train_test_split(data, test_size=0.2)\\n").text
    >>> text.splitlines()[-1]
    'a, b = train_test_split(data, test_size=0.2, random_state=0)'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.flow import callee
from ddpkit.commands.convert.scan import Call, dotted

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

SEEDS = {"numpy": ("numpy.random.seed",), "random": ("random.seed",),
         "torch": ("torch.manual_seed", "torch.random.manual_seed")}
HELPERS = ("seed_everything", "set_seed", "set_random_seed", "seed_all")  # seed all three (Lightning, HF, ...)
DRAWS = {"numpy.random.permutation": "numpy", "numpy.random.shuffle": "numpy", "numpy.random.choice": "numpy",
         "random.shuffle": "random", "random.sample": "random", "torch.randperm": "torch"}
# where a draw is per sample (augmentation, dropout-like noise), not a split of the data
PER_SAMPLE = ("__getitem__", "__iter__", "__call__", "forward")
WHY = "every rank would draw its own split (samples of one rank's test set in another's training)"


def splits(work: _Work, loaders: bool) -> None:
    """Seed every unseeded split; ``loaders``: the script builds a DataLoader (a shuffle is data only then)."""
    for call in work.facts.calls:
        name = call.name or ""
        if name.endswith("train_test_split") and call.last == "train_test_split":
            _keyword(work, call, "random_state", "0", "numpy")
        elif name == "torch.utils.data.random_split" or name.endswith(".random_split") and "torch" in name:
            _keyword(work, call, "generator", f"{_torch(work)}.Generator().manual_seed(0)", "torch")
        elif name in DRAWS and loaders and not call.loops and not call.scope.name.endswith(PER_SAMPLE):
            _draw(work, call, DRAWS[name])


def _keyword(work: _Work, call: Call, keyword: str, value: str, library: str) -> None:
    given = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    said, shuffle = given.get(keyword), given.get("shuffle")
    if said is not None and not (isinstance(said, cst.Name) and said.value == "None") or \
            isinstance(shuffle, cst.Name) and shuffle.value == "False" or \
            any(a.star for a in call.node.args) or _seeded(work, call, library):
        return
    if library == "torch" and not _torch(work):
        work.leave(call.line, f"{call.last} without {keyword}=: {WHY}", f"pass {keyword}=torch.Generator()."
                   "manual_seed(0)")
        return

    def seeded(node: cst.Call) -> cst.Call:
        args = [a for a in node.args if not (a.keyword is not None and a.keyword.value == keyword)]
        if args and len(args) < len(node.args) and node.args[-1] not in args:  # ``random_state=None`` last: the
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)  # new one ends the call instead
        return add_keyword(node.with_changes(args=args), keyword, value)

    work.edits.expr[id(call.node)] = seeded
    work.note(f"{call.last}(..., {keyword}={value})", f"unseeded, {WHY}: one fixed split on every rank",
              call.line)


def _draw(work: _Work, call: Call, library: str) -> None:
    """``np.random.permutation(n)`` -> ``np.random.RandomState(0).permutation(n)``, ``random.shuffle(x)`` ->
    ``random.Random(0).shuffle(x)``, ``torch.randperm(n)`` -> ``torch.randperm(n, generator=...)``."""
    if _seeded(work, call, library):
        return
    if library == "torch":
        if not any(a.keyword is not None and a.keyword.value == "generator" for a in call.node.args):
            _keyword(work, call, "generator", f"{_torch(work)}.Generator().manual_seed(0)", "torch")
        return
    func = call.node.func
    base = dotted(func.value) if isinstance(func, cst.Attribute) else None
    if base is None:  # ``from random import shuffle``: no module to take a seeded generator from
        work.leave(call.line, f"{call.last}(...) unseeded, before the loader: {WHY}", "seed it: random.Random(0)."
                   f"{call.last}(...) (numpy: np.random.RandomState(0).{call.last}(...))")
        return
    maker = "RandomState" if library == "numpy" else "Random"
    work.edits.expr[id(func)] = lambda node: cst.parse_expression(f"{base}.{maker}(0).{call.last}")
    work.note(f"{base}.{call.last}(...) -> {base}.{maker}(0).{call.last}(...)", f"unseeded, before the loader: "
              f"{WHY}: one fixed order on every rank", call.line)


def _seeded(work: _Work, call: Call, library: str) -> bool:
    """A constant seed of ``library`` above ``call``, unconditional, at the module level or in its function, or
    a seeding helper of the script's (``def seed_all(s): np.random.seed(s)``) called so."""
    for seed in work.facts.calls:
        inside = seed.tests == call.tests[:len(seed.tests)]  # (under the split's own ``if __name__ == ...``)
        if seed.line >= call.line or not inside or seed.loops or seed.scope not in (call.scope,
                                                                                   work.facts.scopes[""]):
            continue
        own = callee(work.facts, seed)
        helper = seed.last in HELPERS or own is not None and any(
            c.scope is own[0] and c.name in SEEDS[library] for c in work.facts.calls)
        if (seed.name in SEEDS[library] or helper) and _constant(work, seed):
            return True
    return False


def _constant(work: _Work, seed: Call) -> bool:
    """The seed is an integer literal, or a module name bound once, to one (``SEED = 42``)."""
    if not seed.node.args:
        return False
    value = seed.node.args[0].value
    if isinstance(value, cst.Name):
        bound = [b.value for b in work.facts.bindings if b.target == value.value]
        value = bound[0] if len(bound) == 1 and bound[0] is not None else value
    return isinstance(value, cst.Integer)


def _torch(work: _Work) -> str:
    """The script's name for torch (``import torch``), or "" when it has none."""
    return next((local for local, full in work.facts.aliases.items() if full == "torch"), "")
