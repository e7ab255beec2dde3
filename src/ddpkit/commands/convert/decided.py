"""What ``ddpkit convert`` checks once every loader of a file is decided (:mod:`.loaders`): a training loader
also handed to another module's evaluation (which would evaluate this rank's shard); an evaluation whose sums are
reduced over a loader also left whole (counted N times); and a training loop whose batches come from no loader
converted here: another module's (asked there), a DataLoader subclass of the script's own, a function of a module
this conversion does not read, or batches fed by hand, each said or refused with its fix.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nx = torch.randn(8, 2)\\nfor i in range(3):\\n    x.sum().backward()\\n")
    >>> [x.what[:60] for x in p.left]
    ['the training batches do not come from a torch DataLoader (fe']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import feeds, flow, handedin, imported, loaderuse, returns, sources, stepped, trained
from ddpkit.commands.convert.flow import callers
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Call, Facts

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any


def check(work: _Work, built: list[Call], training: bool, for_others: bool) -> None:
    """The checks above, once ``training`` (a loader of this file is trained on) and ``for_others`` (one is
    converted for another module's loop) are known; ``built``: the DataLoaders this file makes and reads."""
    for call in handedin.passed_to_evaluate(work):  # a training loader another module evaluates: its shard only
        if id(call.node) in work.sharded:
            work.leave(call.line, "this training loader is also handed to another module's evaluation, which would "
                       "evaluate only this rank's shard, with nothing summing the ranks' results", "evaluate on a "
                       "plain loader of its own (DataLoader(dataset, batch_size): handed to another module's "
                       "evaluation, convert leaves it whole, every rank evaluating the whole set), then convert "
                       "again", blocks=True)
            break
    # once every loader is decided: an evaluation whose sums are reduced for one loader, also handed one left
    # unsharded (imported plain, kept plain for its stored results, not a DataLoader): that one's would count N times
    for loop in work.reduced:
        plain = feeds.unsharded_feed(work, loop)
        if plain is not None and plain[2]:
            work.leave(loop.line, f"the evaluation loop here runs over {plain[0]} (line {plain[1]}), which "
                       f"{plain[2]}() builds with the same DataLoader line as the training loader: one line cannot "
                       "be both a sharded training loader and a whole evaluation one", f"build the evaluation loader "
                       f"with a DataLoader line of its own, in a function other than {plain[2]}(), then "
                       "convert again", blocks=True)
            break
        if plain is not None:  # (kept whole for another loop's results: sharded, those would be rank 0's)
            name, line, _, why = plain
            work.leave(loop.line, f"the evaluation loop here also runs over {name} (line {line}), "
                       f"{why or 'a loader left unsharded'}: this loop's sums are reduced across ranks for the "
                       "sharded loader, and one function cannot reduce them for one loader and not the other",
                       ("" if why else "make that loader a ddpkit.data_loader(..., train=False) where it is built, "
                        "or ") + f"evaluate {name} in a function of its own (a copy of {loop.scope.name or 'the loop'}"
                       "), then convert again", blocks=True)
            break
    backward = [c for c in work.facts.calls if c.last == "backward"]
    training |= any(c.name == "ddpkit.data_loader" for c in work.facts.calls)
    fors = [lp for lp in work.facts.loops if isinstance(lp.node, cst.For)]
    if not backward and not built and fors and not uses_ddpkit(work.facts):  # an evaluation of another's loader
        imported.imported_loader(work, fors[0].line)
    if not backward and not built and not uses_ddpkit(work.facts):
        _trained_elsewhere(work)
    if backward and (not training or for_others) and built and not uses_ddpkit(work.facts) and \
            not any(callers(work.facts, c.scope) for c in backward):  # none feeds this, and no call here does:
        handedin.handed_in(work, backward[0].line)  # (d2l's ``train(net, loader, optimizer)``: its callers' loader)
    if backward and not training and not built and _prepared_here(work.facts):  # (a trainer given its models'
        # wrap by a fix convert named, set 26's DCGAN project: its loop over what callers hand in is still theirs;
        # or over a loader another module builds, its sums this rank's: set 27's extra five)
        _ = imported.imported_loader(work, backward[0].line) or handedin.handed_in(work, backward[0].line)
    if backward and not training and not built and not uses_ddpkit(work.facts):  # (ddpkit: by hand)
        if _iterated_elsewhere(work) or imported.imported_loader(work, backward[0].line) or \
                _subclassed(work, backward[0].line) or \
                handedin.handed_in(work, backward[0].line) or stepped.asks(work, backward) or _unpickled(work):
            return
        work.leave(backward[0].line, "the training batches do not come from a torch DataLoader (fed by hand): "
                   "each rank would train on all of them", "build them with a Dataset and a DataLoader, then "
                   "convert again; or split them by state.rank yourself (docs/guide.md); a full-batch training "
                   "(one graph, one tensor, each step over all of it) has nothing to split: run it as one process",
                   blocks=True)


UNPICKLERS = ("joblib.load", "pickle.load", "dill.load", "torch.load")


def _unpickled(work: _Work) -> bool:
    """The training loop reads a loader loaded from a file (LSGAN's ``joblib.load("dataloader.pkl")``, in a
    helper it calls or in place): a DataLoader built elsewhere, which convert never sees built. Refused with that
    cause and the line that rebuilds it (not "fed by hand")."""
    for loop in (lp for lp in work.facts.loops if flow.trains(work.facts, lp)):
        for name in sorted(loop.iter_names):
            bound = flow.binding_of(work.facts, name, loop.scope, loop.line)
            made = next((c for c in work.facts.calls if bound is not None and c.node is bound.value), None)
            own = flow.callee(work.facts, made) if made is not None else None
            returned = {id(v) for v in returns.at(work.facts, own[0], -1)} if own is not None else set()
            inner = [c for c in work.facts.calls if own is not None and c.scope is own[0] and id(c.node) in returned]
            load = next((c for c in inner + ([made] if made else []) if c.name in UNPICKLERS), None)
            if load is None or bound is None:
                continue
            work.leave(bound.line, f"the training batches come from {name}, a loader loaded from a file ({load.name}"
                       f" at line {load.line}): convert cannot shard a DataLoader it does not see built, and as it "
                       "is every rank reads every batch", f"rebuild it where it is loaded: {name} = DataLoader("
                       f"{name}.dataset, batch_size={name}.batch_size, shuffle=True), then convert again",
                       blocks=True)
            return True
    return False


def _iterated_elsewhere(work: _Work) -> bool:
    """A training loop iterates in place a call of another module's function that is handed this file's data (an
    LSTM project's ``for x, y in utils.create_dataset(train, ...)``): refused, as one file's is, with the binding
    that lets convert follow it (its arguments were taken for loaders of other modules). And a function that builds
    the training loader here, whose loader an evaluation iterates in place or is handed (``for ... in
    utils.create_dataset(dev, ...)``, a generator, ``evaluate(model, make(dev))``): sharded for training there too,
    refused. An evaluation loader bound to a name is the crossing's (asked for its own role)."""
    own = work.crossing.own if work.crossing is not None else frozenset()
    trained = [lp for lp in work.facts.loops if flow.trains(work.facts, lp)]
    for loop in trained:
        made = loaderuse.iterated_call(work.facts, loop, own)
        if made is not None and sources.generated(work.facts, loop) is None and not _handed_made(work, loop, own):
            work.leave(loop.line, f"the training loop iterates what {made}(...) returns, a function of another module "
                       "of the project: convert follows a loader bound to a name", f"bind it where it is called "
                       f"(train_loader = {made}(...)) and loop over that name, then convert again", blocks=True)
            return True
    makers = {loaderuse.iterated_call(work.facts, lp, own, bound=True) for lp in trained} - {None}
    if not makers:
        return False
    in_place = loaderuse.iterated_ids(work.facts, statements=False) | loaderuse.handed_on(work.facts)
    others = [(lp.line, loaderuse.iterated_call(work.facts, lp, own)) for lp in work.facts.loops
              if lp not in trained] + [(c.line, dotted(c.node.func)) for c in work.facts.calls
                                       if id(c.node) in in_place]
    for line, made in others:
        if made in makers:
            work.leave(line, f"an evaluation here iterates a loader of {made}(...), unbound, which also builds the "
                       "training loader: one function cannot build both a sharded training loader and a whole "
                       "evaluation one", f"build the evaluation loader with a DataLoader line of its own (or a "
                       f"function other than {made}), then convert again", blocks=True)
            return True
    return False


def _handed_made(work: _Work, loop: Any, own: frozenset[str]) -> bool:
    """The call a loop iterates is handed a value another module of the project made (``utils.on_device(train_dl,
    device)``, ``train_dl, _ = utils.get_data(...)``): followed there (imported.py), not refused here."""
    call = loaderuse.unwrapped(loop.node.iter)
    for arg in call.args if isinstance(call, cst.Call) else ():
        bound = flow.binding_of(work.facts, dotted(arg.value) or "", loop.scope, loop.line) if dotted(arg.value) \
            else None
        value = (bound.value if bound.value is not None else bound.whole) if bound is not None else None
        origin = imported_from(work.facts, dotted(value.func) or "") if isinstance(value, cst.Call) else None
        if origin is not None and origin[0].split(".")[0] in own:
            return True
    return False


def _subclassed(work: _Work, line: int) -> bool:
    """The training loop reads a loader of the script's own DataLoader subclass (pytorch-template's
    ``BaseDataLoader``): not batches fed by hand, but a class convert does not rewrite (its ``__init__`` may
    split, sample or batch the data itself). Refused, saying so, with the fix."""
    classes = loaderuse.loader_classes(work.facts.module, work.facts.aliases)
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


def _trained_elsewhere(work: _Work) -> None:
    """An optimizer made here and handed, with its model, to a function of a module this conversion does not read,
    called for itself (Dive-into-DL's lessons: ``sys.path.append("..")``, then ``d2l.train_ch5(net, train_iter,
    test_iter, batch_size, optimizer, ...)``): its training loop, and the loader it runs over, are there,
    unconverted: every rank would train on every batch. Said, not passed over. (Not a scheduler made from it.)"""
    made = {b.target for b in work.facts.bindings if isinstance(b.value, cst.Call) and
            any(c.node is b.value and trained.optimizer(c) for c in work.facts.calls)}
    models = {b.target for b in work.models}
    for call in work.facts.calls:
        func = dotted(call.node.func)
        origin = imported_from(work.facts, func) if func else None
        passed = {dotted(a.value) for a in call.node.args}
        alone = call.stmt is not None and len(call.stmt.body) == 1 and isinstance(call.stmt.body[0], cst.Expr) and \
            call.stmt.body[0].value is call.node  # (``scheduler = Warmup(opt)``: a wrapper, its value kept)
        if origin is None or origin[0].split(".")[0] in work.facts.own or not passed & made or \
                not passed & models or not alone:
            continue
        work.leave(call.line, f"the training runs in {func}() of {origin[0]}, a module this conversion does not read "
                   "(not beside the script, or converted without --imports): its loop and the loader it reads stay "
                   "as they are, and every rank would train on every batch", "convert them together (ddpkit convert "
                   f"--imports SCRIPT, with {origin[0]} in the script's folder), or make its loader a "
                   "ddpkit.data_loader(dataset, global_batch_size=B) there yourself")
        return


def _prepared_here(facts: Facts) -> bool:
    """A file that prepares a model with ddpkit and neither shards nor reads a rank itself."""
    names = {c.name for c in facts.calls}
    return "ddpkit.prepare_model" in names and "ddpkit.data_loader" not in names and \
        not any(r.rsplit(".", 1)[-1] in ("rank", "local_rank") for r, *_ in facts.reads)


def uses_ddpkit(facts: Facts) -> bool:
    """The script is written with ddpkit: it shards or prepares with it (``ddpkit.data_loader``,
    ``ddpkit.prepare_model``, under any name ddpkit is imported as); a hand-written ddpkit script's plain loaders are
    its choice. Not an ``import ddpkit`` alone, for ``state.world_size`` (a fix convert names: set 25's a/s05)."""
    names = [c.name or "" for c in facts.calls]
    if any(n in ("ddpkit.data_loader", "ddpkit.prepare_model") for n in names):
        return True
    # (a script of ddpkit's that trains nothing, its loader for statistics: its choice too; or one that splits its
    # data by ``state.rank`` itself, as a refusal advises)
    inits = {id(c.node) for c in facts.calls if c.name == "ddpkit.init"}
    states = {b.target for b in facts.bindings if id(b.value) in inits}
    ranked = any(r.rsplit(".", 1)[-1] in ("rank", "local_rank") and (r.rsplit(".", 1)[0] in states or
                                                                     r.startswith("ddpkit.init().")) for r, *_ in
                 facts.reads)
    return ranked or any(n == "ddpkit" or n.startswith("ddpkit.") for n in names) and \
        not any(c.last == "backward" for c in facts.calls)
