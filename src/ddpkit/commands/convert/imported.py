"""Loaders built in another module of a project: a training loop here reads a name imported from it (``from
Data.data import train_loader``), the value a function of it returns (``train_loader, _ = get_loaders(64)``; each
of functions picked in an ``if`` / ``elif``), an entry of the dict it returns (``fetch_dataloader(...)['train']``)
or what a method of its class returns (``gen.instance_a_train_loader(...)``). The training ones are asked of that
module (:mod:`.crossing`), which converts them where they are built (:mod:`.askedkeys` for a dict's); the loop's file
says so (kept), or leaves it to you when converted alone.

Example::

    >>> from ddpkit.commands.convert.crossing import settle
    >>> from ddpkit.commands.convert.plan import plan
    >>> files = {"data.py": "from torch.utils.data import DataLoader\\ndef get(b):\\n"
    ...                     "    return {'tr': DataLoader(a, batch_size=b, shuffle=True), 'te': DataLoader(c)}\\n",
    ...          "train.py": "import torch\\nimport data\\nld = data.get(8)['tr']\\nm = torch.nn.Linear(2, 2)\\n"
    ...                      "opt = torch.optim.SGD(m.parameters(), lr=1)\\nfor x in ld:\\n"
    ...                      "    m(x).sum().backward()\\n    opt.step()\\n"}
    >>> done = settle(list(files), lambda rel, crossing: plan(files[rel], crossing=crossing))
    >>> [k.what for k in done["train.py"].kept], done["data.py"].text.splitlines()[-1].strip()[:40]
    (['the training loop over ld left as it is'], "return {'tr': ddpkit.data_loader(a, glob")
"""

from __future__ import annotations

import dataclasses
from typing import Any

import libcst as cst

from ddpkit.commands.convert import bysplit, drawn, flow, handedin, handsize, returns, sources
from ddpkit.commands.convert.crossing import EVAL, TRAIN, Ask, key, returned
from ddpkit.commands.convert.instances import instance_class
from ddpkit.commands.convert.names import dotted, resolve, unpacked
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.reductions import reductions
from ddpkit.commands.convert.scan import Binding, Facts, Loop
from ddpkit.commands.convert.sums import sums_after

_Work = Any  # the plan in the making (plan._Work)


