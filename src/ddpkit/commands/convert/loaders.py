"""The loaders of ``ddpkit convert``: each ``DataLoader`` a training or an evaluation one, by what the loops over
it do (:mod:`ddpkit.commands.convert.flow`), rewritten to ``ddpkit.data_loader``, and the sums its loops keep
reduced across ranks (:mod:`ddpkit.commands.convert.sums`); what cannot be told is left or refused.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("from torch.utils.data import DataLoader\\nfor x in DataLoader(ds, batch_size=8):\\n"
    ...          "    x.sum().backward()\\n")
    >>> p.text.splitlines()[-2]
    'for x in ddpkit.data_loader(ds, global_batch_size=8, shuffle=False):'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import batch, flow, handedin
from ddpkit.commands.convert.apply import LOADER_PARAMETERS, loader_call
from ddpkit.commands.convert.crossing import EVAL, TRAIN, Ask, key, returned
from ddpkit.commands.convert.flow import callee, loops_reading, peek, roles_said
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop, dotted, imported_from, resolve
from ddpkit.commands.convert.sums import batch_wide, sums_after

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any

LOADER = "torch.utils.data.DataLoader"
# an evaluation loop calling these needs gradients: it cannot run under no_grad, so it is not sharded
NEEDS_GRAD = ("grad", "requires_grad_", "enable_grad", "set_grad_enabled", "backward", "vjp", "jacobian")


def loaders(work: _Work) -> None:
    """Every DataLoader: a training or an evaluation one, by what its loops do; refused where batches are fed
    by hand."""
    built = [c for c in work.facts.calls if c.name == LOADER]
    training = False
    handed = handedin.passed(work, lambda binding: _origin(work.facts, binding))
    for _, made, _ in handed:  # what this file hands to another module's training loop: trained on there
        for call in made:
            training |= _loader(work, call, "train")
        built = [c for c in built if all(c is not m for m in made)]
    work.done.extend(want for want, _, every in handed if every)
    for call in built:
        wanted = _wanted(work, call)
        if wanted is not None and work.crossing.wants[wanted] == TRAIN:  # another module trains on it (a project)
            training |= _loader(work, call, "train")
            work.done.append(wanted)
            continue
        keyed = _keyed(work, call, built) if wanted is None else None
        if keyed is not None and keyed[1] == TRAIN:  # the one that shuffles, of a dict of loaders asked for
            training |= _loader(work, call, "train")
            work.done.append(keyed[0])
            continue
        if keyed is not None and not keyed[1]:
            work.leave(call.line, f"another module of the project trains on {keyed[0]}, and which of the "
                       f"DataLoaders of {call.scope.name}() that key holds is not followed (told by shuffle=True "
                       "when exactly one shuffles, written out)", "make the training loader the only one built with "
                       "shuffle=True, or build it in a function of its own, then convert again", blocks=True)
            continue
        if keyed is not None:
            work.keep(call.line, f"a DataLoader of {call.scope.name}() that does not shuffle left as it is",
                      f"another module of the project trains on {keyed[0]}, the one of its DataLoaders that shuffles: "
                      "each rank reads all of this one, which is right for an evaluation")
            continue
        if wanted is not None:  # another module's loop reads it, and does not train
            shown = f"{wanted} = DataLoader(...)" if "(" not in wanted else f"the DataLoader {wanted} returns"
            work.keep(call.line, f"{shown} left as it is", "another module of the project "
                      "loops over it without training: each rank reads all of it, which is right for an evaluation "
                      "(ddpkit.data_loader(..., train=False) and a ddpkit.reduce of the sums there would share it)")
            continue
        if _unused(work, call):
            built = [c for c in built if c is not call]
            continue
        training |= _loader(work, call)
    work.trains = training
    # once every loader is decided: an evaluation whose sums are reduced for one loader, also handed one left
    # unsharded (imported plain, kept plain for its stored results, not a DataLoader): that one's would count N times
    for loop in work.reduced:
        plain = _unsharded_feed(work, loop)
        if plain is not None and plain[2]:
            work.leave(loop.line, f"the evaluation loop here runs over {plain[0]} (line {plain[1]}), which "
                       f"{plain[2]}() builds with the same DataLoader line as the training loader: one line cannot "
                       "be both a sharded training loader and a whole evaluation one", f"build the evaluation loader "
                       f"with a DataLoader line of its own, in a function other than {plain[2]}(), then "
                       "convert again", blocks=True)
            break
        if plain is not None:
            work.leave(loop.line, f"the evaluation loop here also runs over {plain[0]} (line {plain[1]}), a loader "
                       "left unsharded: with its sums reduced across ranks, that one's would count N times",
                       "make that loader a ddpkit.data_loader(..., train=False) where it is built, or evaluate it "
                       "in a function of its own, then convert again", blocks=True)
            break
    backward = [c for c in work.facts.calls if c.last == "backward"]
    training |= any(c.name == "ddpkit.data_loader" for c in work.facts.calls)
    fors = [lp for lp in work.facts.loops if isinstance(lp.node, cst.For)]
    if not backward and not built and fors and not uses_ddpkit(work.facts):  # an evaluation of another's loader
        _imported_loader(work, fors[0].line)
    if backward and not training and not built and not uses_ddpkit(work.facts):  # (ddpkit: by hand)
        if _imported_loader(work, backward[0].line) or _subclassed(work, backward[0].line) or \
                handedin.handed_in(work, backward[0].line):
            return
        work.leave(backward[0].line, "the training batches do not come from a torch DataLoader (fed by hand): "
                   "each rank would train on all of them", "build them with a Dataset and a DataLoader, then "
                   "convert again; or split them by state.rank yourself (docs/guide.md)", blocks=True)

def _imported_loader(work: _Work, line: int) -> bool:
    r"""The loops iterate loaders the script imports from a module of its own (``from Data.data import
    train_loader``), or that a function imported from one returns (``train_loader, _ = get_loaders(64)``): not
    batches fed by hand. The training ones are asked of their module (:mod:`.crossing`) and
    said done when it made them ``ddpkit.data_loader``\ s; else left to you. An evaluation loader read from
    another module stays as it is there: each rank evaluates every batch, which is right."""
    reads: dict[str, bool] = {}  # name -> read by a loop that trains (as a loader's role is told: flow.trains)
    origins: dict[str, tuple[str, str]] = {}  # name -> (its module, its name there)
    every: dict[str, list[tuple[str, str]]] = {}  # name -> each origin (functions picked in an if/elif)
    trained: dict[str, list[Loop]] = {}  # name -> the training loops over it
    looped: dict[str, list[Loop]] = {}  # name -> every loop over it
    for loop in work.facts.loops:
        for name in handedin.reads(work, loop):
            imported = imported_from(work.facts, name)
            found = [imported] if imported else _returned_by_import(work.facts, name, loop)
            if found:
                origins[name] = found[0]
                every.setdefault(name, []).extend(o for o in found if o not in every.get(name, []))
                reads[name] = reads.get(name, False) or flow.trains(work.facts, loop)
                trained.setdefault(name, []).extend([loop] if flow.trains(work.facts, loop) else [])
                looped.setdefault(name, []).append(loop)
    if not reads:
        return False
    training = sorted(n for n, trains in reads.items() if trains)
    # asked whatever the answer so far: a project settles its asks in rounds (crossing.settle), and an ask
    # dropped once answered would take the answer back in the next round
    work.asks.extend(Ask(*o, TRAIN if reads[n] else EVAL, line) for n in sorted(reads) for o in every[n])
    done = {n: work.crossing.provided.get(key(*origins[n])) if all(key(*o) in work.crossing.provided
                                                                   for o in every[n]) else None
            for n in training}
    for n in training:
        home = flow.binding_of(work.facts, n, work.facts.scopes[""], line)
        scope = home.scope if home is not None else work.facts.scopes[""]
        evaluated = [lp for lp in flow.loops_reading(work.facts, n, scope) if not flow.trains(work.facts, lp)]
        if done[n] and evaluated:  # sharded there for training: here each rank would evaluate only its shard
            work.leave(evaluated[0].line, f"{n}, a ddpkit.data_loader for training in {done[n]}, is also "
                       "evaluated here: each rank would evaluate only its shard, and nothing here sums the "
                       "ranks' results", "evaluate on a loader of its own, or ddpkit.reduce(...) the sums after "
                       "that loop, then convert again", blocks=True)
            return True
        if done[n]:  # sharded there: the sums its training loops keep here are this rank's shard's
            work.keep(line, f"the training loop over {n} left as it is", f"{n} is a ddpkit.data_loader where it "
                      f"is built, in {done[n]} (imported from {origins[n][0]})")
            _reductions(work, trained[n], None, True)
    for n in [n for n in reads if not reads[n] and work.crossing.provided.get(key(*origins[n]))]:
        # evaluated only here, sharded for another file's training there: its sums reduced, or refused
        fors = [lp for lp in looped[n] if isinstance(lp.node, cst.For)]
        if any(lp.stored or lp.breaks or sums_after(work.facts, lp, False, frozenset()) is None for lp in fors):
            work.leave(fors[0].line if fors else line, f"{n} is sharded for training where it is built, in "
                       f"{work.crossing.provided[key(*origins[n])]}, and this evaluation keeps what it cannot sum "
                       "across ranks: each rank would report its shard only", "evaluate on a loader of its own "
                       "(ddpkit.data_loader(dataset, batch_size, train=False)), then convert again", blocks=True)
            return True
        _reductions(work, fors, None, False)
    missing = [n for n in training if not done[n]]
    if not training or not missing:  # (evaluations only: asked, so as to learn whether they are sharded there)
        return True
    where = ", ".join(f"{n!r} from {origins[n][0]}" for n in (missing or sorted(reads)))
    work.leave(line, f"the loops read loaders imported from modules of the script ({where}), and convert does "
               "not follow a name from one module to another outside a project: as they are, every rank reads "
               "every batch", "convert them together (ddpkit convert --imports SCRIPT, or a folder), or make the "
               "training loader a ddpkit.data_loader(dataset, global_batch_size=B) where it is built (an "
               "evaluation loader may stay: each rank then evaluates every batch, which is right), and wrap the "
               "model with ddpkit.prepare_model(...) where it is built")
    return True


def _returned_by_import(facts: Facts, name: str, loop: Loop) -> list[tuple[str, str]]:
    """[(the module, ``get_loaders()[0]``)] when ``name`` is bound from a call of a function imported from a module
    of the script's own (:func:`~ddpkit.commands.convert.crossing.returned` names its value there): one per such
    binding of its scope, so that functions picked in an ``if``/``elif`` (LynnHo's ``data.make_*_dataset``) are
    all asked; [] otherwise.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from data import get\\ntr, te = get(8)\\nfor x in tr:\\n    pass\\n"))
    >>> _returned_by_import(facts, "tr", facts.loops[0])
    [('data', 'get()[0]')]
    >>> facts = scan(parse("import data\\nif a:\\n    tr, s = data.one(8)\\nelse:\\n    tr, s = data.two(8)\\n"
    ...                    "for x in tr:\\n    pass\\n"))
    >>> _returned_by_import(facts, "tr", facts.loops[0])
    [('data', 'one()[0]'), ('data', 'two()[0]')]
    """
    binding = flow.binding_of(facts, name, loop.scope, loop.line)
    if binding is None or _origin(facts, binding) is None:  # what the loop reads is no such call
        return []
    same = [b for b in facts.bindings if b.target == binding.target and b.scope is binding.scope]
    return [origin for origin in map(lambda b: _origin(facts, b), same) if origin is not None]


def _origin(facts: Facts, binding: Binding, depth: int = 0) -> tuple[str, str] | None:
    """(the module, ``get_loaders()[0]``) of a binding from a call of an imported function, or of one entry of the
    dict such a call returns (cs230's ``train_dl = dataloaders['train']``: ``fetch_dataloader()['train']``)."""
    call = binding.whole
    func = dotted(call.func) if isinstance(call, cst.Call) else None
    origin = imported_from(facts, func) if func else None
    if origin is not None:
        return origin[0], returned(origin[1], binding.index)
    made = _instance_method(facts, call, binding) if isinstance(call, cst.Call) else None
    if made is not None:  # NCF's ``sample_generator.instance_a_train_loader(...)``: the class's method returns it
        return made[0], returned(made[1], binding.index)
    key_ = _string_key(binding.value)
    holder = dotted(binding.value.value) if key_ is not None and isinstance(binding.value, cst.Subscript) else None
    held = flow.binding_of(facts, holder, binding.scope, binding.line) if holder and depth < 2 else None
    origin = _origin(facts, held, depth + 1) if held is not None and held.value is not None else None
    if origin is None or not origin[1].endswith("()"):
        return None
    return origin[0], f"{origin[1]}[{key_!r}]"


def _instance_method(facts: Facts, call: cst.Call, binding: Binding) -> tuple[str, str] | None:
    """(the module, ``Class.method``) of ``obj.method(...)`` where ``obj`` is bound to ``Class(...)``, a class
    imported from a module of the project; None otherwise."""
    if not isinstance(call.func, cst.Attribute) or not isinstance(call.func.value, cst.Name):
        return None
    held = flow.binding_of(facts, call.func.value.value, binding.scope, binding.line)
    made = held.value if held is not None else None
    origin = imported_from(facts, dotted(made.func) or "") if isinstance(made, cst.Call) else None
    return (origin[0], f"{origin[1]}.{call.func.attr.value}") if origin is not None else None


def _string_key(node: cst.BaseExpression | None) -> str | None:
    """``'train'`` of ``loaders['train']``; None for any other expression."""
    if not isinstance(node, cst.Subscript) or len(node.slice) != 1:
        return None
    index = node.slice[0].slice
    value = index.value if isinstance(index, cst.Index) else None
    return value.evaluated_value if isinstance(value, cst.SimpleString) and \
        isinstance(value.evaluated_value, str) else None


def _subclassed(work: _Work, line: int) -> bool:
    """The training loop reads a loader of the script's own DataLoader subclass (pytorch-template's
    ``BaseDataLoader``): not batches fed by hand, but a class convert does not rewrite (its ``__init__`` may
    split, sample or batch the data itself). Refused, saying so, with the fix."""
    classes = loader_classes(work.facts.module, work.facts.aliases)
    built = {b.target: b for b in work.facts.bindings if isinstance(b.value, cst.Call) and
             dotted(b.value.func) in classes}
    for loop in work.facts.loops:
        found = sorted(loop.iter_names & set(built))
        if found and flow.trains(work.facts, loop):
            name, cls = found[0], dotted(built[found[0]].value.func)
            work.leave(built[name].line, f"the training batches come from {name} = {cls}(...), a subclass of "
                       "DataLoader of the script's own: convert does not rewrite a subclass (its __init__ may split, "
                       "sample or batch the data itself), and as it is every rank reads every batch", "build the "
                       f"training loader with ddpkit.data_loader(dataset, global_batch_size=B, ...) where {cls}(...) "
                       "is called (what the subclass adds goes in the Dataset or a collate_fn), then convert again",
                       blocks=True)
            return True
    return False


def loader_classes(module: cst.Module, aliases: dict[str, str]) -> set[str]:
    """The script's classes that derive from torch's DataLoader, directly or through each other.

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("from torch.utils.data import DataLoader\\nclass A(DataLoader): pass\\nclass B(A): pass\\n"))
    >>> sorted(loader_classes(facts.module, facts.aliases))
    ['A', 'B']
    """
    bases: dict[str, set[str]] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            bases[stmt.name.value] = {resolve(dotted(b.value), aliases) or "" for b in stmt.bases}
    found: set[str] = set()
    while True:
        more = {c for c, b in bases.items() if c not in found and (LOADER in b or b & found)}
        if not more:
            return found
        found |= more


def _unused(work: _Work, call: Call) -> bool:
    """``test_loader = DataLoader(...)`` whose name nothing reads, as a variable or as an attribute of anything
    (``data.test_loader``): no rank takes a batch from it, so it stays as it is, said as kept (a loader of unknown
    role would otherwise be refused, one named for evaluation left to you)."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    # (a binding in a loop: the loop's next pass reads it above its line)
    if binding is None or _read(work.facts, binding.target, binding.scope,
                                binding.line if flow.top_level(binding) else 0):
        return False
    name = binding.target
    work.keep(call.line, f"{name} = DataLoader(...) left as it is", f"nothing reads {name}: no rank takes a "
              "batch from it")
    return True


def _read(facts: Facts, name: str, scope: Any, since: int, depth: int = 0) -> bool:
    """Whether anything reads ``name`` (bound in ``scope`` at line ``since``), as a variable or as an attribute
    of anything; handing it to a function of the script whose parameter is read nowhere there is no read
    (``train(model, train_loader, validation_loader)`` where ``train`` never uses ``validation_loader``)."""
    attribute = f".{name.rsplit('.', 1)[-1]}"  # ``self.train_loader`` read as ``data.train_loader``
    if any(read.endswith(attribute) and read != name for read, _where, _line, _node in facts.reads):
        return True
    own = _param_names(scope.node)  # the def's own names are no read
    return any((read == name or read.startswith(f"{name}.")) and flow.visible(facts, name, scope, where) and
               (where is not scope or line >= since) and id(node) not in own and
               not _handed_to_unread(facts, node, depth) for read, where, line, node in facts.reads)


def _param_names(node: Any) -> set[int]:
    if not isinstance(node, cst.FunctionDef):
        return set()
    params = node.params
    return {id(p.name) for p in (*params.posonly_params, *params.params, *params.kwonly_params)}


def _handed_to_unread(facts: Facts, node: Any, depth: int) -> bool:
    """``node`` is a whole argument of a call of the script's own function, landing in a parameter that the
    function reads nowhere (followed :data:`flow.DEPTH` calls deep)."""
    call = next((c for c in facts.calls if any(a.value is node for a in c.node.args)), None)
    target = callee(facts, call) if call is not None and depth < flow.DEPTH else None
    if call is None or target is None:
        return False
    scope, skip = target
    param = next((p for p in scope.params if flow.argument_for(call, p, scope, skip) is node), None)
    return param is not None and not _read(facts, param, scope, 0, depth + 1)


def _wanted(work: _Work, call: Call) -> str | None:
    """The name another module's loop reads ``call``'s loader by (:class:`~ddpkit.commands.convert.crossing.Crossing`):
    the module-level name it is bound to, or what a function returns it as (``get_loaders()[0]``); None when no
    other module asks for it."""
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    names = [binding.target] if binding is not None and binding.scope.name == "" else []
    for scope, value in work.facts.returns:
        elements = [e.value for e in value.elements] if isinstance(value, (cst.Tuple, cst.List)) else [value]
        for i, element in enumerate(elements):
            if element is call.node or binding is not None and binding.scope is scope and \
                    dotted(element) == binding.target:
                names.append(returned(scope.name, i if len(elements) > 1 else -1))
    return next((n for n in names if work.crossing.wants.get(n) in (TRAIN, EVAL)), None)


def _keyed(work: _Work, call: Call, built: list[Call]) -> tuple[str, str] | None:
    """(what is asked, its kind; "": cannot be told) for a DataLoader of a function whose returned dict another
    module reads by key (cs230's ``fetch_dataloader(...)['train']``): which key a loader is stored under is not
    followed, so its ``shuffle`` tells, when the function builds exactly one that shuffles, written out: that one
    for the key asked for training, the others for the evaluation keys; None when nothing asks by key.

    >>> from ddpkit.commands.convert.plan import plan
    >>> from ddpkit.commands.convert.crossing import Crossing
    >>> text = ("from torch.utils.data import DataLoader\\ndef get(b):\\n    tr = DataLoader(a, batch_size=b, "
    ...         "shuffle=True)\\n    te = DataLoader(c, batch_size=b)\\n    return {'tr': tr, 'te': te}\\n")
    >>> print(plan(text, crossing=Crossing(wants={"get()['tr']": "training loader"})).text.splitlines()[3])
        tr = ddpkit.data_loader(a, global_batch_size=b, shuffle=True)
    """
    function = call.scope.name
    asked = {n: kind for n, kind in work.crossing.wants.items() if n.startswith(f"{function}()[") and
             n.endswith("]") and n[len(function) + 3] in "'\"" and function}
    train = [n for n, kind in asked.items() if kind == TRAIN]
    if len(train) != 1:
        return None
    mine = [c for c in built if c.scope is call.scope]
    shuffles = {id(c): _shuffle(c) for c in mine}
    if None in shuffles.values() or sum(shuffles.values()) != 1:  # type: ignore[arg-type]
        return train[0], ""  # asked by key, and which loader that is cannot be told
    if shuffles[id(call)]:
        return train[0], TRAIN
    return next((n for n, kind in asked.items() if kind != TRAIN), train[0]), EVAL


def _shuffle(call: Call) -> bool | None:
    """A DataLoader's ``shuffle`` when it is written out as True or False or left out (False); None otherwise."""
    given = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
    if given is None:
        return False if not any(a.star for a in call.node.args) else None
    return {"True": True, "False": False}.get(given.value) if isinstance(given, cst.Name) else None


def _loader(work: _Work, call: Call, role: str | None = None) -> bool:
    """Rewrite one ``DataLoader(...)``; whether it is a training one."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    if len(positional) > len(LOADER_PARAMETERS) or any(a.star == "*" for a in call.node.args):
        work.leave(call.line, "DataLoader(*args) or more positional arguments than it takes",
                   "pass its arguments by name, then convert again", blocks=True)
        return True
    kwargs = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    kwargs.update({LOADER_PARAMETERS[i]: a.value for i, a in enumerate(positional) if i >= 2})
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, cst.Name) and v.value == "None")}
    if "batch_sampler" in kwargs:
        work.leave(call.line, "DataLoader(batch_sampler=...): batches are not split across ranks by ddpkit",
                   "pass sampler= and batch_size= instead, then convert again", blocks=True)
        return True
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    loops = loops_reading(work.facts, binding.target, binding.scope, since=binding) if binding else \
        [loop for loop in work.facts.loops if isinstance(loop.node, cst.For) and call.line == loop.line]
    returned = _returned(work.facts, call) if binding is None and not loops else None
    if returned:  # ``return DataLoader(...)``: the loops over what its callers bind
        loops = list({id(lp): lp for b in returned for lp in loops_reading(work.facts, b.target, b.scope)}.values())
        binding = returned[0] if len(returned) == 1 else None
    if role is not None:  # another module of the project trains on it (crossing): its loops are there
        pass
    elif returned is not None and not loops and not _called(work.facts, call):
        work.keep(call.line, "a DataLoader a function returns, called from no line of this file, left as it is",
                  "its callers are elsewhere (or nowhere): a file of the project that trains on it asks for it, "
                  "and it is converted then (ddpkit convert --imports SCRIPT, or a folder)")
        return False
    elif returned is not None and not loops:
        work.leave(call.line, "a DataLoader returned by a function: no loop over what its callers bind was found",
                   "bind it where the function is called (train_loader = get_loader(...)) and loop over that "
                   "name, or build the loader there, then convert again", blocks=True)
        return False
    elif binding is None and not loops:  # in a comprehension or an argument: one call, maybe several roles
        work.leave(call.line, "a DataLoader built inside an expression (a comprehension, a call's argument): "
                   "its loaders' roles cannot be followed", "bind each loader to a name (train_loader = "
                   "DataLoader(...)), then convert again", blocks=True)
        return False
    peeks = [loop for loop in loops if peek(loop)]  # a look at the first batch: no role, nothing to sum
    loops = [loop for loop in loops if loop not in peeks]
    role = role or flow.role(work.facts, loops, binding, call)
    if role == "eval" and not loops:  # said by a name only: its loop, and what it sums, were not found
        work.keep(call.line, "an evaluation DataLoader (by its name) whose loop is not in this file, left as it "
                  "is", "every rank evaluates the whole set, which is right (to share the work: ddpkit.data_loader("
                  "..., train=False), and ddpkit.reduce the sums after its loop)")
        return False
    if role is None and uses_ddpkit(work.facts):  # a ddpkit script's own plain loader: its choice
        work.leave(call.line, "a plain DataLoader in a ddpkit script, whose loops neither train nor evaluate "
                   "visibly: left as it is (every rank reads all of it)", "if it should be sharded: "
                   "ddpkit.data_loader(dataset, batch_size) to train, or train=False to evaluate")
        return False
    if role is None:
        named = "; its name says evaluation, but it shuffles (shuffle=True), and a name is trusted only for a " \
            "loader read in order" if flow.shuffled_eval_name(work.facts, binding, call) else ""
        work.leave(call.line, f"a DataLoader whose role cannot be told: {roles_said(work.facts, loops)}{named}",
                   "convert it yourself: ddpkit.data_loader(dataset, batch_size) to train, "
                   "ddpkit.data_loader(..., train=False) to evaluate (one loader per role)", blocks=True)
        return False
    # the batch first: a training sum over ``len(loader) * batch_size`` is every sample's only with the global batch
    rename, batches = batch.global_batch(work, call, loops) if role == "train" else (None, frozenset[str]())
    if not _reductions(work, loops, call, role == "train", batches):
        return False
    how = "training: each rank takes its own shard, reshuffled every epoch" if role == "train" else \
        "evaluation (train=False): each rank its part, no sample twice"
    starred = any(a.star == "**" for a in call.node.args)
    keywords = {"train": "False"} if role == "eval" and "train" not in kwargs else {}
    if role == "train" and not {"shuffle", "sampler"} & set(kwargs) and not starred:
        keywords["shuffle"] = "False"  # torch's default, kept: data_loader's would shuffle
        how = "training: each rank takes its own shard, in order (shuffle=False: torch's default, kept)"
    elif role == "train" and starred and not {"shuffle", "sampler"} & set(kwargs):
        how += " (unless the ** arguments say shuffle=False; a torch DataLoader did not shuffle by default)"
    work.edits.expr[id(call.node)] = lambda node: (rename or _same)(loader_call(node, keywords))
    work.note(f"DataLoader -> ddpkit.data_loader ({'training' if role == 'train' else 'train=False'})",
              how, call.line)
    return role == "train"

def _unsharded_feed(work: _Work, loop: Loop) -> tuple[str, int, str | None] | None:
    """(the argument, its line, the function of this file that built it with the training loader's line) of a call
    that hands the loop's function, as the parameter it loops over, something other than a DataLoader built in this
    file (one imported from another module, say): a loader this plan does not shard."""
    scope = loop.scope
    params = handedin.reads(work, loop) & set(scope.params)
    built = {id(c.node) for c in work.facts.calls if c.name == LOADER}
    for call in work.facts.calls if params else ():
        target = flow.callee(work.facts, call)
        if target is None or target[0] is not scope:
            continue
        for param in params:
            arg = flow.argument_for(call, param, scope, target[1])
            # ``valid_loader if valid_loader else test_loader``: each name it may pass
            options = [arg.body, arg.orelse] if isinstance(arg, cst.IfExp) else [arg]
            for option in options:
                name = dotted(option) if option is not None else None
                bound = flow.binding_of(work.facts, name, call.scope, call.line) if name else None
                if bound is None or id(bound.value) not in built or id(bound.value) in work.plain:
                    return (name or "an expression", call.line, _builder(work, bound))
    return None


def _builder(work: _Work, bound: Binding | None) -> str | None:
    """The function of this file that returned ``bound`` when it builds a training DataLoader too (char-cnn's
    ``make_data_loader()`` for both the training and the validation loader): one DataLoader line, two roles."""
    made = next((c for c in work.facts.calls if bound is not None and c.node is bound.whole), None)
    target = flow.callee(work.facts, made) if made is not None else None
    if target is None or not any(c.name == LOADER and c.scope is target[0] and id(c.node) not in work.plain
                                 for c in work.facts.calls):
        return None
    return target[0].name


def _called(facts: Facts, call: Call) -> bool:
    """The function whose ``return`` holds ``call`` is called somewhere in this file."""
    scope = call.scope
    name = scope.name.rsplit(".", 1)[-1]
    return any((callee(facts, c) or (None,))[0] is scope for c in facts.calls) or \
        any((read == name or read.endswith(f".{name}")) and node is not getattr(scope.node, "name", None)
            for read, _, _, node in facts.reads)  # a dict of factories, partial(f): a use that is no call


def _returned(facts: Facts, call: Call) -> list[Binding] | None:
    """``return DataLoader(...)`` (or one of a returned tuple): what the function's callers bind it to
    (``train_loader = get_loader(args)``); None when the call is not returned."""
    for scope, value in facts.returns:
        elements = [e.value for e in value.elements] if isinstance(value, (cst.Tuple, cst.List)) else [value]
        if any(e is call.node for e in elements):
            index = next(i for i, e in enumerate(elements) if e is call.node) if len(elements) > 1 else -1
            sites = [id(c.node) for c in facts.calls if (callee(facts, c) or (None,))[0] is scope]
            return [b for b in facts.bindings if id(b.whole) in sites and b.index == index]
    return None


def _same(node: cst.Call) -> cst.Call:
    return node


def _reductions(work: _Work, loops: list[Loop], call: Call | None, training: bool,
                batches: frozenset[str] = frozenset()) -> bool:
    """Sum across ranks what the loops over a loader accumulate and the code below reads
    (:mod:`ddpkit.commands.convert.sums`); an evaluation loop also runs under ``torch.no_grad()`` (a DDP
    forward with gradients on is collective, and the ranks' shards differ in length: the longer one would
    wait forever). False, before any edit: an evaluation loader is then left as it is (every rank evaluates
    the whole set, which is right, only slower), when a loop keeps results this cannot sum."""
    fors = [loop for loop in loops if isinstance(loop.node, cst.For)]
    # (None: a loader built in another module of the project, whose training loops here keep sums)
    datasets = frozenset(filter(None, [dotted(call.node.args[0].value)])) if call and call.node.args else frozenset()
    plans = []
    evaluations = [loop for loop in fors if not (training and flow.trains(work.facts, loop))]
    for loop in fors:
        summed_as_training = loop not in evaluations  # a training loader's evaluation (check_accuracy) sums
        stored = loop.stored[0] if loop.stored and not summed_as_training else None
        needs = next((c.last for c in loop.calls if c.last in NEEDS_GRAD and not _grad_off(c)), None)
        if not summed_as_training and not loop.no_grad and stored is None and needs:
            stored = (f"{needs}() results (it needs gradients, so it cannot run under no_grad)", loop.line)
        # a batch that is one unit (a trial); a batch of one sample is a unit whichever rank takes it
        wide = None if summed_as_training or call is None or _one_sample(call) else batch_wide(work.facts, loop)
        plan = sums_after(work.facts, loop, summed_as_training, datasets, batches) \
            if stored is None and wide is None else None
        if plan is None and not summed_as_training:
            assert call is not None  # (without a call, only training loops are handed in)
            line = stored[1] if stored else wide[1] if wide else loop.line
            why = f"keeps per-batch results in {stored[0]}" if stored else f"takes {wide[0]} over each whole " \
                "batch (a batch is one unit, such as an N-way trial; sharded sample by sample, a rank's batch " \
                "would mix units)" if wide else "may stop before its shard ends (a break)" if loop.breaks else \
                "divides by a count of its own batches (its loop variable)"
            if training:  # the loader must be sharded to train: its evaluation would then be rank 0's shard only
                work.leave(line, f"the evaluation loop over the training DataLoader at line {call.line} {why}: "
                           "sharded for training, each rank would evaluate only its shard", "evaluate on a "
                           "loader of its own (ddpkit.data_loader(dataset, batch_size, train=False)), or "
                           "ddpkit.gather(...) the results there, then convert again", blocks=True)
                return False
            work.plain.add(id(call.node))
            work.leave(line, f"the evaluation loop {why}: the result would be this rank's only, so the "
                       f"DataLoader at line {call.line} is left as it is (each rank evaluates the whole set)",
                       "to share the work: ddpkit.data_loader(..., "
                       "train=False), then ddpkit.gather(...) the results or ddpkit.reduce(...) the sums "
                       "and counts (docs/convert.md)")
            return False
        plans += [(summed_as_training, p) for p in plan or []]
    for summed_as_training, (anchor, names, lens) in plans:
        after = work.edits.after.setdefault(id(anchor.node), [])
        new = [f"{n} = ddpkit.reduce({n})" for n in names if f"{n} = ddpkit.reduce({n})" not in after]
        if not new:  # one evaluation function called with two loaders (check_accuracy): reduced once
            continue
        after.extend(new)
        if not summed_as_training:
            work.reduced.extend(evaluations)
        work.note(f"after the {'training' if summed_as_training else 'evaluation'} loop: {', '.join(names)} "
                  "summed across ranks (ddpkit.reduce)", "each rank accumulated only its own shard", anchor.end)
        for node in lens:  # ``total / len(loader)``: every rank's batches, as the sum is every rank's
            work.edits.expr[id(node)] = lambda n: cst.parse_expression(
                f"ddpkit.reduce({work.facts.module.code_for_node(n)})")
            work.note("len(loader) -> ddpkit.reduce(len(loader))", "every rank's batches, as the sum "
                      "divided by it is every rank's", anchor.end)
    for loop in evaluations:
        if not loop.no_grad and id(loop.node) not in work.edits.no_grad:
            work.edits.no_grad.add(id(loop.node))
            work.note("the evaluation loop runs under torch.no_grad()", "a DDP forward with "
                      "gradients on is collective, and the ranks' evaluation shards differ in length",
                      loop.line)
    return True


def _one_sample(call: Call) -> bool:
    """``DataLoader(ds)`` / ``DataLoader(ds, batch_size=1)``: batches of one sample."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    size = next((a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "batch_size"),
                positional[1].value if len(positional) > 1 else None)
    return size is None and not any(a.star == "**" for a in call.node.args) or \
        isinstance(size, cst.Integer) and size.value == "1"


def _grad_off(call: Call) -> bool:
    """``torch.set_grad_enabled(False)``: gradients off, as under ``no_grad``."""
    first = call.node.args[0].value if call.node.args else None
    return call.last == "set_grad_enabled" and isinstance(first, cst.Name) and first.value == "False"


def uses_ddpkit(facts: Facts) -> bool:
    """The script imports ddpkit (under any name)."""
    return any(full == "ddpkit" or full.startswith("ddpkit.") for full in facts.aliases.values())
