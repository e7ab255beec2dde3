"""Data drawn at random and never seeded: a toy dataset whose ``__init__`` draws ``torch.randn(n, d)``, or
``X = np.random.rand(100, 5)`` handed to a ``TensorDataset``. Each rank of the converted script would draw its own
dataset: ``ddpkit.data_loader`` refuses one that differs between ranks, so the script could not start. The
statement that builds the data is drawn from a fixed seed, and the generator is given a fresh seed right after
(``torch.seed()``, as unseeded as the script had it): the data is alike on every rank, and every other draw (the
weights, the noise of each step) stays as the script drew it. Several such statements take seeds 0, 1, ...: a test
set drawn apart from the training set stays apart. A seed above the data (``torch.manual_seed(args.seed)``) keeps
it as it is; a statement that builds it in a loop header or a loop is listed.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader, TensorDataset\\n"
    ...          "X = torch.randn(64, 5)\\nm = torch.nn.Linear(5, 1)\\nopt = torch.optim.SGD(m.parameters(), lr=1)\\n"
    ...          "for (x,) in DataLoader(TensorDataset(X), batch_size=8):\\n"
    ...          "    m(x).sum().backward()\\n    opt.step()\\n")
    >>> p.text.splitlines()[3:6]
    ['torch.manual_seed(0)', 'X = torch.randn(64, 5)', 'torch.seed()']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow, splits
from ddpkit.commands.convert.flow import called_from_loop
from ddpkit.commands.convert.names import names_in
from ddpkit.commands.convert.scan import Call

_Work = Any  # the plan in the making (plan._Work): facts, edits, note, leave

LOADER = "torch.utils.data.DataLoader"
TORCH = ("torch.randn", "torch.rand", "torch.randint", "torch.normal", "torch.bernoulli", "torch.multinomial",
         "torch.randn_like", "torch.rand_like", "torch.randint_like")
IN_PLACE = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_", "geometric_", "log_normal_")
# numpy's and Python's draws; their shuffles and permutations are the splits module's (a fixed RandomState there)
UNDRAWN = ("seed", "RandomState", "default_rng", "Generator", "get_state", "set_state", "getstate", "setstate",
           "Random", "SystemRandom")
# (the seed, and the fresh seed after: what each library calls them, by the script's name for it)
RESEED = {"torch": ("{}.manual_seed({})", "{}.seed()"), "numpy": ("{}.random.seed({})", "{}.random.seed()"),
          "random": ("{}.seed({})", "{}.seed()")}
WHY = ("drawn at random and never seeded: each rank would draw its own dataset (ddpkit.data_loader refuses one that "
       "differs between ranks); alike on every rank, every other draw as unseeded as before")


def random_data(work: _Work) -> None:
    """Seed each statement that builds a training loader's data from unseeded draws (see the module)."""
    if not any(c.name == LOADER or c.name == "ddpkit.data_loader" for c in work.facts.calls):
        return
    sites: dict[int, tuple[Call, str]] = {}
    for call, library in _sites(work):
        for site in _once(work, call):  # (a helper's return: where each of its calls runs, review 44)
            sites.setdefault(site.line, (site, library))
    for k, (call, library) in enumerate(sorted(sites.values(), key=lambda s: s[0].line)):
        alias = next((local for local, full in work.facts.aliases.items() if full == library), None)
        # (a first conversion's ``torch.manual_seed(0)`` counts too: a second one says nothing)
        if alias is None or _seeded_anywhere(work, library) or \
                _returns(call) and not flow.callers(work.facts, call.scope):  # (nothing here runs it)
            continue
        # (in a function: one that runs once, ``main()``; a return, or a function called twice, would draw alike)
        if call.stmt is None or call.loops or called_from_loop(work.facts, call.scope) or _returns(call) or \
                call.scope.name and len(flow.callers(work.facts, call.scope)) > 1:  # (none: a CLI's, ``fire``)
            work.leave(call.line, f"the data is {WHY.split(':')[0]}, and built where no seed goes around it alone (a "
                       "loop, its header, a function run more than once): each rank would draw its own", "seed it "
                       "once above: "
                       f"{RESEED[library][0].format(alias, 0)}")
            continue
        seed, fresh = (text.format(alias, k) for text in RESEED[library])
        work.edits.before.setdefault(id(call.stmt), []).append(seed)
        work.edits.after.setdefault(id(call.stmt), []).insert(0, fresh)
        work.note(f"{seed} above it and {fresh} below", f"the data is {WHY}", call.line)