def imported_loader(work: _Work, line: int) -> bool:
    r"""The loops iterate loaders the script imports from a module of its own (``from Data.data import
    train_loader``), or that a function imported from one returns (``train_loader, _ = get_loaders(64)``): not
    batches fed by hand. The training ones are asked of their module (:mod:`.crossing`) and
    said done when it made them ``ddpkit.data_loader``\ s; else left to you. An evaluation loader read from
    another module stays as it is there: each rank evaluates every batch, which is right."""
    reads: dict[str, bool] = {}  # name -> read by a loop that trains (as a loader's role is told: flow.trains)
    origins: dict[str, tuple[str, str]] = {}  # name -> (its module, its name there)
    every: dict[str, list[tuple[str, str]]] = {}  # name -> each origin (functions picked in an if/elif); for a
    # name some loop trains on, the origins of those loops only
    taught: dict[str, list[tuple[str, str]]] = {}  # name -> the origins of the loops that train on it
    roles: dict[tuple[str, str], bool] = {}  # origin -> whether a loop over what it returns trains
    trained: dict[str, list[Loop]] = {}  # name -> the training loops over it
    looped: dict[str, list[Loop]] = {}  # name -> every loop over it
    for loop in work.facts.loops:
        generated = sources.generated(work.facts, loop)
        for name in handedin.reads(work, loop) or ([generated[0]] if generated else []):
            imported = imported_from(work.facts, name) if not generated else None
            found = [generated[1]] if generated else [imported] if imported else \
                _returned_by_import(work.facts, name, loop) or _attribute(work.facts, name, loop)
            picked = sources.picked(work.facts, name, loop) if not found else []
            if picked:  # ``data_loader = loader.train_loader if is_train else loader.test_loader``
                for origin, trains in picked:
                    roles[origin] = roles.get(origin, False) or trains
                reads[name] = reads.get(name, False) or any(t for _, t in picked)
                origins[name] = next((o for o, t in picked if t), picked[0][0])
                every.setdefault(name, []).extend(o for o, t in picked if not t)
                taught.setdefault(name, []).extend(o for o, t in picked if t)
                trained.setdefault(name, []).extend([loop] if reads[name] else [])
                looped.setdefault(name, []).append(loop)
            elif found:
                trains = flow.trains(work.facts, loop)
                # (one parameter name, ``data``, in ``train(data, ...)`` and ``test(data, ...)``: each origin's
                # role is its own loops', not the name's; the triplet network's test loader was sharded)
                for origin in found:
                    roles[origin] = roles.get(origin, False) or trains
                if trains or name not in origins:
                    origins[name] = found[0]
                mine = (taught if trains else every).setdefault(name, [])
                mine.extend(o for o in found if o not in mine)
                reads[name] = reads.get(name, False) or trains
                trained.setdefault(name, []).extend([loop] if trains else [])
                looped.setdefault(name, []).append(loop)
    if not reads:
        return False
    every.update(taught)  # a name some loop trains on: the origins of those loops only
    training = sorted(n for n, trains in reads.items() if trains)
    # asked whatever the answer so far: a project settles its asks in rounds (crossing.settle), and an ask
    # dropped once answered would take the answer back in the next round
    work.asks.extend(Ask(*o, TRAIN if trains else EVAL, line) for o, trains in roles.items())
    done = {n: work.crossing.provided.get(key(*origins[n])) if all(key(*o) in work.crossing.provided
                                                                   for o in every[n]) else None
            for n in training}
    for n in training:
        # (bound in the function that trains on it, easy_lstm's ``train_and_evaluate``: its scope, not the module's)
        at = trained[n][0] if trained.get(n) else None
        home = flow.binding_of(work.facts, n, at.scope if at is not None else work.facts.scopes[""],
                               at.line if at is not None else line)
        scope = home.scope if home is not None else work.facts.scopes[""]
        evaluated = [lp for lp in flow.loops_reading(work.facts, n, scope) if not flow.trains(work.facts, lp)]
        if done[n] and evaluated:  # sharded there for training: here each rank would evaluate only its shard
            work.leave(evaluated[0].line, f"{n}, a ddpkit.data_loader for training in {done[n]}, is also "
                       "evaluated here: each rank would evaluate only its shard, and nothing here sums the "
                       "ranks' results", "evaluate on a DataLoader of its own, its loop under torch.no_grad() "
                       "(convert keeps it whole: every rank reads all of it), or ddpkit.reduce(...) the sums after "
                       "that loop, then convert again", blocks=True)
            return True
        if done[n]:  # sharded there: the sums its training loops keep here are this rank's shard's
            work.fed |= {id(lp.node) for lp in trained[n]}  # (a step of another module run there: fed, stepped.py)
            work.keep(line, f"the training loop over {n} left as it is", f"{n} is a ddpkit.data_loader where it "
                      f"is built, in {done[n]} (imported from {origins[n][0]})")
            reductions(work, trained[n], None, True)
            first = trained[n][0]  # (a peek at its first batch, here: rank 0's part of one, as one built here)
            drawn.said_peeked(work, [b for b in [flow.binding_of(work.facts, n, first.scope, first.line)] if b])
            if not handsize.kept(work, origins[n]):  # (kept per process there: the loop's sizes hold)
                _sized_here(work, trained[n], str(done[n]))
    fed = {b.target for n in training for lp in trained[n] if (b := _source(work.facts, n, lp)) is not None}
    _siblings(work, {origins[n] for n in training if done[n]}, fed | set(training))
    for n in [n for n in reads if not reads[n] and work.crossing.provided.get(key(*origins[n]))]:
        # evaluated only here, sharded for another file's training there: its sums reduced, or refused
        fors = [lp for lp in looped[n] if isinstance(lp.node, cst.For)]
        if any(lp.stored or lp.breaks or sums_after(work.facts, lp, False, frozenset()) is None for lp in fors):
            work.leave(fors[0].line if fors else line, f"{n} is sharded for training where it is built, in "
                       f"{work.crossing.provided[key(*origins[n])]}, and this evaluation keeps what it cannot sum "
                       "across ranks: each rank would report its shard only", "evaluate on a DataLoader of its own "
                       "(DataLoader(dataset, batch_size): convert keeps it whole, every rank evaluating the whole "
                       "set), then convert again", blocks=True)
            return True
        reductions(work, fors, None, False)
    missing = [n for n in training if not done[n]]
    if not training or not missing:  # (evaluations only: asked, so as to learn whether they are sharded there)
        return True
    where = ", ".join(f"{n!r} from {origins[n][0]}" for n in (missing or sorted(reads)))
    fix = "make the training loader a ddpkit.data_loader(dataset, global_batch_size=B) where it is built (an " \
        "evaluation loader may stay: each rank then evaluates every batch, which is right)"
    if work.crossing.own:  # converted together already: what stopped it is said where the loader is built
        work.leave(line, f"the loops read loaders built in other modules of the project ({where}), whose "
                   "training loader was not converted there (see that module's lines): as they are, every rank "
                   "reads every batch", f"{fix}, then convert again")
        return True
    work.leave(line, f"the loops read loaders imported from modules of the script ({where}), and convert does "
               "not follow a name from one module to another outside a project: as they are, every rank reads "
               "every batch", f"convert them together (ddpkit convert --imports SCRIPT, or a folder), or {fix}, "
               "and wrap the model with ddpkit.prepare_model(...) where it is built")
    return True


