"""Whether a read of a file runs before a write that rank 0 alone makes, so that no barrier is owed between them:
``main()`` reads ``--resume`` once and then calls ``train()``, which saves every epoch; a trainer's ``__init__``
loads a checkpoint before its ``train()`` method saves one (each called once). A path's text tells nothing: a save
to ``p + '.tmp'`` renamed to ``p``, numpy's ``np.save('w')`` that writes ``w.npy``.

Example (``main()`` reads, then calls ``train()``, which saves)::

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("def train():\\n    torch.save(m, 'c.pt')\\ndef main():\\n    torch.load('c.pt')\\n"
    ...                    "    train()\\nmain()\\n"))
    >>> load, save = (next(c for c in facts.calls if c.name == n) for n in ("torch.load", "torch.save"))
    >>> read_first(facts, load, save)
    True
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.flow import argument_for, callee, callers
from ddpkit.commands.convert.names import dotted
from ddpkit.commands.convert.scan import Facts, Scope

__all__ = ["read_first"]


def apart_functions(facts: Facts, write: Scope, read: Scope) -> bool:
    """Two functions of this file, and none of its functions (nor its module lines) runs both, itself or through
    the functions it calls: a save_x / load_x pair whose order only their callers elsewhere decide (SCINet's
    utils/tools.py ``save_model`` and ``load_model``, BERT-pytorch's ``save_vocab`` and ``load_vocab``)."""
    return bool(write.name) and bool(read.name) and write is not read and \
        not _runners(facts, write) & _runners(facts, read)


def runner_names(facts: Facts, scope: Scope) -> set[str]:
    """The names another file would write to run ``scope``: its own and its runners' (:func:`_runners`), a class's
    for its ``__init__`` (``Solver(...)`` runs ``Solver.__init__``)."""
    found = set()
    for name in _runners(facts, scope):
        head, _, last = name.rpartition(".")
        found.add(head.rsplit(".", 1)[-1] if last == "__init__" and head else last)
    return found - {""}


def _runners(facts: Facts, scope: Scope, depth: int = 0) -> set[str]:
    """``scope`` and every function of this file that runs it, directly or through others (``""``: the module's
    own lines), a call of its name the file cannot follow (an inherited method, ``vocab.save_vocab``) too."""
    name = scope.name.rsplit(".", 1)[-1]
    found = {scope.name}
    direct = {id(c.node) for c in callers(facts, scope)}
    named = [c for c in facts.calls if c.last == name and id(c.node) not in direct]  # (``vocab.save_vocab``)
    for call in [*callers(facts, scope), *named]:
        if call.scope.name in found:
            continue
        found |= _runners(facts, call.scope, depth + 1) if depth < 6 and call.scope.name else {call.scope.name}
    return found


def read_first(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` runs before ``write`` in every run, or never in the run that writes (two commands of one script)."""
    return read.scope is not write.scope and \
        (_runs_before(facts, read, write.scope) or _constructs(facts, read, write) or _apart(facts, read, write)) \
        or _contradict(facts, read, write) or _never_given(facts, read) or _called_apart(facts, read, write)


def _called_apart(facts: Facts, read: Any, write: Any) -> bool:
    """The read's function is run only from the other side of an ``if`` / ``elif`` than the write, in no loop:
    ``elif args.mode == 'eval': net = load_trained(net, path)`` beside the training branch that saves (set 27's
    CIFAR classifier)."""
    entry = _entry(facts, read.scope)
    sites = _sites(facts, entry) if entry.name and entry is not write.scope else []
    return bool(sites) and all(not site.loops and site.scope is write.scope and _exclusive(facts, site, write)
                               for site in sites) and called_once_or_top(facts, write.scope)


def _never_given(facts: Facts, read: Any) -> bool:
    """The read sits under ``if path is not None:`` (``!= None``, ``if path:``) of a parameter whose default is None
    and that no call of its function in this file passes (AGCRN's ``Trainer.test(..., path=None)``, which loads a
    checkpoint only when a test-only run asks): the read never runs in this file's runs."""
    node = read.scope.node
    if not isinstance(node, cst.FunctionDef) or not read.tests:
        return False
    params = [*node.params.params, *node.params.kwonly_params]
    defaults = {p.name.value for p in params if isinstance(p.default, cst.Name) and p.default.value == "None"}
    sites = callers(facts, read.scope)
    skip = 1 if read.scope.cls and read.scope.params[:1] in (["self"], ["cls"]) else 0
    starred = any(a.star for c in sites for a in c.node.args)  # (``test(**cfg)``: it may pass anything)
    for test in _body_tests(read, node):
        name = _none_tested(test)
        rebound = any(b.target == name and b.scope is read.scope and b.stmt is not None and b.line < read.line
                      for b in facts.bindings)  # (``path = path or 'best.pt'``: no longer the parameter)
        if name in defaults and sites and not starred and not rebound and \
                all(_left_none(argument_for(c, name, read.scope, skip)) for c in sites):
            return True
    return False


def _body_tests(read: Any, function: cst.FunctionDef) -> list[str]:
    """The tests of the ``if`` statements whose body (not their ``else``) holds the read."""
    found = []
    for node in m.findall(function, m.If()):
        assert isinstance(node, cst.If)
        if read.stmt is not None and any(s is read.stmt for s in m.findall(node.body, m.SimpleStatementLine())):
            found.append(cst.Module(body=[]).code_for_node(node.test))
    return found


def _none_tested(test: str) -> str | None:
    """``path`` of ``path is not None``, ``path != None``, ``path``."""
    try:
        node = cst.parse_expression(test)
    except cst.ParserSyntaxError:
        return None
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Comparison) and isinstance(node.left, cst.Name) and len(node.comparisons) == 1:
        c = node.comparisons[0]
        none = isinstance(c.comparator, cst.Name) and c.comparator.value == "None"
        return node.left.value if none and isinstance(c.operator, (cst.IsNot, cst.NotEqual)) else None
    return None


def _left_none(value: Any) -> bool:
    return value is None or isinstance(value, cst.Name) and value.value == "None"


def _contradict(facts: Facts, read: Any, write: Any) -> bool:
    """The read and the write sit under tests that cannot both hold in one run: the two sides of one ``if`` /
    ``else``, or ``if args.resume:`` against ``if args.dump and not args.resume:`` (loss-landscape's resume and
    its dump), in one function."""
    # (in a loop around both, or a function run twice, both sides run in one run, one after the other; a loop
    # inside one side, the epochs under ``if mode == 'train':``, does not: the UNet lesson's test-mode load)
    common = [lp for lp in read.loops if any(lp is other for other in write.loops)]
    if read.scope is not write.scope or read.stmt is None or write.stmt is None or common or \
            not called_once_or_top(facts, read.scope):
        return False
    if _exclusive(facts, read, write):
        return True
    mine, theirs = _literals(facts, read.stmt), _literals(facts, write.stmt)
    first = min(read.line, write.line)
    return any((code, not sign) in theirs and _fixed(facts, code, first) for code, sign in mine)


def _fixed(facts: Facts, code: str, since: int = 0) -> bool:
    """A test term that nothing changes between two ifs: a plain name or attribute (``args.resume``), never
    rebound with a value (its parse), not a call (``os.path.exists(p)``: the save itself may change it)."""
    try:
        node = cst.parse_expression(code)
    except cst.ParserSyntaxError:
        return False
    if dotted(node) is None:
        return False
    # (an attribute set anywhere, ``args.evaluate = True`` after the epochs, is changed between two ifs: review)
    # (set once above both, ``args.evaluate = args.evaluate or args.test_only``, it is fixed by then: review 26)
    return sum(1 for b in facts.bindings if b.target == code and ("." not in code or b.line >= since)) <= \
        (0 if "." in code else 1) and \
        not any(b.target == code.split(".")[0] and b.scope.name for b in facts.bindings if "." in code)


def _literals(facts: Facts, stmt: cst.CSTNode) -> set[tuple[str, bool]]:
    """What must hold for ``stmt`` to run, as (code, true or false): each ``and`` term of the test of an ``if`` whose
    body holds it (``not x``: (x, False)); the test of an ``if`` whose ``else`` holds it, negated, when it is one
    term."""
    found: set[tuple[str, bool]] = set()
    for node in m.findall(facts.module, m.If()):
        if not isinstance(node, cst.If):
            continue
        if _holds(node.body, stmt):
            terms = _terms(node.test)
            found |= {_signed(facts, t) for t in terms}
        elif node.orelse is not None and _holds(node.orelse, stmt) and len(_terms(node.test)) == 1:
            code, sign = _signed(facts, node.test)
            found.add((code, not sign))
    return found


def _terms(test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The ``and`` terms of a test (``a and not b``: ``a``, ``not b``)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _terms(test.left) + _terms(test.right)
    return [test]


def _signed(facts: Facts, term: cst.BaseExpression) -> tuple[str, bool]:
    """(the code of a term, whether it holds) with its ``not`` taken off: ``not args.resume``: (args.resume, False)."""
    if isinstance(term, cst.UnaryOperation) and isinstance(term.operator, cst.Not):
        code, sign = _signed(facts, term.expression)
        return code, not sign
    return facts.code(term), True


def _apart(facts: Facts, read: Any, write: Any) -> bool:
    """The read and the write are in two commands of the script, one of which a run runs: ``if FLAGS.generate:
    generate() else: train()`` (pytorch-gan-collections), or ``fire.Fire()`` exposing ``train`` and ``test``
    (pytorch-book), each reached from its own function."""
    reading, writing = _entry(facts, read.scope), _entry(facts, write.scope)
    if reading is writing or not reading.name or not writing.name:
        return False
    read_sites, write_sites = _sites(facts, reading), _sites(facts, writing)
    if not read_sites and not write_sites:  # ``fire.Fire()``: every function of the module is a command
        return any(c.name == "fire.Fire" and not c.node.args for c in facts.calls)
    # (each dispatched once: an if / else in a loop runs both sides in one run, one after the other)
    return len(read_sites) == 1 and len(write_sites) == 1 and not read_sites[0].loops and \
        not write_sites[0].loops and called_once_or_top(facts, read_sites[0].scope) and \
        _exclusive(facts, read_sites[0], write_sites[0])


def called_once_or_top(facts: Facts, scope: Scope) -> bool:
    """The dispatching function runs once a run: the module itself, a function called once in no loop, or one
    handed to a runner at the module's level (absl's ``app.run(main)``, ``fire.Fire(main)``)."""
    if not scope.name or _called_once(facts, scope):
        return True
    return not _sites(facts, scope) and any(
        not c.scope.name and not c.loops and any(dotted(a.value) == scope.name for a in c.node.args)
        for c in facts.calls)


def _entry(facts: Facts, scope: Scope) -> Scope:
    """The function a run enters ``scope`` from: the callers of ``scope``, followed up while each is the one
    function that calls it, from no ``if`` (four deep at most): a dispatching ``if`` stops the walk below it."""
    for _ in range(4):
        sites = _sites(facts, scope)
        if len({id(c.scope) for c in sites}) != 1 or not sites[0].scope.name or any(c.tests for c in sites):
            break
        scope = sites[0].scope
    return scope


def _sites(facts: Facts, scope: Scope) -> list[Any]:
    return callers(facts, scope)


def _exclusive(facts: Facts, one: Any, other: Any) -> bool:
    """Two calls in the two sides of one ``if`` / ``else`` (or two branches of one ``if`` / ``elif`` chain)."""
    if one.scope is not other.scope or one.stmt is None or other.stmt is None:
        return False
    for node in m.findall(facts.module, m.If()):
        if not isinstance(node, cst.If) or node.orelse is None:
            continue
        body, rest = _holds(node.body, one.stmt), _holds(node.orelse, other.stmt)
        if body and rest or _holds(node.body, other.stmt) and _holds(node.orelse, one.stmt):
            return True
    return False


def _holds(node: cst.CSTNode, stmt: cst.CSTNode) -> bool:
    return any(found is stmt for found in m.findall(node, m.SimpleStatementLine()))


def _runs_before(facts: Facts, read: Any, target: Scope, depth: int = 0) -> bool:
    """``read``, in no loop of a function called in no loop (or of the module), is above every call of that
    function that leads to ``target`` (the writing function), and there is one such call; or, in a function that
    leads to no such call, its one call site is (a trainer's ``load_checkpoint``, called at the top of ``train()``
    under ``if resume:``, before the epochs that call ``save_checkpoint``)."""
    scope = read.scope  # (the module's own code runs once: capsnet's ``if args.weights: model.load_state_dict(
    # torch.load(args.weights))`` in its ``__main__`` block, then ``train(...)``, which saves)
    if read.loops or scope.name and not _called_once(facts, scope):
        return False
    leading = [c.line for c in facts.calls if c.scope is scope and _reaches(facts, c, target)]
    if leading or not scope.name or depth >= 3 or scope is target:
        return bool(leading) and min(leading) > read.line
    return _runs_before(facts, callers(facts, scope)[0], target, depth + 1)


def _constructs(facts: Facts, read: Any, write: Any) -> bool:
    """``read`` in a class's ``__init__`` (built in no loop, or built by another module), or in a method only that
    ``__init__`` calls (FactorVAE's ``load_checkpoint``, at start-up), ``write`` in another method of that class: an
    object is made before its methods run."""
    scope = read.scope
    sites = callers(facts, scope)
    if not scope.name.endswith(".__init__") and sites and all(
            c.scope.cls == scope.cls and c.scope.name.endswith(".__init__") and not c.loops for c in sites):
        scope = sites[0].scope  # (``if self.ckpt_load: self.load_checkpoint(...)`` in ``__init__``)
        if write.scope is read.scope:
            return False
    return scope.name.endswith(".__init__") and bool(scope.cls) and write.scope.cls == scope.cls and \
        write.scope is not scope and not read.loops and _called_once(facts, scope)


def _called_once(facts: Facts, scope: Scope) -> bool:
    """One call of the function (one object built), in no loop: a second (``stage(1); stage(2)``, a ``Trainer``
    built again to load what the first saved) would read after the write."""
    sites = callers(facts, scope)
    return len(sites) == 1 and not sites[0].loops


def _reaches(facts: Facts, call: Any, target: Scope) -> bool:
    """The call runs ``target``, itself or through the script's functions it calls (four deep at most)."""
    found = callee(facts, call)
    seen, todo = set(), [found[0]] if found else []
    for _ in range(5):
        if any(s is target for s in todo):
            return True
        seen |= {id(s) for s in todo}
        todo = [f[0] for s in todo for c in facts.calls if c.scope is s
                if (f := callee(facts, c)) is not None and id(f[0]) not in seen]
    return False