def _sites(work: _Work) -> list[tuple[Call, str]]:
    """(the call whose statement builds data from a draw, the draw's library): a draw bound to a name a loader's
    data is built from, or the construction of a dataset class of the file whose ``__init__`` draws."""
    facts = work.facts
    fed = _fed(work)
    found = []
    for draw in facts.calls:
        library = _library(draw)
        if library is None or draw.scope.name.endswith(splits.PER_SAMPLE) or \
                any(a.keyword is not None and a.keyword.value == "generator" for a in draw.node.args):
            continue
        owner = draw.scope.name.rsplit(".", 1)[0] if draw.scope.cls and draw.scope.name.endswith(".__init__") else None
        if owner is not None and f"{owner}.__getitem__" in facts.scopes:  # a map dataset drawing its samples
            found += [(c, library) for c in facts.calls if c.name == owner]
        elif draw.stmt is not None and any(b.stmt is draw.stmt and b.target in fed for b in facts.bindings):
            found.append((draw, library))
        elif any(c.name in (LOADER, "ddpkit.data_loader") and any(n is draw.node for n in m.findall(c.node, m.Call()))
                 for c in facts.calls if c.stmt is draw.stmt):  # (``DataLoader(TensorDataset(torch.randn(..)))``)
            found.append((draw, library))
    return found


def _once(work: _Work, call: Call, depth: int = 0) -> list[Call]:
    """Where to seed ``call``'s statement: itself; for a ``return`` of a helper, each call of the helper
    (``train_set = make_set(256)``, ``test_set = make_set(64)``: a seed above the ``return`` would give both the
    same draws, and a fresh one after it never runs; review 44)."""
    if not call.scope.name or depth >= 3 or not _returns(call):
        return [call]
    sites = flow.callers(work.facts, call.scope)
    return [s for site in sites for s in _once(work, site, depth + 1)] or [call]


def _returns(call: Call) -> bool:
    return call.stmt is not None and any(isinstance(node, cst.Return) for node in call.stmt.body)


def _seeded_anywhere(work: _Work, library: str) -> bool:
    """The script seeds the library somewhere, under an ``if`` too (``if args.seed is not None:
    torch.manual_seed(args.seed)``): its seed, not this module's, decides (review 44: a fixed seed around the
    data threw the user's away); unseeded at run time, the loader's check stops at once, naming the fix."""
    return any(c.node.args and ((c.name or "") in splits.SEEDS[library] or c.last in splits.HELPERS)
               for c in work.facts.calls)


def _fed(work: _Work) -> set[str]:
    """The names a DataLoader's arguments are built from, through the bindings that make them (two steps)."""
    fed: set[str] = set()
    for call in work.facts.calls:
        if call.name in (LOADER, "ddpkit.data_loader"):
            fed |= {n for a in call.node.args for n in names_in(a.value)}
    for _ in range(2):
        fed |= {n for b in work.facts.bindings if b.target in fed and b.value is not None for n in names_in(b.value)}
    return fed


def _library(call: Call) -> str | None:
    name = call.name or ""
    if name in TORCH or call.last in IN_PLACE and "." in name and not name.startswith(("numpy.", "random.")):
        return "torch"
    if name.startswith("numpy.random.") and call.last not in UNDRAWN and name not in splits.DRAWS:
        return "numpy"
    if name.startswith("random.") and name.count(".") == 1 and call.last not in UNDRAWN and name not in splits.DRAWS:
        return "random"
    return None