def _siblings(work: _Work, made: set[tuple[str, str]], fed: set[str]) -> None:
    """Another name bound from the same call that made a training loader (LLMs-from-scratch's
    ``create_dataloader_v1(..., shuffle=False)`` for validation, beside the training call): the helper now makes a
    training shard, so what is done with it sees this rank's only. Listed where it is bound; ``fed``: the names the
    training loops read (a name bound from that call alone is the training loader itself)."""
    by_origin: dict[tuple[str, str], list[Binding]] = {}
    made = {(module, bysplit.base(name)) for module, name in made}  # (each split's call of one factory alike)
    for binding in work.facts.bindings:
        origin = origin_of(work.facts, binding) if binding.whole is not None else None
        if origin is not None and (origin[0], bysplit.base(origin[1])) in made:
            by_origin.setdefault((origin[0], bysplit.base(origin[1])), []).append(binding)
            if bysplit.told(origin[1]) and binding.target not in fed and \
                    not any(a.module == origin[0] and a.name == origin[1] for a in work.asks):
                # (``self._get_data(flag='val')``, evaluated in a method it is handed to: asked too, so the factory
                # says whether its string keeps it whole, iTransformer's ``if flag == 'train' else DataLoader``)
                work.asks.append(Ask(origin[0], origin[1], EVAL, binding.line))
    whole = {(a.module, a.name) for a in work.asks if a.kind == EVAL and key(a.module, a.name)
             not in work.crossing.provided}  # a split asked for evaluation, and kept whole there (bysplit.py)
    by_origin = {o: [b for b in bound if origin_of(work.facts, b) not in whole] for o, bound in by_origin.items()}
    for origin, bound in by_origin.items():
        if len({b.target for b in bound}) < 2:
            continue
        for binding in (b for b in bound if b.target not in fed and not _passed_on(work.facts, b)):
            if any(name == binding.target for name, _scope, line, _node in work.facts.reads if line > binding.line):
                work.leave(binding.line, f"{binding.target} comes from {origin[1]} of {origin[0]}, which makes the "
                           "training loader a ddpkit.data_loader there (each rank its shard): what is done with "
                           f"{binding.target} sees this rank's shard only", "build it with a DataLoader of its own "
                           "(each rank then reads all of it), or ddpkit.reduce(...) what is computed over it")


def _passed_on(facts: Facts, binding: Binding) -> bool:
    """Its function returns ``binding``'s name (``data_set, data_loader = data_provider(self.args, flag)`` then
    ``return data_set, data_loader``): its callers use it, and are followed (:func:`_through_own`)."""
    return any(scope is binding.scope and binding.target in {dotted(e) for e in
               unpacked(value)}
               for scope, value in facts.returns)


