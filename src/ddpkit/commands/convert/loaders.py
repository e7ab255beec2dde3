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
import libcst.matchers as m

from ddpkit.commands.convert import (
    askedkeys,
    batch,
    batchreads,
    byhand,
    bykey,
    bysplit,
    decided,
    drawn,
    flow,
    handedin,
    handsize,
    imported,
    loaderuse,
    roles,
)
from ddpkit.commands.convert.apply import LOADER_PARAMETERS, loader_call
from ddpkit.commands.convert.crossing import NOT_PASSED, TRAIN
from ddpkit.commands.convert.decided import uses_ddpkit
from ddpkit.commands.convert.flow import callers, loops_reading
from ddpkit.commands.convert.loaderuse import LOADER
from ddpkit.commands.convert.names import dotted, unpacked
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.reductions import reductions
from ddpkit.commands.convert.roles import peek, roles_said
from ddpkit.commands.convert.scan import Call, Loop

# the plan in the making (plan._Work): facts, edits, note, leave
_Work = Any



def loaders(work: _Work) -> None:
    """Every DataLoader: a training or an evaluation one, by what its loops do; refused where batches are fed
    by hand."""
    built = _demos(work, [c for c in work.facts.calls if c.name == LOADER])
    # (batch.py's reading of a loop, handed in: batch.py asks handsize.py what another file's loop reads)
    handsize.ask(work, lambda names, loops, call: batchreads.read_in_training(work, names, loops, call))
    built, training = _handed(work, built)
    for_others = False  # (a loader converted for another module's loop, not this file's)
    for call in list(built):
        trains, for_other, unused = _one(work, call, built)
        training, for_others = training or trains, for_others or for_other
        built = [c for c in built if c is not call] if unused else built
    for call in [c for c in work.facts.calls if c.name == "ddpkit.data_loader" and not _evaluating(c)]:
        # (made one by hand, the fix a line named: another module's loop over it is fed, as by one converted here)
        work.done.extend(n for n in bysplit.asked(work, call) if work.crossing.wants[n] == TRAIN)
        byhand.trained(work, call)
    for call in [c for c in work.facts.calls if c.name == "ddpkit.data_loader" and _evaluating(c)]:
        byhand.rows(work, call)
    work.trains = training
    decided.check(work, built, training, for_others)


def _demos(work: _Work, built: list[Call]) -> list[Call]:
    """``built`` less a module's demo loaders (``if __name__ == "__main__":``), which never run when another file of
    the project imports it; a block that trains is the script's own training (an entry that a sibling imports for
    its model), not a demo."""
    main = [c for c in work.facts.calls if any("__name__" in t and "__main__" in t for t in c.tests)]
    if work.crossing.imported and not any(c.last == "backward" for c in main):
        demos = [c for c in built if any(c is d for d in main)]
        for call in demos:
            work.keep(call.line, "a DataLoader under if __name__ == '__main__' left as it is", "another file of the "
                      "project imports this module: the block is its demo, which never runs then")
        built = [c for c in built if c not in demos]
    return built


