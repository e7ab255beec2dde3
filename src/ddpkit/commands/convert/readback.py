"""Files rank 0 writes and the script reads back: the other ranks must wait for the write (a barrier every rank
passes, after it), or it is left to the user where no such place can be told (the write in an ``if`` or a loop, a
read in a function apart). :func:`read_back` is run by :mod:`.writes` for each write it guards.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import json\\nimport ddpkit\\nstate = ddpkit.init()\\nwith open('r.json', 'w') as f:\\n"
    ...          "    json.dump({}, f)\\nprint(json.load(open('r.json')))\\n")
    >>> [line for line in p.text.splitlines() if "barrier" in line]
    ['ddpkit.barrier()']
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.convert import flow, order, paths
from ddpkit.commands.convert.flow import binding_of, in_body
from ddpkit.commands.convert.names import heads
from ddpkit.commands.convert.paths import OPENERS
from ddpkit.commands.convert.scan import Call
from ddpkit.commands.convert.waits import (
    barrier_between,
    branch_said,
    branched,
    callers_apart,
    in_main_block,
    own_barrier,
    read_elsewhere,
    wait_before,
)

_Work = Any  # the plan in the making (plan._Work)


READS = ("load", "read_csv", "read_json", "loadtxt", "imread", "read_parquet", "read_excel")
READ_CALLS = ("scipy.io.wavfile.read", "soundfile.read", "scipy.io.loadmat")  # (``read`` alone is anyone's)


def read_back(work: _Work, call: Call, stmt: Any, what: str | None = None) -> None:
    """A file read below the write (``json.load(open(p))``, ``np.load``, ``pd.read_csv``), maybe the one written:
    the other ranks wait for rank 0 (a barrier after the guarded write), as after a guarded ``torch.save``; in an
    ``if`` or a loop, where one rank may not pass, left to you."""
    reads = [c for c in work.facts.calls if c.line > call.line and c.name != "torch.load" and
             ((c.name in OPENERS and not writing(c.node)) or c.last in READS and c.name not in (None, "torch.load")
              or c.name in READ_CALLS)
             and not order.read_first(work.facts, c, call)]
    written = _written_path(call)
    reads = [c for c in reads if paths.maybe_same(work.facts, call, written, c, paths.first_path(c))]
    if what in ("the image", "the figure", "the animation"):  # (a picture is read as one:
        # pytorch-cnp's per-step ``plt.imsave`` PNGs are no checkpoint its ``self.load()`` reads)
        reads = [c for c in reads if c.name in OPENERS or c.last in ("imread", "mimread", "read_image", "open")]
    if not reads:  # (nothing here reads it: a function of another module called next may, ChatBotCHS's
        # ``load_vocab(Path('.'))`` right below the guarded write of ``vocab.dict``)
        elsewhere = read_elsewhere(work, call)
        if elsewhere is not None and not branched(work, call):
            work.edits.after.setdefault(id(stmt), []).append("ddpkit.barrier()")
            work.note("then every rank waits for it (barrier)", f"{elsewhere}() of another module of the project "
                      "runs next and may read the file", call.line)
        return
    if branched(work, call) and (_waited(work, call, reads) or own_barrier(work, call, reads) or
                                 barrier_between(work, call, reads) or wait_before(work, call, reads)):
        return
    pairs = [c for c in reads if _pair(work, call, c, reads)]  # (two functions apart: order.apart_functions)
    apart = pairs + [c for c in reads if c not in pairs and _read_before_call(work, call, c)]
    paired = pairs[0] if pairs else None
    if branched(work, call) and paired is not None and len(apart) == len(reads):  # (save_x / load_x: callers order)
        work.keep(call.line, f"a file is read at line {paired.line} in {paired.scope.name}(), a function apart from "
                  f"{call.scope.name}() that writes here; no function of this file runs both", "a caller that writes "
                  "and then reads should put ddpkit.barrier() between the two calls")
        return
    if branched(work, call):  # (a rank may not pass the barrier)
        work.leave(call.line, f"a file is read at line {reads[0].line} (maybe the one written here), and the write "
                   f"is {branch_said(work, call)}: the other ranks may read it before rank 0 has written it",
                   "put ddpkit.barrier() after the write where every rank passes")
        return
    work.edits.after.setdefault(id(stmt), []).append("ddpkit.barrier()")
    work.note("then every rank waits for it (barrier)", f"a file is read at line {reads[0].line}", call.line)


def _pair(work: _Work, write: Call, read: Call, reads: list[Call]) -> bool:
    """The write and the read are in two functions, each given its path as a parameter (the read's function opens
    one: ``pickle.load(f)`` reads what ``open(vocab_path)`` opened), and no function of this file runs both, itself
    or through the functions it calls (BERT-pytorch's ``Vocab.save_vocab(self, vocab_path)`` and
    ``load_vocab(vocab_path)``: the build tool saves, the trainer loads)."""
    # (or a path made from one: ChatBotCHS's ``open(saved_dir / 'vocab.dict', 'wb')``)
    if not _given(write) or not any(c.scope is read.scope and _given(c) for c in reads):
        return False
    return callers_apart(work, write.scope, read.scope)


def _given(call: Call) -> bool:
    """The path ``call`` opens is a parameter of its function, or made from one."""
    path = paths.first_path(call)
    return path is not None and bool(heads(path) & set(call.scope.params))


def _read_before_call(work: _Work, write: Call, read: Call) -> bool:
    """The read is in a function that runs the write's function only below it, outside any loop, and is itself run
    by nothing or by the module's lines outside any loop (BERT-pytorch's ``build()`` reads its corpus, then calls
    ``vocab.save_vocab(path)``): no later write can come before that read."""
    name = write.scope.name.rsplit(".", 1)[-1]  # (``vocab.save_vocab``: an inherited method is its class's too)
    runs = [c for c in work.facts.calls if c.scope is read.scope and (c.last == name or c.name == name)]
    callers = flow.callers(work.facts, read.scope)
    return bool(runs) and not read.loops and all(c.line > read.line and not c.loops for c in runs) and \
        all(not c.scope.name and not c.loops for c in callers)


def _written_path(call: Call) -> Any:
    """The path a write is given (``save_image(tensor, fp)``: its second)."""
    if call.name == "torchvision.utils.save_image":
        positional = [a.value for a in call.node.args if a.keyword is None]
        return positional[1] if len(positional) > 1 else next(
            (a.value for a in call.node.args if a.keyword is not None and a.keyword.value in ("fp", "filename")), None)
    return paths.first_path(call)


def _waited(work: _Work, call: Call, reads: list[Call]) -> bool:
    """A barrier every rank passes comes between the write and every read, all in the write's function and below
    the barrier: one convert puts after a later write of the same function (PyTorch_Practice's GAN lesson: each
    epoch's figure saved in the loop, the loss figure after it, then the figures read back), or one the script
    has. Not a read in another function (called in the loop, it may run before the barrier)."""
    if any(r.scope is not call.scope for r in reads):
        return False
    read = min(r.line for r in reads)

    def unbranched(c: Call) -> bool:
        return c.scope is call.scope and call.line < c.line < read and c.stmt is not None and \
            (in_body(c.stmt, c.scope) or in_main_block(work.facts.module, c.stmt)) and not branched(work, c)
    return any(unbranched(c) and ("ddpkit.barrier()" in work.edits.after.get(id(c.stmt), ()) or
                                  c.name == "ddpkit.barrier") for c in work.facts.calls)


def writing(node: cst.Call, call: Call | None = None, facts: Any = None) -> bool:
    """``open(path, "w")`` / ``"a"`` / ``"wb"`` / ``mode="x"``: a mode that writes, given as a string, or a name
    bound to one or to a choice of them (:func:`modes`)."""
    return any(c in mode for mode in modes(node, call, facts) for c in "wax")


def modes(node: cst.Call, call: Call | None = None, facts: Any = None) -> set[str]:
    """The mode strings ``open(...)`` may get: written there, or through a name its function binds above it to one or
    to a choice of them (a logger's ``mode = "a" if append else "w"``, then ``open(path, mode)``); empty when
    they cannot be told."""
    positional = [a for a in node.args if a.keyword is None]
    if call is not None and call.name not in OPENERS:  # (``path.open("a")``: pathlib's mode comes first)
        positional = [None, *positional]  # type: ignore[list-item]
    mode = positional[1].value if len(positional) > 1 else next(
        (a.value for a in node.args if a.keyword is not None and a.keyword.value == "mode"), None)
    if isinstance(mode, cst.Name) and call is not None and facts is not None:
        bound = binding_of(facts, mode.value, call.scope, call.line)
        mode = bound.value if bound is not None and bound.line < call.line else None
    choices = [mode.body, mode.orelse] if isinstance(mode, cst.IfExp) else [mode]
    found = {c.evaluated_value for c in choices if isinstance(c, cst.SimpleString) and
             isinstance(c.evaluated_value, str)}
    return found if len(found) == len(choices) else set()
