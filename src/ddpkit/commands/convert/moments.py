"""A run folder named by the clock (or a random id, ``uuid.uuid4()``): one name, rank 0's, on every rank.

``timestamp = datetime.datetime.now().isoformat()`` then ``save_folder = f'{args.save_folder}/exp{timestamp}/'``
(NRI's train.py): each process reads its own clock, so the ranks name different folders, rank 0 saves the
encoder into its own and another rank later loads from a folder no one wrote to. The string the clock gives is
made rank 0's on every rank, ``ddpkit.broadcast(...)`` (JSON between ranks). Only where every rank runs the line:
the module's top level or its main block, under tests of the script's settings alone (``if args.save_folder:``).

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import datetime\\nimport os\\nnow = datetime.datetime.now()\\nstamp = now.isoformat()\\n"
    ...             "os.makedirs('runs/' + stamp, exist_ok=True)\\n").text
    >>> [line for line in text.splitlines() if line.startswith("stamp")]
    ['stamp = ddpkit.broadcast(now.isoformat())']
"""

from __future__ import annotations

import re
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, resolve
from ddpkit.commands.convert.waits import in_main_block

_Work = Any  # the plan in the making (plan._Work)
CLOCKS = ("datetime.datetime.now", "datetime.datetime.today", "datetime.datetime.utcnow", "datetime.now",
          "datetime.today", "datetime.utcnow", "datetime.date.today")
TEXTS = ("isoformat", "strftime", "ctime")  # a clock's value as text
TIME_TEXTS = ("time.strftime", "time.ctime", "time.asctime")
SETTINGS = re.compile(r"^(not\s+)?(args|opt|opts|config|cfg|FLAGS|options)\.\w+$")


def moments(work: _Work) -> None:
    """``ddpkit.broadcast`` around each clock-made string a top-level statement binds (see the module)."""
    facts = work.facts
    clocks = {b.target for b in facts.bindings if isinstance(b.value, cst.Call) and
              resolve(dotted(b.value.func), facts.aliases) in CLOCKS}
    for stmt, scope, line in facts.statements:
        small = stmt.body[0] if len(stmt.body) == 1 else None
        if scope.name or not isinstance(small, cst.Assign) or len(small.targets) != 1 or \
                not isinstance(small.targets[0].target, cst.Name) or not (_clock_text(facts, small.value, clocks) or
                                                                          _drawn_id(facts, small.value)):
            continue
        tests: list[str] = next((c.tests for c in facts.calls if id(c.node) in node_ids(small.value)), [])
        if not all(t.strip() == "__name__ == '__main__'" or t.strip() == '__name__ == "__main__"' or
                   SETTINGS.match(t.strip()) or _settled(facts, t) for t in tests) or not _top(facts, stmt):
            continue
        name = small.targets[0].target.value
        # (a top-level line outside the main block runs again in each spawned loader worker, review; a broadcast
        # above the script's own ddpkit.init(cpu=...) would start ddpkit with the defaults first)
        # (an init in a function, ``main()``'s, runs after the main block's line whatever their line numbers)
        later = [first for sid, (first, _) in work.init_lines.items() if sid != id(scope) or first > line]
        if _main_block(facts) and not in_main_block(facts.module, stmt) or later:
            work.leave(line, f"{name} is made from the clock (or a random id): each process reads its own, so the "
                       "ranks would name different folders or files", "take rank 0's where every rank passes, "
                       f"below ddpkit.init() and inside the main block: {name} = ddpkit.broadcast(...)")
            continue
        work.edits.expr[id(small.value)] = lambda node: cst.Call(cst.parse_expression("ddpkit.broadcast"),
                                                                 [cst.Arg(node)])
        work.note(f"{name} = ddpkit.broadcast(...)", "a name made from the clock (or a random id): each "
                  "process reads its own, so the ranks would name different folders or files; rank 0's on every "
                  "rank", line)