def _handed(work: _Work, built: list[Call]) -> tuple[list[Call], bool]:
    """The loaders this file hands to another module: to a training loop (trained on there: converted), to an
    evaluation (kept whole); ``built`` less those decided here, and whether one is trained on."""
    training = False
    handed = handedin.passed(work, lambda binding: imported.origin_of(work.facts, binding))
    for _, made, _ in handed:  # what this file hands to another module's training loop: trained on there
        for call in made:
            training |= _loader(work, call, "train")
        built = [c for c in built if all(c is not m for m in made)]
    work.done.extend(want if every else f"{want} {NOT_PASSED}"  # (a trainer's file is said fed by every caller's)
                     for want, _, every in handed if every is not None)
    handedin.ask_evaluations(work)
    for line, name in handedin.imported_evaluated(work, lambda binding: imported.origin_of(work.facts, binding))[:1]:
        work.leave(line, f"{name}, imported and made a training loader where it is built (each rank its shard), is "
                   "also handed to another module's evaluation, which would evaluate only this rank's shard",
                   "evaluate on a plain loader of its own (DataLoader(dataset, batch_size): handed to another "
                   "module's evaluation, convert leaves it whole, every rank evaluating the whole set), then convert "
                   "again", blocks=True)
    for call in handedin.passed_to_evaluate(work):  # another module's evaluation loops over it: kept whole
        binding = next((b for b in work.facts.bindings if b.value is call.node), None)
        held = bykey.holder(work.facts, call.node) if binding is None else None  # (``loaders['test']``)
        if (binding is not None and not loops_reading(work.facts, binding.target, binding.scope, since=binding) or
                held is not None and held.key is not None) and any(c is call for c in built):
            built = [c for c in built if c is not call]
            shown = f"{binding.target} = DataLoader(...)" if binding is not None else \
                f"the DataLoader {held.name}[{held.key!r}]" if held is not None else ""
            work.keep(call.line, f"{shown} left as it is", "another module of the "
                      "project evaluates what this file hands it: each rank reads all of it, which is right")
    return built, training


def _one(work: _Work, call: Call, built: list[Call]) -> tuple[bool, bool, bool]:
    """One DataLoader this file builds, decided: whether it is trained on, whether for another module's loop, and
    whether nothing reads it (dropped from ``built``)."""
    if bysplit.converted(call.node, work.facts.module):  # a split written already: its whole side stays
        return False, False, False
    wanted = _wanted(work, call)
    split = bysplit.split(work, call)
    if split is None and bysplit.both_roles(work, call):
        work.leave(call.line, f"one DataLoader line builds both a training and an evaluation loader "
                   f"({call.scope.name}() is called for each, and returned as one of a tuple), and no argument "
                   "of those calls tells them apart: sharded for training, the evaluation would read padded "
                   "shards", "give the function an argument that differs between the two calls (shuffle=True "
                   "for the training one only, or train=True / False), or build the evaluation loader with a "
                   "DataLoader line of its own, then convert again", blocks=True)
        return False, False, False
    if split is not None:  # one factory, every split: the string decides (bysplit.py)
        # (for another module's loop when trained on there: this file's handed-in loops still ask)
        return bysplit.by_split(work, call, split, _loader), not split.loops, False
    held_trains = bysplit.by_key(work, call, _loader)
    if held_trains is not None:  # held in a dict by its split's string: the keys trained on decide (bykey.py)
        return held_trains, False, False
    if wanted is not None and work.crossing.wants[wanted] == TRAIN:  # another module trains on it (a project)
        trains = _loader(work, call, "train")
        work.done.extend(bysplit.asked(work, call))  # (each split's ask: the evaluating one learns it is sharded)
        return trains, True, False
    keyed = askedkeys.keyed(work, call, built) if wanted is None else None
    if keyed is not None and keyed[1] == TRAIN:  # the one that shuffles, of a dict of loaders asked for
        trains = _loader(work, call, "train")
        work.done.append(keyed[0])
        return trains, False, False
    if keyed is not None and not keyed[1]:
        work.leave(call.line, f"another module of the project trains on {keyed[0]}, and which of the "
                   f"DataLoaders of {call.scope.name}() that key holds is not followed (told by shuffle=True "
                   "when exactly one shuffles, written out)", "make the training loader the only one built with "
                   "shuffle=True, or build it in a function of its own, then convert again", blocks=True)
        return False, False, False
    if keyed is not None:
        work.keep(call.line, f"the DataLoader {keyed[0]} holds left as it is", "another module of the project "
                  f"trains on the one {call.scope.name}() returns under the training key: each rank reads all of "
                  "this one, which is right for an evaluation")
        return False, False, False
    if wanted is None and loaderuse.beside_asked(work, call):  # returned beside an asked loader, trained on by none
        work.keep(call.line, "a DataLoader a function returns beside the one asked for, left as it is",
                  "no module of the project trains on it: where it is read, each rank reads all of it, which is "
                  "right for an evaluation")
        return False, False, False
    if wanted is not None:  # another module's loop reads it, and does not train
        name = bysplit.base(wanted)
        shown = f"{name} = DataLoader(...)" if "(" not in name or "()." in name else \
            f"the DataLoader {name} returns"
        work.keep(call.line, f"{shown} left as it is", "another module of the project "
                  "loops over it without training: each rank reads all of it, which is right for an evaluation "
                  "(ddpkit.data_loader(..., train=False) and a ddpkit.reduce of the sums there would share it)")
        return False, False, False
    if loaderuse.unused(work, call):
        return False, False, True
    return _loader(work, call), False, False