def _returned_by_import(facts: Facts, name: str, loop: Loop) -> list[tuple[str, str]]:
    """[(the module, ``get_loaders()[0]``)] when ``name`` is bound from a call of a function imported from a module
    of the script's own (:func:`~ddpkit.commands.convert.crossing.returned` names its value there): one per such
    binding of its scope, so that functions picked in an ``if``/``elif`` (LynnHo's ``data.make_*_dataset``) are
    all asked; [] otherwise.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from data import get\\ntr, te = get(8)\\nfor x in tr:\\n    pass\\n"))
    >>> _returned_by_import(facts, "tr", facts.loops[0])  # (``8``: passed, not a string; bysplit.literals)
    [('data', 'get()[0]@[["#0", null]]')]
    >>> facts = scan(parse("import data\\nif a:\\n    tr, s = data.one(8)\\nelse:\\n    tr, s = data.two(8)\\n"
    ...                    "for x in tr:\\n    pass\\n"))
    >>> _returned_by_import(facts, "tr", facts.loops[0])
    [('data', 'one()[0]@[["#0", null]]'), ('data', 'two()[0]@[["#0", null]]')]
    """
    binding = _source(facts, name, loop)
    if binding is None or origin_of(facts, binding) is None:  # what the loop reads is no such call
        return []
    same = [b for b in facts.bindings if b.target == binding.target and b.scope is binding.scope]
    return [origin for origin in map(lambda b: origin_of(facts, b), same) if origin is not None]


FACTORIES = ("torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.randn", "torch.rand", "torch.randint",
             "torch.arange", "torch.eye", "torch.FloatTensor", "torch.LongTensor", "torch.Tensor")


def _sized_here(work: _Work, loops: list[Loop], built: str) -> None:
    """A training loop over a loader another module builds with the global batch, whose function sizes a tensor
    by a batch size of its own (FactorVAE's ``zeros = torch.zeros(self.batch_size)`` beside ``return_data(args)``
    in dataset.py): each rank takes B/N there, the targets stay B."""
    if work.per_process_batch:
        return
    for loop in loops:
        for call in work.facts.calls:
            if call.scope is not loop.scope or call.line > loop.end or \
                    resolve(dotted(call.node.func), work.facts.aliases) not in FACTORIES:
                continue
            sized = next((d for a in call.node.args[:1] for d in [dotted(a.value)]
                          if d and d.rsplit(".", 1)[-1].lower() in ("batch_size", "batchsize", "bs")), None)
            held = flow.binding_of(work.facts, sized, loop.scope, call.line) if sized else None
            if held is not None and loop.line < held.line <= loop.end:  # ``batch_size = x.size(0)``: the batch's
                continue
            if sized is not None:
                work.leave(call.line, f"{call.last}({sized}, ...) is sized by a batch size of its own, for the "
                           f"training loop over a loader {built} builds with the global batch: each rank takes "
                           f"{sized} / N there", "size it from the batch (x.size(0)), or convert with "
                           "--per-process-batch (the global batch is then N x the batch), then convert again")
                return


def _source(facts: Facts, name: str, loop: Loop) -> Binding | None:
    """The binding a loop's loader name comes from, through plain names (``self.train_iter = train_iter``, set from
    ``Trainer(m, train_iter)``)."""
    binding = flow.binding_of(facts, name, loop.scope, loop.line)
    for _ in range(3):
        source = dotted(binding.value) if binding is not None and binding.value is not None else None
        if source is None or binding is None:
            break
        binding = flow.binding_of(facts, source, binding.scope, binding.line)
    return binding


def _attribute(facts: Facts, name: str, loop: Loop) -> list[tuple[str, str]]:
    """[(the module, ``Cifar().train``)] for ``dataset.train`` where ``dataset = Cifar(...)``, a class imported from
    a module of the project that keeps its loaders as attributes (davda54/sam's ``data/cifar.py``); [] otherwise.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from data import Cifar\\nds = Cifar(8)\\nfor x in ds.train:\\n    pass\\n"))
    >>> _attribute(facts, "ds.train", facts.loops[0])
    [('data', 'Cifar().train')]
    """
    scope, line = loop.scope, loop.line
    bound = flow.binding_of(facts, name, scope, line) if "." not in name else None
    if bound is not None and "." in (dotted(bound.value) or ""):  # ``trainloader = dataset.trainloader``, or
        name, scope, line = dotted(bound.value) or "", bound.scope, bound.line  # a parameter it is passed as
    head, _, attr = name.partition(".")
    if not attr or "." in attr or head == "self":
        return []
    held = flow.binding_of(facts, head, scope, line)
    made = held.value if held is not None else None
    origin = imported_from(facts, dotted(made.func) or "") if isinstance(made, cst.Call) else None
    # (a class, ``Cifar(...)``, or a function of that module that returns one: center-loss's ``datasets.create``)
    return [(origin[0], f"{origin[1]}().{attr}")] if origin is not None else []