def _drawn_id(facts: Any, value: Any) -> bool:
    """``f"run-{str(uuid.uuid4())[:4]}"``, ``uuid.uuid4().hex``, ``secrets.token_hex(4)``: a random id in the value,
    which each process draws its own of (a ResNet recipe's run folder)."""
    if isinstance(value, cst.Call) and resolve(dotted(value.func), facts.aliases) in IDS[:2]:
        return False  # (``uuid.uuid4()`` itself: an object, not the text broadcast sends as JSON)
    return any(isinstance(c, cst.Call) and resolve(dotted(c.func), facts.aliases) in IDS
               for c in m.findall(value, m.Call()))


IDS = ("uuid.uuid1", "uuid.uuid4", "secrets.token_hex", "secrets.token_urlsafe")


def _settled(facts: Any, test: str) -> bool:
    """A test of the script's settings alone, through a name bound from them at the top level (``log_dir =
    args.log_dir`` then ``if log_dir is None:``, set 27's homework): the same on every rank."""
    try:
        expression = cst.parse_expression(test)
    except cst.ParserSyntaxError:
        return False
    names = {n.value for n in m.findall(expression, m.Name()) if isinstance(n, cst.Name)} - {"None", "not"}
    top = facts.scopes.get("")
    return bool(names) and all(any(b.target == n and b.scope is top and b.value is not None and
                                   SETTINGS.match(dotted(b.value) or "") for b in facts.bindings) for n in names)


def _clock_text(facts: Any, value: Any, clocks: set[str]) -> bool:
    """``now.isoformat()``, ``datetime.now().strftime(...)``, ``time.strftime(...)``, ``str(datetime.now())``, and
    text joined with one (``'log/' + str(datetime.datetime.now())``, an f-string, ``os.path.join``)."""
    if isinstance(value, (cst.BinaryOperation, cst.FormattedString)) or isinstance(value, cst.Call) and \
            resolve(dotted(value.func), facts.aliases) == "os.path.join":
        return any(_clock_text(facts, c, clocks) for c in m.findall(value, m.Call()) if c is not value) or any(
            isinstance(e, cst.FormattedStringExpression) and (dotted(e.expression) in clocks or isinstance(
                e.expression, cst.Call) and resolve(dotted(e.expression.func), facts.aliases) in CLOCKS)
            for e in m.findall(value, m.FormattedStringExpression()))  # (``f'log/{datetime.now()}'``)
    if not isinstance(value, cst.Call):
        return False
    name = resolve(dotted(value.func), facts.aliases) or ""
    if name in TIME_TEXTS:
        return True
    if name == "str" and len(value.args) == 1:
        inner = value.args[0].value
        return isinstance(inner, cst.Call) and resolve(dotted(inner.func), facts.aliases) in CLOCKS or \
            dotted(inner) in clocks
    if isinstance(value.func, cst.Attribute) and value.func.attr.value in TEXTS:
        made = value.func.value
        return dotted(made) in clocks or isinstance(made, cst.Call) and \
            resolve(dotted(made.func), facts.aliases) in CLOCKS
    return False


def _top(facts: Any, stmt: Any) -> bool:
    """The statement runs once on every rank: at the module's top level (in ``if`` blocks alone) or in its main
    block, in no loop."""
    if in_main_block(facts.module, stmt):
        return not m.findall(facts.module, m.For() | m.While()) or not any(
            any(s is stmt for s in m.findall(loop, m.SimpleStatementLine()))
            for loop in m.findall(facts.module, m.For() | m.While()))
    for top in facts.module.body:
        if top is stmt or isinstance(top, cst.If) and any(s is stmt for s in m.findall(top, m.SimpleStatementLine())):
            return not any(any(s is stmt for s in m.findall(loop, m.SimpleStatementLine()))
                           for loop in m.findall(top, m.For() | m.While()))
    return False


def _main_block(facts: Any) -> bool:
    """The script has an ``if __name__ == "__main__":`` block."""
    return any(isinstance(top, cst.If) and "__main__" in facts.code(top.test) for top in facts.module.body)
