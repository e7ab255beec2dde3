"""Unseeded splits and shuffles of the data, which every rank of a converted script makes on its own:
``train_test_split(X, y)`` without ``random_state=``, ``random_split(ds, [n, m])`` without ``generator=``,
``np.random.permutation(n)`` / ``np.random.shuffle(x)`` / ``random.shuffle(x)`` / ``torch.randperm(n)`` on the
data before the loader. Each rank would draw its own split: a rank's test set holds another rank's training
samples, and the shards ddpkit deals by index are shards of different orders (samples seen twice, others never).
Nothing fails and the numbers look fine, so the split gets a fixed seed (``random_state=0``,
``generator=torch.Generator().manual_seed(0)``, ``np.random.RandomState(0).permutation``) and the line says so.

A split stays as it is, said as kept (``left as is: seeded by ... at line N``), when its library was seeded above
it (``np.random.seed(42)``, ``torch.manual_seed(args.seed)``, ``seed_everything(SEED)``, a ``set_seed(SEED)`` in
the function that calls the split's), under no ``if`` the split is not under too: every rank then draws the same
numbers. A seed drawn at random (DCGAN's ``opt.manualSeed = random.randint(1, 10000)``), from the time or from the
rank differs per process, so it does not count. An unseeded ``torch.randperm(n, device=d)`` gets a generator on
``d``.

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
from ddpkit.commands.convert.flow import DEPTH, called_from_loop, callee, callers
from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, names_in
from ddpkit.commands.convert.scan import Call, Scope

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

SEEDS = {"numpy": ("numpy.random.seed",), "random": ("random.seed",),
         "torch": ("torch.manual_seed", "torch.random.manual_seed")}
HELPERS = ("seed_everything", "set_seed", "set_random_seed", "seed_all")  # seed all three (Lightning, HF, ...)
DRAWS = {"numpy.random.permutation": "numpy", "numpy.random.shuffle": "numpy", "numpy.random.choice": "numpy",
         "random.shuffle": "random", "random.sample": "random", "torch.randperm": "torch"}
# where a draw is per sample (augmentation, dropout-like noise), not a split of the data
PER_SAMPLE = ("__getitem__", "__iter__", "__call__", "forward")
# what gives a seed that differs per process
VARYING = ("random.", "numpy.random.", "torch.rand", "time.", "os.getpid", "secrets.", "uuid.", "datetime.")
WHY = "every rank would draw its own split (samples of one rank's test set in another's training)"


def splits(work: _Work, loaders: bool) -> None:
    """Seed every unseeded split; ``loaders``: the script builds a DataLoader (a shuffle is data only then)."""
    for call in work.facts.calls:
        name = call.name or ""
        # scikit-learn's (also ``as tts``), or a bare name from a star import; not a module's own of that name
        # (``series.train_test_split(t, y, split=0.8)``: no random_state= to take), nor the script's
        if name.startswith("sklearn.") and name.endswith(".train_test_split") or \
                name == "train_test_split" and not any(scope.name.split(".")[-1] == name
                                                       for scope in work.facts.scopes.values()):
            _keyword(work, call, "random_state", "0", "numpy")
        elif name == "torch.utils.data.random_split" or name.endswith(".random_split") and "torch" in name:
            _keyword(work, call, "generator", f"{_torch(work)}.Generator().manual_seed(0)", "torch")
        elif name in DRAWS and loaders and not call.loops and not call.scope.name.endswith(PER_SAMPLE) and \
                not called_from_loop(work.facts, call.scope):  # (a draw every step: mixup's randperm)
            _draw(work, call, DRAWS[name])


def _keyword(work: _Work, call: Call, keyword: str, value: str, library: str) -> None:
    given = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    said, shuffle = given.get(keyword), given.get("shuffle")
    if said is not None and not (isinstance(said, cst.Name) and said.value == "None") or \
            isinstance(shuffle, cst.Name) and shuffle.value == "False" or \
            any(a.star for a in call.node.args) or _kept(work, call, library):
        return
    if library == "torch" and not _torch(work):
        # (the script has no ``import torch`` of its own: the fix names it; extra five of set 28, NameError)
        work.leave(call.line, f"{call.last} without {keyword}=: {WHY}", f"import torch, then pass {keyword}="
                   "torch.Generator().manual_seed(0)")
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
    if _kept(work, call, library):
        return
    if library == "torch":
        device = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "device"),
                      None)  # ``torch.randperm(n, device=device)``: a generator on that device
        on = f"device={work.facts.code(device)}" if device is not None else ""
        if not any(a.keyword is not None and a.keyword.value == "generator" for a in call.node.args):
            _keyword(work, call, "generator", f"{_torch(work)}.Generator({on}).manual_seed(0)", "torch")
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


def _kept(work: _Work, call: Call, library: str) -> bool:
    """Seeded above (:func:`seeded`): left as it is, and said."""
    seed = seeded(work, call.scope, call.line, call.tests, library)
    if seed is not None:
        work.keep(call.line, f"{call.last}(...) left as is: seeded by {work.facts.code(seed.node)} at line "
                  f"{seed.line}", "every rank draws the same numbers from that seed")
    return seed is not None


def seeded(work: _Work, scope: Scope, line: int, tests: list[str], library: str, depth: int = 0) -> Call | None:
    """The seed of ``library`` above ``line`` of ``scope`` (unconditional, in that function or at the module level,
    or above every call of that function in its callers) with the same value on every rank; None if none.

    >>> from ddpkit.commands.convert.plan import plan
    >>> [k.what for k in plan("import numpy as np\\nfrom sklearn.model_selection import train_test_split\\n"
    ...                       "def load():\\n    return train_test_split(X)\\nnp.random.seed(args.seed)\\n"
    ...                       "load()\\n").kept]
    ['train_test_split(...) left as is: seeded by np.random.seed(args.seed) at line 5']
    """
    module = work.facts.scopes[""]
    for seed in work.facts.calls:
        inside = seed.tests == tests[:len(seed.tests)]  # (under the split's own ``if __name__ == ...``)
        if seed.line < line and inside and not seed.loops and seed.scope in (scope, module) and \
                _seeds(work, seed, library) and _same_everywhere(work, seed) and not unseeded_after(work, seed, line):
            return seed
    sites = callers(work.facts, scope)
    if scope is module or depth >= DEPTH or not sites:
        return None
    found = [seeded(work, site.scope, site.line, site.tests, library, depth + 1) for site in sites]
    return found[0] if all(found) else None


def _seeds(work: _Work, seed: Call, library: str, depth: int = 0) -> bool:
    """A seed of ``library``'s global generator: its own seed call, a script's function that makes one, or any
    other function named for a seed (``seed_everything``, ``utils.set_seed``); not another library's, a GPU's
    or a generator object's (``g.manual_seed``)."""
    name = seed.name or ""
    if name in SEEDS[library]:
        return True
    if any(name in names for names in SEEDS.values()) or name.startswith("torch.cuda.") or \
            seed.last == "manual_seed" or depth >= DEPTH:
        return False
    own = callee(work.facts, seed)
    if own is not None:  # the script's own helper: by what it calls
        return any(c.scope is own[0] and _seeds(work, c, library, depth + 1) for c in work.facts.calls)
    return seed.last in HELPERS or "seed" in seed.last.lower()