def _held_in_return(work: _Work, binding: Any) -> bool:
    """``binding``'s loader is returned by its function, which no line of this file calls, inside a dict or a nested
    tuple (``return {"dataloaders": (train_dl, test_dl)}``), a shape another module's ask does not name."""
    if callers(work.facts, binding.scope):  # (its callers here: their loops decide)
        return False
    for scope, value in work.facts.returns:
        if scope is not binding.scope or not scope.name or not isinstance(value, (cst.Dict, cst.Tuple, cst.List)):
            continue
        held = [n for e in unpacked(value) if not isinstance(e, cst.Name) for n in m.findall(e, m.Name())]
        if isinstance(value, cst.Dict):
            held = [n for el in value.elements for n in m.findall(el, m.Name())]
        if any(isinstance(n, cst.Name) and n.value == binding.target for n in held):
            return True
    return False


def _evaluating(call: Call) -> bool:
    """``ddpkit.data_loader(..., train=False)``: an evaluation's loader."""
    return any(a.keyword is not None and a.keyword.value == "train" and dotted(a.value) != "True"
               for a in call.node.args)


def _wanted(work: _Work, call: Call) -> str | None:
    """The name another module's loop reads ``call``'s loader by (:class:`~ddpkit.commands.convert.crossing.Crossing`):
    the module-level name it is bound to, what a function returns it as (``get_loaders()[0]``), or the attribute
    of its class's instance (``Cifar().train``: ``self.train = DataLoader(...)``); None when no other module asks
    for it."""
    asked = bysplit.asked(work, call)
    return next((n for n in asked if work.crossing.wants[n] == TRAIN), asked[0] if asked else None)