def origin_of(facts: Facts, binding: Binding, depth: int = 0) -> tuple[str, str] | None:
    """(the module, ``get_loaders()[0]``) of a binding from a call of an imported function, or of one entry of the
    dict such a call returns (cs230's ``train_dl = dataloaders['train']``, or ``data.get(8)['train']``:
    ``fetch_dataloader()['train']``)."""
    call = binding.whole
    func = dotted(call.func) if isinstance(call, cst.Call) else None
    origin = imported_from(facts, func) if func else None
    if origin is not None and isinstance(call, cst.Call):  # (the strings it passes: one factory, every split)
        return origin[0], returned(origin[1], binding.index) + (bysplit.literals(call, lambda _: None) if not depth
                                                                else "")
    made = _instance_method(facts, call, binding) if isinstance(call, cst.Call) else None
    if made is not None:  # NCF's ``sample_generator.instance_a_train_loader(...)``: the class's method returns it
        return made[0], returned(made[1], binding.index)
    through = _through_own(facts, call, binding) if isinstance(call, cst.Call) and not depth else None
    if through is not None:
        return through
    key_ = _string_key(binding.value)
    inner = binding.value.value if key_ is not None and isinstance(binding.value, cst.Subscript) else None
    holder = dotted(inner) if inner is not None else None
    held = flow.binding_of(facts, holder, binding.scope, binding.line) if holder and depth < 2 else \
        dataclasses.replace(binding, value=inner, whole=inner, index=-1) if isinstance(inner, cst.Call) else None
    origin = origin_of(facts, held, depth + 1) if held is not None and held.value is not None else None
    if origin is None or not origin[1].endswith("()"):
        return None
    return origin[0], f"{origin[1]}[{key_!r}]"


def _through_own(facts: Facts, call: cst.Call, binding: Binding) -> tuple[str, str] | None:
    """(the module, ``data_provider()[1]@#1='train'``) of ``_, loader = self._get_data(flag='train')``, a function of
    this file that returns what a function imported from the project returns (``data_set, data_loader =
    data_provider(self.args, flag)``; ``return data_set, data_loader``), with the strings passed on to it."""
    made = next((c for c in facts.calls if c.node is call), None)
    target = flow.callee(facts, made) if made is not None else None
    if made is None or target is None:
        return None
    scope, skip = target
    for element in returns.at(facts, scope, binding.index):  # (``return a, b`` bound whole: no name to follow)
        name = dotted(element)
        held = flow.binding_of(facts, name, scope, 1 << 30) if name else None
        inner = held.whole if held is not None else None
        origin = imported_from(facts, dotted(inner.func) or "") if isinstance(inner, cst.Call) else None
        if held is not None and isinstance(inner, cst.Call) and origin is not None:
            def passed(param: str) -> cst.BaseExpression | None:  # (one the function rebinds: not the string)
                kept = param in scope.params and not bysplit.rebound(facts, scope, param)
                return flow.argument_for(made, param, scope, skip) if kept else None
            return origin[0], returned(origin[1], held.index) + bysplit.literals(inner, passed)
    return None


def _instance_method(facts: Facts, call: cst.Call, binding: Binding) -> tuple[str, str] | None:
    """(the module, ``Class.method``) of ``obj.method(...)`` where ``obj`` is bound to ``Class(...)``, or of
    ``Class(...).method(...)`` (chained), a class imported from a module of the project; None otherwise."""
    if not isinstance(call.func, cst.Attribute) or not isinstance(call.func.value, (cst.Name, cst.Call)):
        return None
    origin = instance_class(facts, call.func.value, binding.scope, binding.line)
    return (origin[0], f"{origin[1]}.{call.func.attr.value}") if origin is not None else None


def _string_key(node: cst.BaseExpression | None) -> str | None:
    """``'train'`` of ``loaders['train']``; None for any other expression."""
    if not isinstance(node, cst.Subscript) or len(node.slice) != 1:
        return None
    index = node.slice[0].slice
    value = index.value if isinstance(index, cst.Index) else None
    return value.evaluated_value if isinstance(value, cst.SimpleString) and \
        isinstance(value.evaluated_value, str) else None
