"""Folders every rank makes: ``os.mkdir(d)`` / ``os.makedirs(d)`` / ``Path(d).mkdir()`` get ``exist_ok=True`` (all
but the first rank would find the folder made), and an ``if os.path.isdir(d): ... else: os.makedirs(d)`` that
asks or raises is decided on rank 0, then a barrier.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> print(plan("import os\\nos.mkdir('out')\\n").text.splitlines()[-1])
    os.makedirs('out', exist_ok=True)
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import waits
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.names import dotted, resolve

_Work = Any  # the plan in the making (plan._Work)


def mkdir(work: _Work, call: Any) -> None:
    """``os.mkdir(d)`` / ``os.makedirs(d)`` / ``Path(d).mkdir()`` -> ``os.makedirs(d, exist_ok=True)`` (``.mkdir(...,
    exist_ok=True)``): every rank runs it, and all but the first find the folder made (FileExistsError), also
    behind an ``if not os.path.isdir(d)`` test, which they may all pass before any makes it."""
    node, func = call.node, call.node.func
    if any(main_guard_of(t) for t in call.tests):  # (made by rank 0 already: a second conversion's input)
        return
    tried = _tried_first(work, call)
    if tried is not None:  # ``try: os.mkdir(d) except FileExistsError: sys.exit(1)``: the script's own refusal
        work.edits.guard[id(tried)] = waits.main_test(work, call.scope, call.line)
        work.edits.after.setdefault(id(tried), []).append("ddpkit.barrier()")
        work.note(f"try: {call.last}(...) except FileExistsError guarded, then a barrier", "rank 0 makes the folder "
                  "or refuses as the script does (its exit ends the launch); a later rank would find it made and "
                  "refuse a new run, and exist_ok=True would drop the refusal", call.line)
        return
    said = [a for a in node.args if a.keyword is not None and a.keyword.value == "exist_ok"]
    if said and isinstance(said[0].value, cst.Name) and said[0].value.value == "True":
        return
    if call.name == "os.mkdir" and not isinstance(func, cst.Attribute) or \
            any(a.keyword is not None and a.keyword.value == "dir_fd" for a in node.args):
        work.leave(call.line, "a folder made on every rank: all but the first find it made (FileExistsError)",
                   "write os.makedirs(path, exist_ok=True)")
        return
    positional = [a for a in node.args if a.keyword is None and not a.star]
    keep = 2 if call.last != "mkdir" or call.name == "os.mkdir" else 1  # (path, mode); Path.mkdir(mode, parents)
    cut = len(positional) > keep  # ``os.makedirs(d, 0o755, False)``: its exist_ok goes by name

    def safe(n: cst.Call) -> cst.Call:
        args = [a for a in n.args if not (a.keyword is not None and a.keyword.value == "exist_ok")]
        if cut:
            args = args[:keep] + args[keep + 1:]
        if call.name == "os.mkdir":
            n = n.with_changes(func=n.func.with_changes(attr=cst.Name("makedirs")))
        if args and len(args) < len(n.args):  # one went: the new last one ends the call
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return add_keyword(n.with_changes(args=args), "exist_ok", "True")

    work.edits.expr[id(node)] = safe
    work.note(f"{call.last}(...) -> {'os.makedirs' if call.name == 'os.mkdir' else call.last}(..., exist_ok=True)",
              "every rank makes the folder: all but the first would find it made (FileExistsError)", call.line)
    asked = _asked_first(work, call)
    if asked is not None:  # ``if os.path.isdir(d): input('Overwrite?') ... else: os.makedirs(d)`` (cs-kd)
        at = min((c.line for c in work.facts.calls if c.node is asked.test), default=call.line)
        work.edits.guard[id(asked)] = waits.main_test(work, call.scope, at)
        work.edits.after.setdefault(id(asked), []).append("ddpkit.barrier()")
        work.note("if os.path.isdir(...): ... else: makedirs(...) guarded, then a barrier", "rank 0 checks and makes "
                  "the folder: a rank that came later would find it made and take the other branch (its question, "
                  "its error)", call.line)


EXISTS = ("FileExistsError", "OSError", "IOError", "Exception")  # what a made folder raises, as a handler names it


def main_guard_of(test: str) -> bool:
    """A test of ddpkit's rank 0 (``ddpkit.init().is_main``, ``state.is_main``): a conversion's own guard."""
    return test.strip().endswith(".is_main")


def _tried_first(work: _Work, call: Any) -> cst.Try | None:
    """The ``try`` that makes the folder ``call`` makes, alone in its body, with a handler of an existing folder
    (``except FileExistsError: print(...); sys.exit(1)``: a homework's refusal to overwrite a run; set 27); None
    when it binds a name (the other ranks would lack it) or runs in a loop."""
    # (under a test of its own, ``if not os.path.exists(d):``, a rank that tests after rank 0 made it would skip
    # the barrier: review 42)
    if call.loops or call.stmt is None or [t for t in call.tests if not waits.main_guard(t)] or \
            waits.called_in_branch(work, call.scope):  # (a helper called under ``if not exists``: review 43)
        return None
    for node in m.findall(work.facts.module, m.Try()):
        assert isinstance(node, cst.Try)
        body = node.body.body if isinstance(node.body, cst.IndentedBlock) else []
        caught = {n for h in node.handlers for n in ([dotted(h.type)] if h.type is not None and
                  not isinstance(h.type, cst.Tuple) else [dotted(e.value) for e in h.type.elements]
                  if isinstance(h.type, cst.Tuple) else ["Exception"])}
        # (a handler that refuses: raises, exits or returns; ``except OSError: pass``, the DCGAN example's, is
        # exist_ok=True already)
        # (not a ``return``: rank 0 would return past the barrier the others wait in; review 43)
        refuses = any(m.findall(h.body, m.Raise() | m.Call(func=m.Name("exit") | m.Name("quit") |
                                                           m.Attribute(attr=m.Name("exit"))))
                      for h in node.handlers)
        inside = {id(n) for n in m.findall(node, m.SimpleStatementLine())}
        if len(body) == 1 and body[0] is call.stmt and caught & set(EXISTS):
            bound = {b.target for b in work.facts.bindings if id(b.stmt) in inside}
            within = {id(n) for n in m.findall(node, m.Name())}
            # (names read after the try: ``msg = ...; sys.exit(msg)`` in the handler reads its own: review 43)
            if any(n in bound and id(r) not in within for n, _s, _l, r in work.facts.reads):  # (``resume = True``
                work.leave(call.line, "a folder made in a try whose handler sets names the script reads (a resume "
                           "when it exists): a rank that came after rank 0 made it would take the handler",
                           "decide on rank 0 (under `if ddpkit.init().is_main:`) and hand the other ranks its "
                           "choice (ddpkit.broadcast), with a ddpkit.barrier() after the folder is made")
                return None
            return node if refuses else None
    return None


def _asked_first(work: _Work, call: Any) -> cst.If | None:
    """The ``if`` whose ``else`` makes the folder ``call`` makes, after testing that it exists, and whose other
    branch acts on it (asks with ``input()``, raises, removes it): each rank would take its own branch."""
    if call.loops or call.stmt is None:
        return None
    for node in m.findall(work.facts.module, m.If()):
        assert isinstance(node, cst.If)
        test = node.test.func if isinstance(node.test, cst.Call) else None
        if not (isinstance(node.orelse, cst.Else) and isinstance(node.orelse.body, cst.IndentedBlock) and
                any(s is call.stmt for s in node.orelse.body.body) and (dotted(test) or "").endswith(
                    ("path.isdir", "path.exists", ".exists", ".is_dir"))):
            continue
        acts = m.findall(node.body, m.Raise() | m.Call(func=m.Attribute(attr=m.Name("rmtree"))) |
                         m.Call(func=m.Name("input")))
        inside = {id(s) for s in m.findall(node, m.SimpleStatementLine())}
        bound = {b.target for b in work.facts.bindings if id(b.stmt) in inside}
        lines = [line for s, _scope, line in work.facts.statements if id(s) in inside] or [call.line]
        # (a name bound in it and read outside it, below or in a function, ``start_epoch``, a module's ``resume``:
        # guarded, the other ranks would lack it)
        read_below = any(n in bound and not (sc is call.scope and min(lines) - 1 <= line <= max(lines))
                         for n, sc, line, _ in work.facts.reads)
        if acts and read_below:
            work.leave(call.line, "a folder checked, then made or asked about, in an if / else that binds names read "
                       "below: a rank that came after rank 0 made it would take the other branch",
                       "decide on rank 0 (under `if ddpkit.init().is_main:`) and hand the other ranks its choice "
                       "(ddpkit.broadcast), with a ddpkit.barrier() after the folder is made")
        return node if acts and not read_below else None
    return None


def a_path(work: _Work, call: Any) -> bool:
    """``Path(d).mkdir()``, or ``p.mkdir()`` of a ``p`` bound to a ``Path(...)`` (other ``mkdir`` methods, an
    FTP client's, may take no exist_ok)."""
    func = call.node.func
    base = func.value if isinstance(func, cst.Attribute) else None
    if isinstance(base, cst.Name):
        bound = [b.value for b in work.facts.bindings if b.target == base.value and b.value is not None]
        base = bound[-1] if bound else base
    return isinstance(base, cst.Call) and (resolve(dotted(base.func), work.facts.aliases) or "").endswith("Path")