def _loader(work: _Work, call: Call, role: str | None = None, only: list[Loop] | None = None,
            when: tuple[str, str] | None = None) -> bool:
    """Rewrite one ``DataLoader(...)``; whether it is a training one. ``only``: its loops (a split's, bysplit.py),
    not every loop over it; ``when``: the variable of a loop over every split around them, and the test of the
    splits this one holds (its loops' sums are reduced under it)."""
    positional = [a for a in call.node.args if a.keyword is None and not a.star]
    if len(positional) > len(LOADER_PARAMETERS) or any(a.star == "*" for a in call.node.args):
        work.leave(call.line, "DataLoader(*args) or more positional arguments than it takes",
                   "pass its arguments by name, then convert again", blocks=True)
        return True
    kwargs = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
    kwargs.update({LOADER_PARAMETERS[i]: a.value for i, a in enumerate(positional) if i >= 2})
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, cst.Name) and v.value == "None")}
    if "batch_sampler" in kwargs:
        work.leave(call.line, "DataLoader(batch_sampler=...): ddpkit splits a stream of samples across ranks, not "
                   "batches; a batch sampler that builds each batch by a rule (P classes x K samples of each, "
                   "lengths alike) would lose it when its samples are dealt out", "a plain one (a BatchSampler over a "
                   "sampler): pass that sampler as sampler= and its batch_size=, then convert again; one that groups "
                   "samples: keep it per rank yourself (each rank builds whole batches from its own share), or run "
                   "it as one process", blocks=True)
        return True
    binding = next((b for b in work.facts.bindings if b.value is call.node), None)
    loops = loops_reading(work.facts, binding.target, binding.scope, since=binding) if binding else \
        [loop for loop in work.facts.loops if isinstance(loop.node, cst.For) and call.line == loop.line]
    returned = loaderuse.returned(work.facts, call) if binding is None and not loops else None
    if returned:  # ``return DataLoader(...)``: the loops over what its callers bind
        loops = list({id(lp): lp for b in returned for lp in loops_reading(work.facts, b.target, b.scope)}.values())
        binding = returned[0] if len(returned) == 1 else None
    loops = loops if only is None else only
    unbound = loaderuse.iterated_in_place(work.facts, call) if returned and loops else []
    if role is not None:  # another module of the project trains on it (crossing): its loops are there
        pass
    elif unbound:  # (an LSTM lesson's ``sum(... for x, y in create_dataset(dev, batch_size=1))``: an evaluation)
        work.leave(call.line, f"the function returning this DataLoader is also called at line {unbound[0].line}, "
                   "its loader iterated there or handed on, unbound: convert cannot tell that loader's role (an "
                   "evaluation would be sharded with the training one)", "build the evaluation loader with a "
                   "DataLoader line of its own (or a function of its own), then convert again", blocks=True)
        return False
    elif returned is not None and not loops and not loaderuse.called(work.facts, call):
        work.keep(call.line, "a DataLoader a function returns, called from no line of this file, left as it is",
                  "its callers are elsewhere (or nowhere): a file of the project that trains on it asks for it, "
                  "and it is converted then (ddpkit convert --imports SCRIPT, or a folder)")
        return False
    elif returned is not None and not loops:
        work.leave(call.line, "a DataLoader returned by a function: no loop over what its callers bind was found",
                   "bind it where the function is called (train_loader = get_loader(...)) and loop over that "
                   "name, or build the loader there, then convert again", blocks=True)
        return False
    elif binding is None and not loops and loaderuse.comprehended(work, call):  # sam's mean/std, ``DataLoader(raw)``
        work.keep(call.line, "a DataLoader read by a comprehension left as it is", "no training step reads it "
                  "there (statistics of the data): each rank reads all of it, which is right")
        return False
    elif binding is None and not loops:  # in a comprehension or an argument: one call, maybe several roles
        stored = _stored_into(work, call)  # (``groups_loader[group] = DataLoader(...)`` in a loop: set 27)
        where = f"stored into {stored} (an entry of a dict or list)" if stored else \
            "built inside an expression (a comprehension, a call's argument)"
        work.leave(call.line, f"a DataLoader {where}: its loaders' roles cannot be followed", "bind each loader to a "
                   "name (train_loader = DataLoader(...)), then convert again", blocks=True)
        return False
    peeks = [loop for loop in loops if peek(loop)]  # a look at the first batch: no role, nothing to sum
    # (nor a generator's loop that yields each batch on: no_grad there would hold in its caller's training loop)
    loops = [loop for loop in loops if loop not in peeks and not roles.passes_on(loop)]
    away = loaderuse.handed_away(work, binding) if role is None and not loops and binding is not None else None
    if away is not None and binding is not None:  # its loop is in another module: its shuffle=True says nothing
        work.leave(call.line, f"{binding.target} is handed to {away}, a function of another module whose loop over "
                   "it decides its role: left as it is (each rank reads all of it)", "convert them together "
                   "(ddpkit convert --imports SCRIPT, or a folder), or make it ddpkit.data_loader(dataset, "
                   "global_batch_size=B) yourself if that loop trains")
        return False
    if role is None and not loops and binding is not None and _held_in_return(work, binding):
        work.keep(call.line, f"{binding.target}, returned inside what {binding.scope.name}() returns (a dict or a "
                  "tuple holding it), left as it is", "no loop of this file reads it and its callers' reads through "
                  "that value are not followed: each rank reads all of it, right for an evaluation; make it "
                  "ddpkit.data_loader(dataset, global_batch_size=B) yourself where a loop trains on it")
        return False
    comprehended = loaderuse.comprehensions_reading(work.facts, returned or ([binding] if binding else [])) \
        if role is None and not loops else []
    if comprehended:  # ``sum(f(x) for x, y in test_loader)``: read whole there, whatever its shuffle says
        return loaderuse.comprehended_only(work, call, comprehended)
    if role is None and not loops and binding is not None and drawn.drawn_once(work, binding):
        work.keep(call.line, f"a DataLoader drawn from once (next(iter({binding.target})) outside any loop) left as "
                  "it is", "one batch taken before the loops (a fixed sample to show): no training step reads it")
        return False
    role = role or roles.role(work.facts, loops, binding, call)
    if role == "train" and binding is not None and roles.flagged_off(work.facts, binding, loops):
        # (kefth's ``run_model(net, val_loader, opt, False)``: its loop trains only when told; one loop, two roles)
        work.leave(call.line, f"{binding.target} is handed only to a training loop with its step switched off (an "
                   "evaluation through the training function): sharded as a training loader, each rank evaluates its "
                   "shard padded to the global batch, so what it counts there differs a little from one process's",
                   "evaluate it in a loop of its own over ddpkit.data_loader(dataset, batch_size, train=False), "
                   "then convert again")
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
    if role is None and not loops and binding is not None and loaderuse.returns(work.facts, binding) and \
            not loaderuse.called(work.facts, call):  # (a factory no one here calls: joint-vae's test loader's)
        work.keep(call.line, "a DataLoader a function returns, called from no line of this file, left as it is",
                  "its callers are elsewhere (or nowhere): a file of the project that loops over it asks for it, "
                  "and it is converted then (ddpkit convert --imports SCRIPT, or a folder)")
        return False
    if role is None and loaderuse.uncalled(work, call):  # (RAdam's utils/misc.py ``get_mean_and_std``: uncalled)
        work.keep(call.line, f"a DataLoader in {call.scope.name}(), which no file of the project calls, left as it "
                  "is", "nothing runs it here")
        return False
    if role is None and loops and _only_runs(work, loops):
        work.keep(call.line, f"a DataLoader only read by loops that run the model and train nothing "
                  f"({roles_said(work.facts, loops)}), left as it is", "every rank reads all of it, which is right")
        return False
    if role is None:
        named = "; its name says evaluation, but it shuffles (shuffle=True), and a name is trusted only for a " \
            "loader read in order" if roles.shuffled_eval_name(work.facts, binding, call) else ""
        work.leave(call.line, f"a DataLoader whose role cannot be told: {roles_said(work.facts, loops)}{named}",
                   "convert it yourself: ddpkit.data_loader(dataset, batch_size) to train, "
                   "ddpkit.data_loader(..., train=False) to evaluate (one loader per role)", blocks=True)
        return False
    # the batch first: a training sum over ``len(loader) * batch_size`` is every sample's only with the global batch
    rename, batches = batch.global_batch(work, call, loops or drawn.drawing_loops(work, binding)) \
        if role == "train" else (None, frozenset[str]())
    if not reductions(work, loops, call, role == "train", batches, when):
        return False
    shared = loaderuse.comprehensions_reading(work.facts, returned or ([binding] if binding else [])) \
        if role == "train" else []
    if role == "train":
        drawn.said_peeked(work, returned or ([binding] if binding else []))
    for line in sorted({line for line, trains in shared if not trains}):  # (review 30's D5: no loop to reduce)
        work.leave(line, "a comprehension over a loader sharded for training: each rank reads its own shard there, "
                   "so what it computes is this rank's share", "write it as a for loop over the loader (its sums are "
                   "then reduced), or ddpkit.reduce what it computes")
    how = "training: each rank takes its own shard, reshuffled every epoch" if role == "train" else \
        "evaluation (train=False): each rank its part, no sample twice"
    starred = any(a.star == "**" for a in call.node.args)
    keywords = {"train": "False"} if role == "eval" and "train" not in kwargs else {}
    if role == "train" and not {"shuffle", "sampler"} & set(kwargs) and not starred:
        keywords["shuffle"] = "False"  # torch's default, kept: data_loader's would shuffle
        how = "training: each rank takes its own shard, in order (shuffle=False: torch's default, kept)"
    elif role == "train" and dotted(kwargs.get("shuffle") or cst.Name("_")) == "False" and "sampler" not in kwargs:
        how = "training: each rank takes its own shard, in order (shuffle=False, kept)"
    elif role == "train" and starred and not {"shuffle", "sampler"} & set(kwargs) and batch.in_order(work, call):
        how = "training: each rank takes its own shard, in order ('shuffle': False added to the ** dict: torch's " \
            "default, kept; an update of the dict still decides)"
    elif role == "train" and starred and not {"shuffle", "sampler"} & set(kwargs):
        how += " (unless the ** arguments say shuffle=False; a torch DataLoader did not shuffle by default)"
    if call.loader_class is not None:  # PyG's: its collate kept
        keywords["loader_class"] = call.loader_class
    work.edits.expr[id(call.node)] = lambda node: (rename or _same)(loader_call(node, keywords))
    if role == "train":
        work.sharded.add(id(call.node))
        if loaderuse.built_each_pass(work, call, loops) and \
                dotted(kwargs.get("shuffle") or cst.Name("_")) not in ("_", "False"):
            # (glow's endless sample_data rebuilds its loader when it runs dry; a loader built in the epoch loop)
            work.leave(call.line, "a shuffled training DataLoader built inside a loop, again each pass: a "
                       "ddpkit.data_loader reads the order of its seed and epoch, so each new one reads epoch 0's "
                       "order again, where torch's drew a new one", "build it once above the loop and iterate it "
                       "each pass (each pass is the next epoch), or call loader.set_epoch(k) on each new one with a "
                       "count k of the builds")
        away = loaderuse.handed_away(work, binding) if binding is not None else None
        origin = imported_from(work.facts, away) if away is not None else None
        if binding is not None and away is not None and \
                (origin is None or origin[0].split(".")[0] not in work.facts.own):
            # (a module of the project converted together: it says what its loop does with the loader)
            work.leave(call.line, f"{binding.target}, a training loader now (each rank its shard), is also handed "
                       f"to {away}, a function of another module whose loop convert does not see here: what it "
                       "counts or evaluates over it is this rank's shard only", "convert them together (ddpkit "
                       "convert --imports SCRIPT, or a folder), or hand it a plain DataLoader over the same dataset")
    work.note(f"DataLoader -> ddpkit.data_loader ({'training' if role == 'train' else 'train=False'})",
              how, call.line)
    return role == "train"

def _same(node: cst.Call) -> cst.Call:
    return node


def _only_runs(work: _Work, loops: list[Loop]) -> bool:
    """Each loop over the loader trains nothing and calls nothing that might (no step, no backward, no function of
    another module of the project), in a script that trains elsewhere: yolo_v1's shuffled ``test_loader`` read
    after training to print the model's predictions (set 26, refused as of a role that cannot be told)."""
    trains = any(flow.trains(work.facts, lp) for lp in work.facts.loops)
    return trains and all(not flow.trains(work.facts, lp) and not any(
        c.last in ("step", "backward") or imported_from(work.facts, c.name or "") is not None for c in lp.calls)
        for lp in loops)


def _stored_into(work: _Work, call: Call) -> str:
    """``d[k]`` of ``d[k] = DataLoader(...)``: the entry the loader is stored into; empty otherwise."""
    small = call.stmt.body[0] if isinstance(call.stmt, cst.SimpleStatementLine) and len(call.stmt.body) == 1 \
        else None
    if isinstance(small, cst.Assign) and small.value is call.node and len(small.targets) == 1 and \
            isinstance(small.targets[0].target, cst.Subscript):
        return work.facts.code(small.targets[0].target)
    return ""
