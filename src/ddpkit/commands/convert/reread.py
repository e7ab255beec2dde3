"""A checkpoint read back after the training loop, in a project whose ``torch.save`` is in another module
(PatchTST: ``EarlyStopping`` of ``utils/tools.py`` saves the best model during training, rank 0 alone once
converted, and ``exp_main.py`` loads it after the epochs). Without a wait, another rank may read the file before rank
0 has written its last version (a stale model, and the ranks part: the run stops on a ReplicaError at its end). A
barrier goes before the read where every rank passes; elsewhere, the read is listed.

Example::

    >>> from ddpkit.commands.convert.crossing import Crossing
    >>> from ddpkit.commands.convert.plan import plan
    >>> text = ("import torch\\nfrom torch.utils.data import DataLoader\\nfrom tools import stopper\\n"
    ...         "def train(m, opt):\\n    for x in DataLoader(ds, batch_size=8, shuffle=True):\\n"
    ...         "        m(x).sum().backward()\\n        opt.step()\\n        stopper(m)\\n"
    ...         "    m.load_state_dict(torch.load('best.pt'))\\n")
    >>> done = plan(text, crossing=Crossing(own=frozenset({"tools", "main"})))
    >>> done.text.splitlines()[-2].strip()
    'ddpkit.barrier()'
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow
from ddpkit.commands.convert.crossing import TRAIN, want_of
from ddpkit.commands.convert.listmeans import RANK_TEST
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.waits import branched, in_main_block

_Work = Any  # the plan in the making (plan._Work)


def reread(work: _Work) -> None:
    """A barrier before each ``torch.load`` below a training loop of its function (or in a function called below a
    call of one that trains), in a project file that saves nothing above it itself (the save is another module's)."""
    calls = work.facts.calls
    # (a loop of this file trains: its model and loader may be another module's, FEDformer's exp_main.py; or a call
    # runs another module's training loop on what this file hands it, SabaMG's ``train(model, loader, ...)``)
    elsewhere = [c for c in calls if _trains_elsewhere(work, c)]
    if not work.crossing.own or not elsewhere and not any(flow.trains(work.facts, lp) for lp in work.facts.loops):
        return
    saves = [c for c in calls if c.name == "torch.save"]
    for load in (c for c in calls if c.name == "torch.load" and c.stmt is not None):
        # (a save of this file above the read is rules.py's to wait for; one in another function may be too, and
        # is not told apart here: no barrier, as before (review 23: an unrelated export() keeps it off); one below
        # it in the same function writes after the read: Crossformer's re-save of the best model it has just loaded)
        if any(s.line < load.line or s.scope is not load.scope for s in saves):
            continue
        after = [lp for lp in work.facts.loops if lp.scope is load.scope and lp.end < load.line and
                 flow.trains(work.facts, lp) and not lp.outer]
        after += [c for c in elsewhere if c.scope is load.scope and c.line < load.line]
        if (not after and not _after_training(work, load, elsewhere)) or id(load.stmt) in work.edits.guard:
            continue
        every = not load.loops and not any(t for t in load.tests if "__name__" not in t) and \
            (flow.in_body(load.stmt, load.scope) or in_main_block(work.facts.module, load.stmt)) and \
            (not flow.callers(work.facts, load.scope) or not branched(work, load))
        if not every:
            work.leave(load.line, "a file read after the training loop (maybe a checkpoint another module of the "
                       "project saved, rank 0's alone), inside an if or a loop: another rank may read it before rank "
                       "0 has written it", "put ddpkit.barrier() before the read where every rank passes")
            continue
        work.edits.before.setdefault(id(load.stmt), []).append("ddpkit.barrier()")
        work.note("ddpkit.barrier() before the read", "a checkpoint saved during training by another module of the "
                  "project (rank 0's alone) is read here: every rank waits until it is written", load.line)
        again = next((s for s in saves if s.line > load.line and s.stmt is not None and not s.loops and
                      s.scope is load.scope), None)
        top = _holder(work, again) if again is not None else None
        if again is not None and top is not None and "ddpkit.barrier()" not in work.edits.before.get(id(top), []):
            # (Crossformer loads the best model, then saves it again over the same path: rank 0 must not write
            # while another rank still reads; before the block that holds the save, where every rank passes)
            work.edits.before.setdefault(id(top), []).append("ddpkit.barrier()")
            work.note("ddpkit.barrier() before the save", f"the file read at line {load.line} may be the one written "
                      "here: every rank has read it before rank 0 writes it again", again.line)


def _holder(work: _Work, save: Any) -> Any:
    """The statement of the save's function body (or of the main block) that holds it: the save's own line, or
    the ``if`` / ``with`` around it."""
    node = save.scope.node
    body = list(node.body.body) if isinstance(node, cst.FunctionDef) and isinstance(node.body, cst.IndentedBlock) \
        else list(work.facts.module.body)
    main = [top for top in body if isinstance(top, cst.If) and in_main_block(work.facts.module, save.stmt) and
            isinstance(top.body, cst.IndentedBlock) and
            any(s is save.stmt for s in m.findall(top, m.SimpleStatementLine()))]
    if main:
        body = list(main[0].body.body)
    return next((top for top in body if top is save.stmt or any(s is save.stmt for s in m.findall(
        top, m.SimpleStatementLine()))), None)


def _trains_elsewhere(work: _Work, call: Any) -> bool:
    """``call`` runs a function of another module of the project whose training loop reads what its callers hand
    it (this file's wants ``trainer:train:1:train_loader`` or ``engine:a training step:Engine.train``, as a training
    loader): the checkpoint that function saves may be read below the call."""
    wants = [w for want, kind in work.crossing.wants.items() if kind == TRAIN and (w := want_of(want)) is not None]
    return any(flow.runs(work.facts, call, w.module, w.function) for w in wants)


def _after_training(work: _Work, load: Any, elsewhere: list[Any]) -> bool:
    """The load's function (``test()``) is called, where it is called, below a call of a function that trains
    (hazdzz/STGCN's ``train(...)`` then ``test(...)``, whose ``torch.load`` reads what the EarlyStopping of
    another module saved during training), or below one of ``elsewhere`` (another module's training run here)."""
    runs = flow.callers(work.facts, load.scope)
    trainers = {id(lp.scope) for lp in work.facts.loops if flow.trains(work.facts, lp)}
    # (called in a ``with open(...)`` block the converter makes rank 0's, or under a test of the rank: a barrier
    # there hangs; a loop or a test of the settings every rank passes alike: review)
    opens = [w for w in m.findall(work.facts.module, m.With()) if isinstance(w, cst.With) and any(
        isinstance(i.item, cst.Call) and dotted(i.item.func) in ("open", "io.open") for i in w.items)]
    if any(RANK_TEST.search(" ".join(run.tests).lower()) or
           any(any(n is run.node for n in m.findall(w, m.Call())) for w in opens) for run in runs):
        return False
    return bool(runs) and all(any(c.scope is run.scope and c.line < run.line and
                                  (id((flow.callee(work.facts, c) or (None,))[0]) in trainers or
                                   any(c is e for e in elsewhere)) for c in work.facts.calls) for run in runs)