def _same_everywhere(work: _Work, seed: Call) -> bool:
    """The seed's value is the same on every rank: a literal, a setting (``args.seed``, ``SEED``), not a draw
    (DCGAN's ``opt.manualSeed = random.randint(1, 10000)``), a time, a process id or a rank."""
    if not seed.node.args:
        return False
    value = seed.node.args[0].value
    if "rank" in work.facts.code(value).lower():
        return False
    names = names_in(value)
    for binding in work.facts.bindings:
        if binding.target in names and binding.value is not None:
            inside = node_ids(binding.value)
            if any(id(c.node) in inside and (c.name or "").startswith(VARYING) for c in work.facts.calls):
                return False
    return True


def _torch(work: _Work) -> str:
    """The script's name for torch (``import torch``), or "" when it has none."""
    return next((local for local, full in work.facts.aliases.items() if full == "torch"), "")


def fresh_seed(call: Call) -> str | None:
    """The library a call gives a fresh, unfixed seed (``torch.seed()``, ``np.random.seed()``, ``random.seed()``),
    or None."""
    if call.node.args or call.last != "seed":
        return None
    name = call.name or ""
    return {"torch.seed": "torch", "torch.random.seed": "torch", "numpy.random.seed": "numpy",
            "random.seed": "random"}.get(name)


def unseeded_after(work: _Work, seed: Call, line: int) -> bool:
    """A seed given a fresh one below it in its function, above ``line`` (``torch.manual_seed(0)`` then
    ``torch.seed()``, as :mod:`.randomdata` writes around a dataset drawn at random): it seeds nothing below."""
    library = next((lib for lib, names in SEEDS.items() if (seed.name or "") in names), "torch")
    return any(c.scope is seed.scope and seed.line < c.line < line and fresh_seed(c) == library
               for c in work.facts.calls)

