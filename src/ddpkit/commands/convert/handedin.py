"""A training loader handed in: the loop that trains reads a parameter (``engine.train_step(model, dataloader)``,
StarGAN's ``Solver(celeba_loader, ...)`` that keeps it as ``self.celeba_loader`` and draws ``next(data_iter)``,
a callable trainer's ``trainer(train_loader)``) that no line of its own file passes: a caller in another module
builds the loader.

The trainer's file asks (:data:`~ddpkit.commands.convert.crossing.HANDED`, with the function and the argument) every
file that imports it; each that calls the function (builds the solver, calls the trainer) makes what it passes a
training loader where it is built: here (a ``DataLoader(...)`` of its own) or in the data module a function of which
returns it (asked in turn). When every such argument is, the trainer's loop is said fed by it (kept); converted
alone, it is left to you.

Example::

    >>> from ddpkit.commands.convert.crossing import settle
    >>> from ddpkit.commands.convert.plan import plan
    >>> files = {"solver.py": "class Solver:\\n    def __init__(self, loader):\\n        self.loader = loader\\n"
    ...                       "    def train(self, model, opt):\\n        it = iter(self.loader)\\n"
    ...                       "        for i in range(9):\\n            x = next(it)\\n"
    ...                       "            model(x).sum().backward()\\n            opt.step()\\n",
    ...          "main.py": "from torch.utils.data import DataLoader\\nfrom solver import Solver\\n"
    ...                     "loader = DataLoader(ds, batch_size=8)\\nSolver(loader).train(m, o)\\n"}
    >>> done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    >>> done["main.py"].text.splitlines()[3], done["solver.py"].left
    ('loader = ddpkit.data_loader(ds, global_batch_size=8, shuffle=False)', [])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.crossing import EVAL, HANDED, TRAIN, Ask, key, want_of
from ddpkit.commands.convert.handedparams import parameter, parameters
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.reductions import reductions
from ddpkit.commands.convert.scan import Binding, Call, Loop
from ddpkit.commands.convert.sums import sums_after

_Work = Any  # the plan in the making (plan._Work)
LOADERS = ("torch.utils.data.DataLoader", "ddpkit.data_loader")


def handed_in(work: _Work, line: int) -> bool:
    """The training loop reads a parameter of its function that no call in this file passes: said fed (kept) in a
    project where the callers' loader became a ``ddpkit.data_loader`` for training; else left to you (the runtime
    says it too at the first step: a prepared model fed by no ddpkit training loader). False: no such loop."""
    for loop in work.facts.loops:
        handed = sorted({p for n in reads(work, loop) for p in parameters(work, n, loop.scope, loop.line)})
        if not handed or not flow.trains(work.facts, loop):
            continue
        name, where, index = handed[0]
        elsewhere = work.crossing.elsewhere if work.crossing is not None else None
        if elsewhere is not None and loop.scope.name and loop.scope.name.rsplit(".", 1)[-1] not in elsewhere and \
                not flow.callers(work.facts, loop.scope):  # (killf's ``find_lr(data_loader, net, ...)``, unused)
            work.keep(loop.line, f"the training loop over {name} in {loop.scope.name}(), which no file of the project "
                      "calls, left as it is", "nothing runs it here")
            return True
        # asked whatever the answer: a project settles its asks in rounds (crossing.settle), and an ask dropped once
        # answered would take the answer back in the next round
        work.asks.append(Ask("", HANDED, TRAIN, loop.line))
        work.asks.extend(Ask("", f"{HANDED}:{w}:{i}:{n}", TRAIN, loop.line) for n, w, i in handed)
        built = work.crossing.provided.get(key("", HANDED))
        if built:
            work.keep(loop.line, f"the training loop over {name} (a parameter of {where}) left as it is",
                      f"what its callers in {built} pass is a ddpkit.data_loader for training")
            reductions(work, [loop], None, True)  # its sums over the whole set: this rank's shard's, reduced
            _evaluated(work, set(handed), built)
            return True
        fix = "make the loader passed in a ddpkit.data_loader(dataset, global_batch_size=B) where it is built"
        if work.crossing.own:  # converted together already: some caller's argument was not followed
            work.leave(loop.line, f"the training loop reads {name}, a parameter of {where}: what a caller in the "
                       "project passes was not made a training ddpkit.data_loader (a value chosen in an if / else, "
                       "or built in a way convert does not follow)", f"{fix}, then convert again")
            return True
        work.leave(loop.line, f"the training loop reads {name}, a parameter of {where} that no call in this file "
                   "passes: its loader is built by a caller in another module", "convert them together (ddpkit "
                   f"convert --imports SCRIPT, or a folder), or {fix}")
        return True
    return False


def ask_evaluations(work: _Work) -> None:
    """A loop that evaluates a parameter of its function that no call in this file passes (clovaai's
    ``validation(model, valid_loader)``, called in the training loop of ``train.py``): its callers are asked to
    keep what they pass whole (:data:`EVAL`), not to guess its role by its ``shuffle=True``."""
    for loop in work.facts.loops:
        if not isinstance(loop.node, cst.For) or flow.trains(work.facts, loop):
            continue
        for found in {parameter(work, n, loop.scope, loop.line) for n in reads(work, loop)} - {None}:
            assert found is not None
            name, where, index = found
            work.asks.append(Ask("", f"{HANDED}:{where}:{index}:{name}", EVAL, loop.line))


def passed_to_evaluate(work: _Work) -> list[Call]:
    """The DataLoaders of this file that its calls hand to another module's evaluation (:func:`ask_evaluations`
    asked of this file: ``module:function:index:param`` wanted as :data:`EVAL`)."""
    found: list[Call] = []
    for _, sites in _handed(work, EVAL):
        for _, bound in sites:
            found += [c for c in work.facts.calls if bound is not None and bound.value is not None
                      and c.node is bound.value and c.name == LOADERS[0]]
    return found


def imported_evaluated(work: _Work, origin_of: Any) -> list[tuple[int, str]]:
    """(the line, the name) of each loader imported from another module of the project that this file hands both to
    a trainer (asked of its module as a training loader) and to another module's evaluation: sharded for the one,
    the evaluation would count this rank's shard only. One handed to an evaluation alone is asked of its module as
    an evaluation loader (kept whole there, said so); so is what an imported factory returns (``test_loader =
    make_loader(100, is_training=False)``, then ``test(test_loader)``: the factory splits by the flag)."""
    trained = {(a.module, a.name) for a in work.asks if a.kind == TRAIN}
    found = []
    for want, sites in _handed(work, EVAL):
        for site, bound in sites:
            made = bound.whole if bound is not None and isinstance(bound.whole, cst.Call) else None
            origin = origin_of(bound) if made is not None and dotted(made.func) not in LOADERS else None
            origin = origin or _imported(work, want, site)
            if origin is not None and origin in trained:
                found.append((site.line, origin[1]))
            elif origin is not None:  # its module keeps it whole, told why (not "nothing reads it")
                work.asks.append(Ask(origin[0], origin[1], EVAL, site.line))
    return found


def _handed(work: _Work, kind: str) -> list[tuple[str, list[tuple[Call, Binding | None]]]]:
    """Each want ``module:Callable:index:param`` of ``kind`` asked of this file, with this file's calls of that
    callable and the binding of what each passes there."""
    found = []
    for want, wanted in work.crossing.wants.items():
        w = want_of(want)
        if wanted != kind or w is None or w.step:
            continue
        name, _, element = w.param.partition("[")  # ``loaders[0]``: element 0 of what is passed as ``loaders``
        name = name.partition(".")[0]  # (``data.train_loader``: an attribute of what is passed as ``data``)
        # (a call that hands in ``None``, a GAN book's evaluation mode ``Model(..., None, ...)``, hands in no loader)
        found.append((want, [(site, _part(work, site, _argument(work, site, w.index, name), element))
                             for site in work.facts.calls if flow.runs(work.facts, site, w.module, w.function) and
                             not _none(given_as(site, w.index, name))]))
    return found


def _none(given: cst.BaseExpression | None) -> bool:
    return given is not None and m.matches(given, m.Name("None"))


def _part(work: _Work, site: Call, bound: Binding | None, element: str) -> Binding | None:
    """Element k of what ``bound`` holds (``element``: ``"k]"``; empty: the whole): a tuple's item followed to
    its own binding, or element k of a call's result (``get_loaders(16)``: asked of its module as
    ``get_loaders()[k]``)."""
    if not element or bound is None or bound.value is None:
        return bound if not element else None
    if element.startswith("'"):  # ``dataloaders['train']``: the item of a dict literal passed as ``dataloaders``
        key = element.rstrip("]").strip("'")
        item = next((e.value for e in bound.value.elements if isinstance(e, cst.DictElement) and
                     isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == key), None) \
            if isinstance(bound.value, cst.Dict) else None
        name = dotted(item) if item is not None else None
        return flow.binding_of(work.facts, name, site.scope, site.line) if name else None
    k = int(element.rstrip("]"))
    value = bound.value
    if isinstance(value, (cst.Tuple, cst.List)):
        item = value.elements[k].value if k < len(value.elements) else None
        name = dotted(item) if item is not None else None
        return flow.binding_of(work.facts, name, site.scope, site.line) if name else None
    return dataclasses.replace(bound, value=None, whole=value, index=k) if isinstance(value, cst.Call) else None


def _evaluated(work: _Work, handed: set[tuple[str, str, int]], built: str) -> None:
    """The loops that evaluate what the training loop's callers hand in (a Solver's ``accuracy()`` over the same
    ``self.loader``): sharded now, so their sums are reduced across ranks, or refused when they keep what cannot be
    summed (each rank would report its shard only)."""
    for loop in work.facts.loops:
        if flow.trains(work.facts, loop) or not isinstance(loop.node, cst.For):
            continue
        # (the binding that reaches this loop only: ``data = self.val_loader`` after training is another loader)
        if not {parameter(work, n, loop.scope, loop.line) for n in reads(work, loop)} & handed:
            continue
        if loop.stored or loop.breaks or sums_after(work.facts, loop, False, frozenset()) is None:
            work.leave(loop.line, f"this evaluation loops over the loader its callers in {built} pass, sharded "
                       "for training, and keeps what it cannot sum across ranks: each rank would report its shard "
                       "only", "evaluate on a DataLoader of its own (DataLoader(dataset, batch_size): convert "
                       "keeps it whole, every rank evaluating the whole set), then convert again", blocks=True)
            return
        reductions(work, [loop], None, False)


def reads(work: _Work, loop: Loop) -> set[str]:
    """The names a loop takes its batches from: a ``for`` loop's iterable (:func:`iterated`) and what the ones
    bound to a wrapper's call wrap (``loop = tqdm(loader)`` then ``for b in loop``: ``loader`` too), and what
    ``next(...)`` in its body draws from (``it = iter(self.loader)`` then ``x = next(it)``: ``self.loader``)."""
    found: set[str] = set()
    names = iterated(loop.node.iter) if isinstance(loop.node, cst.For) else set()
    found |= names
    for name in names:
        bound = flow.binding_of(work.facts, name, loop.scope, loop.line)
        # (not what a factory of the project's own is handed: ``get_dataloader(train_set, bs, train=True)`` builds
        # the loader from a dataset, it wraps no loader)
        if bound is not None and isinstance(bound.value, cst.Call) and \
                imported_from(work.facts, dotted(bound.value.func) or "") is None:
            found |= iterated(bound.value)
    for call in loop.calls:
        if call.name == "next" and call.node.args:
            found |= _drawn(work, call.node.args[0].value, call)
        found |= _drawn_by_helper(work, call)
    return found


def _drawn_by_helper(work: _Work, call: Call) -> set[str]:
    """What a function of this file that ``call`` runs draws with ``next(...)`` from a parameter, as the argument
    ``call`` passes (shayneobrien's ``x, y = self.process_batch(self.train_iter)``, whose body takes
    ``next(iter(iterator))``): ``self.train_iter``."""
    target = flow.callee(work.facts, call)
    if target is None:
        return set()
    scope, skip = target
    found: set[str] = set()
    for inner in [c for c in work.facts.calls if c.scope is scope and c.name == "next" and c.node.args]:
        for param in _drawn(work, inner.node.args[0].value, inner) & set(scope.params):
            given = flow.argument_for(call, param, scope, skip)
            name = dotted(given) if given is not None else None
            found |= {name} if name else set()
    return found


def _drawn(work: _Work, node: cst.BaseExpression, call: Call) -> set[str]:
    """What ``next(node)`` draws from: ``iter(x)`` -> x, a name bound to ``iter(x)`` (its last binding before the
    call, or the loop's own re-binding after StopIteration) -> x."""
    if isinstance(node, cst.Call) and dotted(node.func) == "iter" and node.args:
        name = dotted(node.args[0].value)
        return {name} if name else set()
    name = dotted(node)
    bound = [b for b in work.facts.bindings if b.target == name and b.scope is call.scope] if name else []
    return set().union(*(_drawn(work, b.value, call) for b in bound if isinstance(b.value, cst.Call)))


def iterated(node: cst.BaseExpression) -> set[str]:
    """The names a ``for`` loop may take its items from: the iterable, or what ``enumerate`` / ``tqdm`` / ``zip``
    are handed; not the function that wraps it (``tqdm``), nor what ``range`` counts to (``settings.EPOCH``).

    >>> sorted(iterated(cst.parse_expression("enumerate(tqdm(train_loader, total=n))")))
    ['train_loader']
    >>> iterated(cst.parse_expression("range(1, settings.EPOCH + 1)"))
    set()
    """
    name = dotted(node)
    if name is not None:
        return {name}
    if isinstance(node, cst.Call) and dotted(node.func) not in ("range", "len"):
        # (``tqdm(iterable=loader, desc=...)``: the iterable named)
        return set().union(*(iterated(a.value) for a in node.args if not a.star and
                             (a.keyword is None or a.keyword.value == "iterable")))
    return set()


def passed(work: _Work, origin_of: Any) -> list[tuple[str, list[Call], bool | None]]:
    """For each want ``module:Callable:index:param`` (a trainer of that module asks what its callers hand in): (the
    want, the DataLoaders of this file that its calls pass, to become training ones, whether every argument is
    one of those or a training loader already: a ``ddpkit.data_loader``, or a data module's, asked of it here
    and said provided; None: this file makes no such call). ``origin_of(binding)``: (module, name) of a value an
    imported function returns."""
    found = []
    for want, sites in _handed(work, TRAIN):
        loaders: list[Call] = []
        every = True
        attr = _attribute_of(want)
        for site, bound in sites:
            value = bound.value if bound is not None else None
            made = next((c.name for c in work.facts.calls if value is not None and c.node is value), None)
            origin = origin_of(bound) if bound is not None and made not in LOADERS else _imported(work, want, site)
            if attr:  # (``LoadData().train_loader`` of a data object's class imported: asked of its module)
                origin = (origin[0], f"{origin[1]}.{attr}") if origin is not None and origin[1].endswith("()") \
                    else None
                every &= origin is not None
                if origin is not None:
                    work.asks.append(Ask(origin[0], origin[1], TRAIN, site.line))
                    every &= key(*origin) in work.crossing.provided
            elif made == LOADERS[0]:
                loaders.extend(c for c in work.facts.calls if c.node is value)
            elif origin is not None:
                work.asks.append(Ask(origin[0], origin[1], TRAIN, site.line))
                every &= key(*origin) in work.crossing.provided
            else:
                every &= made == LOADERS[1]
        found.append((want, loaders, every if sites else None))
    return found


def _attribute_of(want: str) -> str:
    """The attribute a want asks of what is passed (``trainer:Trainer.fit:0:data.train_loader``: ``train_loader``);
    empty for the value itself.

    >>> _attribute_of("trainer:Trainer.fit:0:data.train_loader"), _attribute_of("trainer:fit:1:loaders[0]")
    ('train_loader', '')
    """
    return want.rsplit(":", 1)[-1].partition("[")[0].partition(".")[2]


def _imported(work: _Work, want: str, site: Call) -> tuple[str, str] | None:
    """(the module, the name) of what ``site`` passes for ``want``'s argument when it is a name imported from
    another module of the project (distiller's ``from data import train_loader``, then ``fit(net, train_loader)``)."""
    _, _, index, name = want.split(":")
    if "[" in name:
        return None
    given = given_as(site, int(index), name)
    written = dotted(given) if given is not None else None
    if not written or flow.binding_of(work.facts, written, site.scope, site.line) is not None:
        return None
    return imported_from(work.facts, written)


def given_as(call: Call, index: int, name: str) -> cst.BaseExpression | None:
    """What ``call`` passes as positional argument ``index``, or as ``name=``."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    return positional[index].value if index < len(positional) else \
        next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == name), None)


def _argument(work: _Work, call: Call, index: int, name: str) -> Binding | None:
    """The binding of what ``call`` passes as argument ``index`` or ``name=``; None when it passes no name."""
    given = given_as(call, index, name)
    if isinstance(given, cst.Subscript):  # ``loaders['train']``: the value under that key of a dict literal
        return _item(work, call, given)
    written = dotted(given) if given is not None else None
    return flow.binding_of(work.facts, written, call.scope, call.line) if written else None


def _item(work: _Work, call: Call, given: cst.Subscript) -> Binding | None:
    """What ``d['key']`` holds where ``d`` is bound to a dict literal with that string key: its binding, its value
    that item's (None: anything else)."""
    index = given.slice[0].slice if len(given.slice) == 1 else None
    key = index.value if isinstance(index, cst.Index) else None
    name = dotted(given.value)
    bound = flow.binding_of(work.facts, name, call.scope, call.line) if name else None
    if bound is None or not isinstance(bound.value, cst.Dict) or not isinstance(key, cst.SimpleString):
        return None
    value = next((e.value for e in bound.value.elements if isinstance(e, cst.DictElement) and
                  isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == key.evaluated_value), None)
    return dataclasses.replace(bound, value=value) if value is not None else None
