"""The batch size of a converted training loader: ``DataLoader(ds, batch_size=B)`` becomes
``ddpkit.data_loader(ds, global_batch_size=B)``, so the script at N processes trains what it trained at one (each
process takes B/N; N must divide B, which ``data_loader`` says in one line when it does not). Kept per process
(``batch_size=B``, a global batch of B x N) with ``ddpkit convert --per-process-batch``, and said either way.

Where the script reads the batch size inside its training loop (``model.init_hidden(batch_size)``, ``x.view(
args.batch_size, -1)``), a share of B/N would not fit what it sizes: the batch stays per process there and the
line is listed, also when it gets there under another name (``bsz = args.batch_size``, a function's parameter).
A literal batch size of 1 stays per process too (a global batch of 1 cannot be shared), said as kept. A batch
size hidden in ``**kwargs`` cannot be rewritten: the global batch it gives is said.

Example (the rewrite of a converted call's batch size)::

    >>> code = cst.Module(body=[]).code_for_node
    >>> code(_rename(cst.parse_expression("ddpkit.data_loader(ds, 64, shuffle=True)")))
    'ddpkit.data_loader(ds, global_batch_size=64, shuffle=True)'
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow, handsize
from ddpkit.commands.convert.batchmeans import stepped_losses
from ddpkit.commands.convert.batchreads import forward_literal, forward_read, quiet_nodes, reads_in_training
from ddpkit.commands.convert.flow import DEPTH, argument_for, binding_of, callee
from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, heads, names_in
from ddpkit.commands.convert.origins import imported_from
from ddpkit.commands.convert.scan import Call, Loop

# the plan in the making (plan._Work): facts, edits, note, leave, keep, per_process_batch
_Work = Any
_NO_SPACE = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def global_batch(work: _Work, call: Call, loops: list[Loop]
                 ) -> tuple[Callable[[cst.Call], cst.Call] | None, frozenset[str]]:
    """For the training loader ``call`` (read by ``loops``): the rewrite of its batch size to ``global_batch_size=``
    (applied to the converted call) and the names the global batch goes by (``len(loader) * batch_size`` is then
    every sample); ``(None, ∅)`` where it stays per process (said or listed)."""
    args = call.node.args
    positional = [a for a in args if a.keyword is None and not a.star]
    given: Any = next((a for a in args if a.keyword is not None and a.keyword.value == "batch_size"), None) or \
        (positional[1] if len(positional) > 1 else None)
    code = work.facts.code
    spread = _spread(work, call) if given is None else None  # ``DataLoader(ds, **train_params)``
    given = spread[1] if spread is not None else given
    if given is None or isinstance(given.value, cst.Name) and given.value.value == "None":
        if any(a.star == "**" for a in args):
            work.keep(call.line, "the batch size in the ** arguments stays per process", "convert cannot "
                      "rewrite it there: the global batch is that size x the number of processes (write "
                      "global_batch_size= to keep it at any number)")
        return None, frozenset()
    size = code(given.value)
    if work.per_process_batch:
        work.note(f"batch_size={size} kept per process (--per-process-batch)", f"the global batch is {size} x "
                  "the number of processes", call.line)
        return None, frozenset()
    if isinstance(given.value, cst.Integer) and int(given.value.evaluated_value) < 2:
        work.keep(call.line, f"batch_size={size} kept per process", f"a global batch of {size} cannot be shared by "
                  f"2 or more processes: the global batch is {size} x the number of processes")
        return None, frozenset()
    odd = _literal(work, given.value)
    if odd is not None and odd % 2:  # (set 28's ``batch_size = 5``: ``data_loader`` would stop at 2 processes)
        work.keep(call.line, f"batch_size={size} kept per process", f"a global batch of {odd} splits evenly over no "
                  f"even number of processes (N must divide {odd}): the global batch is {odd} x the number of "
                  "processes; an even batch_size keeps it global")
        return None, frozenset()
    names = _names(work, call, given.value) | ({code(given.value)} if isinstance(given.value, cst.Subscript) else set())
    every = reads_in_training(work, names, loops, call)
    read = every[0] if every else None
    forward = (forward_read(work, names) or forward_literal(work, given.value, call)) if read is None else None
    read = read or forward
    built = _built_with(work, names) if read is None else None
    params = [p for p in call.scope.params if p not in ("self", "cls")]
    elsewhere = handsize.read_elsewhere(work.crossing.wants, call.scope.name, params, names) \
        if read is None and built is None else None
    if read is not None or built is not None or elsewhere is not None:
        why = f"the model reads {forward[0]} at line {forward[1]}" if forward is not None else \
            f"the training loop reads {read[0]} at line {read[1]}" + _also(every[1:]) if read is not None else \
            f"the model is built with it at line {built[1]} ({built[0]})" if built is not None else str(elsewhere)
        work.done.extend(handsize.answered(work.crossing.wants, call.scope.name, params, names))
        work.per_process.add(id(call.node))  # (its loops' sums of batch means then add, not average: reductions)
        work.leave(call.line, f"batch_size={size} kept per process (a global batch of {size} x N): {why}, sized "
                   f"for a batch of {size}, and each process would "
                   f"take {size}/N", "size it from the batch itself (x.size(0)), then convert again; or pass "
                   "--per-process-batch to keep the per-process batch (and scale the learning rate yourself)")
        return None, frozenset()
    shown = f"batch_size={size} -> global_batch_size={size}"
    if spread is not None:  # the key of the dict the loader alone spreads: ``'global_batch_size': 16``
        quote = spread[0].quote
        work.edits.expr[id(spread[0])] = lambda node: cst.SimpleString(f"{quote}global_batch_size{quote}")
        shown = f"'batch_size': {size} -> 'global_batch_size': {size} (in {spread[2]}, spread into the loader)"
    work.note(shown, f"the global batch stays {size} at any number of "
              f"processes, each taking {size} / N (N, the number of processes, must divide {size}); "
              f"--per-process-batch keeps {size} per process", call.line)
    _attribute_reads(work, call, given.value, loops)
    _shown_rates(work, names, loops)
    return (_rename if spread is None else None), frozenset(names)


def _literal(work: _Work, size: cst.BaseExpression) -> int | None:
    """The whole number a batch size is: written (``batch_size=5``) or a name every binding of which writes it
    (``batch_size = 5`` above); None otherwise (a setting, a computation).

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> class W:
    ...     facts = scan(parse("b = 5\\nc = int(x)\\n"))
    >>> _literal(W, cst.Name("b")), _literal(W, cst.Name("c")), _literal(W, cst.Integer("7"))
    (5, None, 7)
    """
    if isinstance(size, cst.Integer):
        return int(size.evaluated_value)
    origin = imported_from(work.facts, dotted(size) or "") if getattr(work, "crossing", None) else None
    if origin is not None:  # (a settings module's ``batch_size = 1``, imported: :mod:`.constants`)
        return work.crossing.odd.get(".".join(origin))
    bound = [b.value for b in work.facts.bindings if isinstance(size, cst.Name) and b.target == size.value]
    values = {int(v.evaluated_value) if isinstance(v, cst.Integer) else None for v in bound}
    return values.pop() if len(values) == 1 and bound else None


def _also(more: list[tuple[str, int]]) -> str:
    """The other reads, so that one round of fixes meets them all: `` (also real_labels at line 70, ...)``."""
    return f" (also {', '.join(f'{name} at line {line}' for name, line in more[:6])})" if more else ""


def _built_with(work: _Work, names: set[str]) -> tuple[str, int] | None:
    """The model is built with the batch size (HAN's ``HierAttNet(..., opt.batch_size, ...)`` sizes its recurrent
    state for that batch): the constructor's call and its line."""
    for model in work.models:
        made = model.value
        while isinstance(made, cst.Call) and isinstance(made.func, cst.Attribute) and \
                made.func.attr.value in ("to", "cuda", "cpu"):  # (``Net(batch_size).to(device)``)
            made = made.func.value
        # the constructor's own argument, the batch size as it is (not ``hidden=batch_size * 2``, nor a layer's)
        if isinstance(made, cst.Call) and (any(dotted(a.value) in names for a in made.args) or
                                           _read_in_init(work, made, names)):
            return f"{work.facts.code(made.func)}(...)", model.line
    return None


def _read_in_init(work: _Work, made: cst.Call, names: set[str]) -> bool:
    """``Net(opt)`` of a class of this file whose ``__init__`` reads the batch size off what it is handed
    (``torch.zeros(1, options.batch_size, width)``, for the ``opt.batch_size`` of the loader)."""
    init = work.facts.scopes.get(f"{dotted(made.func)}.__init__")
    params = init.params[1:] if init is not None else []
    for i, arg in enumerate(made.args):
        held = dotted(arg.value)
        param = arg.keyword.value if arg.keyword is not None else params[i] if i < len(params) else None
        wanted = {param + n[len(held):] for n in names if held and param and n.startswith(held + ".")}
        if any(read in wanted and scope is init for read, scope, _line, _node in work.facts.reads):
            return True
        if init is not None and param and held and _keyed(work, held, names) & _subscripted(init.node, param):
            return True  # ``Enc(config)`` of ``config = {"batch_size": BATCH}``, read as ``cfg["batch_size"]`` (set 29)
    return False


def _keyed(work: _Work, held: str, names: set[str]) -> set[str]:
    """The keys of the dict literal ``held`` is bound to whose values are the batch size's names."""
    keys = {key.evaluated_value for b in work.facts.bindings if b.target == held and isinstance(b.value, cst.Dict)
            for e in b.value.elements if isinstance(e, cst.DictElement) and dotted(e.value) in names
            and isinstance(key := e.key, cst.SimpleString) and isinstance(key.evaluated_value, str)}
    # (``dict(batch_size=B)``; the loader reading the dict itself, ``batch_size=config["batch_size"]``: review 45)
    keys |= {a.keyword.value for b in work.facts.bindings if b.target == held and isinstance(b.value, cst.Call) and
             dotted(b.value.func) == "dict" for a in b.value.args if a.keyword is not None and dotted(a.value) in names}
    keys |= {match.group(2) for n in names if (match := re.fullmatch(rf"{re.escape(held)}\[(['\"])(\w+)\1\]", n))}
    return keys


def _subscripted(node: cst.CSTNode, param: str) -> set[str]:
    """The string keys ``node`` reads off ``param`` (``cfg["batch_size"]``, ``cfg.get("batch_size")``)."""
    found: set[str] = set()
    for sub in m.findall(node, m.Subscript(value=m.Name(param))):
        assert isinstance(sub, cst.Subscript)
        index = sub.slice[0].slice if len(sub.slice) == 1 else None
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            found.add(str(index.value.evaluated_value))
    for call in m.findall(node, m.Call(func=m.Attribute(value=m.Name(param), attr=m.Name("get")))):
        assert isinstance(call, cst.Call)
        if call.args and isinstance(call.args[0].value, cst.SimpleString):
            found.add(str(call.args[0].value.evaluated_value))
    return found


def _spread(work: _Work, call: Call) -> tuple[cst.SimpleString, cst.DictElement, str] | None:
    """``DataLoader(training_set, **train_params)`` of a ``train_params = {'batch_size': 16, ...}`` that nothing
    else reads (the Hugging Face tutorials'): (the ``'batch_size'`` key, its element, the dict's name)."""
    spread = [a for a in call.node.args if a.star == "**"]
    name = dotted(spread[0].value) if len(spread) == 1 else None
    bound = binding_of(work.facts, name, call.scope, call.line) if name else None
    if name is None or bound is None or not isinstance(bound.value, cst.Dict) or bound.index >= 0:
        return None
    reads = [r for r, where, _line, node in work.facts.reads if r.split(".")[0] == name and
             flow.visible(work.facts, name, bound.scope, where) and not _updated_apart(work, node)]
    found = [e for e in bound.value.elements if isinstance(e, cst.DictElement) and
             isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == "batch_size"]
    if len(reads) != 1 or len(found) != 1 or any(b.target == name and b is not bound for b in work.facts.bindings):
        return None
    key = found[0].key
    assert isinstance(key, cst.SimpleString)
    return key, found[0], str(name)


def in_order(work: _Work, call: Call) -> bool:
    """``DataLoader(ds, **train_kwargs)`` of a ``train_kwargs = {...}`` written out with no ``'shuffle'`` (nor
    ``'sampler'``), which torch's loader read as no shuffle: ``'shuffle': False`` added to the dict, so that
    ``ddpkit.data_loader`` keeps the order (pytorch/examples' MNIST shuffles on CUDA only, by an update; set 29's
    extra five saw the CPU run reshuffled). True where added."""
    spread = [a for a in call.node.args if a.star == "**"]
    name = dotted(spread[0].value) if len(spread) == 1 else None
    bound = binding_of(work.facts, name, call.scope, call.line) if name else None
    if bound is None or not isinstance(bound.value, cst.Dict) or bound.index >= 0 or \
            any(b.target == name and b is not bound for b in work.facts.bindings) or any(
                not isinstance(e, cst.DictElement) or not isinstance(e.key, cst.SimpleString) or
                e.key.evaluated_value in ("shuffle", "sampler", "batch_sampler") for e in bound.value.elements):
        return False
    if m.findall(work.facts.module, m.AssignTarget(target=m.Subscript(value=m.Name(str(name))))):
        return False  # (``train_kwargs['shuffle'] = True`` below: its own say)
    element = cst.DictElement(cst.SimpleString("'shuffle'"), cst.Name("False"))
    work.edits.expr[id(bound.value)] = lambda node: node.with_changes(elements=[*node.elements, element])
    return True


def _updated_apart(work: _Work, node: cst.CSTNode) -> bool:
    """``train_kwargs.update({'num_workers': 1})`` (pytorch/examples' MNIST: ``train_kwargs.update(cuda_kwargs)``):
    an update with a dict written out, or named, that holds no ``'batch_size'``: the batch size stays the one the
    loader spreads (set 29)."""
    call = next((c.node for c in work.facts.calls if c.last == "update" and c.node.func is node or
                 isinstance(c.node.func, cst.Attribute) and c.node.func.value is node and c.last == "update"), None)
    if call is None or len(call.args) != 1 or call.args[0].star:
        return False
    value = call.args[0].value
    bound = [b.value for b in work.facts.bindings if isinstance(value, cst.Name) and b.target == value.value]
    given = value if isinstance(value, cst.Dict) else bound[0] if len(bound) == 1 else None
    if isinstance(value, cst.Name) and _filled(work, value.value):
        return False  # (``cuda_kwargs['batch_size'] = 16`` after it is written: review 45)
    return isinstance(given, cst.Dict) and all(
        isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString) and
        e.key.evaluated_value != "batch_size" for e in given.elements)


def _filled(work: _Work, name: str) -> bool:
    """The dict ``name`` gets keys after it is written: ``name[k] = v``, ``name.update(...)``, ``setdefault``."""
    items = m.findall(work.facts.module, m.AssignTarget(target=m.Subscript(value=m.Name(name))))
    return bool(items) or any(c.last in ("update", "setdefault", "__setitem__") and
                              isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == name
                              for c in work.facts.calls)


def _shown_rates(work: _Work, names: set[str], loops: list[Loop]) -> None:
    """A rate the training loop shows over the batch size's name (pointnet's ``correct.item() /
    float(opt.batchSize)`` accuracy, printed every step): each process's batch is now B/N, so the rate shown is 1/N
    of the one-process value. Listed, with the fix (the batch's own size)."""
    quiet = quiet_nodes(work, loops)
    for loop in loops:
        if not flow.trains(work.facts, loop):
            continue
        # a per-batch quantity the loop computes (``correct``), over B: not a count of steps (``n_train // B``)
        computed = {b.target for b in work.facts.bindings if id(b.stmt) in node_ids(loop.node.body)}
        # (a sum of the stepped loss's batch means, ``training_loss += loss.item()``: a mean already, whatever share
        # of the batch each rank takes; over B it is no count's rate: a course's ``(training_loss / n) / B``)
        losses = stepped_losses(loop)
        means = {b.target for b in work.facts.bindings if id(b.stmt) in node_ids(loop.node.body) and
                 b.value is not None and heads(b.value) & losses}
        for div in m.findall(loop.node.body, m.BinaryOperation(operator=m.Divide())):
            inside = node_ids(div.right) if isinstance(div, cst.BinaryOperation) else set()
            read = next(((name, line) for name, _scope, line, node in work.facts.reads
                         if name in names and id(node) in inside), None)
            per_batch = isinstance(div, cst.BinaryOperation) and bool(names_in(div.left) & computed) and \
                not names_in(div.left) & means
            if id(div) in quiet and read is not None and per_batch:
                work.leave(read[1], f"a rate shown over {read[0]}, the global batch now: each process's batch is "
                           f"{read[0]}/N, so what is shown is 1/N of the one-process value", "divide by the "
                           "batch's own size (target.size(0)) instead")
                return


def _attribute_reads(work: _Work, call: Call, size: cst.BaseExpression, loops: list[Loop]) -> None:
    """``loader.batch_size`` shown where the loader is looped over (a progress line's ``(len(loader.dataset) - 1)
    // loader.batch_size + 1`` steps, ``[(i + 1) * loader.batch_size / N]``): after ``global_batch_size=`` that
    attribute is each process's share, so the count shown would be N times off. In a print, a log call or a
    formatted string it becomes the global batch's own expression. Anywhere else it stays this rank's share, as the
    batch is (``model.init_hidden(loader.batch_size)``, ``torch.ones(loader.batch_size, 1)`` labels, ``if x.size(0)
    != loader.batch_size``); so does a statement that counts ``len(loader) * loader.batch_size`` (this rank's samples,
    beside which a global count would not add up), a loader rebound to another DataLoader, and a training loader an
    evaluation also loops over (its sums and counts are every rank's). Listed where the expression means something
    else there (a local of that name)."""
    facts = work.facts
    if any(not flow.trains(facts, loop) for loop in loops):
        return
    quiet = quiet_nodes(work, loops)
    products = [p for p in m.findall(facts.module, m.BinaryOperation(operator=m.Multiply()))
                if isinstance(p, cst.BinaryOperation) and (_is_len(p.left) or _is_len(p.right))]
    for name, scope, line, node in facts.reads:
        loader = name[:-len(".batch_size")] if name.endswith(".batch_size") else None
        if loader is None or id(node) in work.edits.expr or id(node) not in quiet or \
                not any(loader in loop.iter_names and loop.scope is scope for loop in loops):
            continue
        stmt = next((st for st, _scope, _line in facts.statements if id(node) in node_ids(st)), None)
        if stmt is not None and any(id(p) in node_ids(stmt) for p in products):
            continue  # ``len(loader) * loader.batch_size`` beside it: this rank's count, kept alike
        bound = flow.binding_of(facts, loader, scope, line)
        if bound is not None and isinstance(bound.value, cst.Call) and bound.value is not call.node and \
                (dotted(bound.value.func) or "").rsplit(".", 1)[-1] in ("DataLoader", "data_loader"):
            continue  # rebound to another loader (``train_loader = DataLoader(ds, 16)`` for predictions)
        _global_read(work, call, size, name, scope, line, node)


def _global_read(work: _Work, call: Call, size: cst.BaseExpression, name: str, scope: Any, line: int,
                 node: cst.CSTNode) -> None:
    """Rewrite one read of ``loader.batch_size`` to the global batch's expression ``size``, or list it where a name
    of ``size`` means something else there, or where an f-string's quotes would close around it."""
    facts, text = work.facts, work.facts.code(size)
    same = all(flow.binding_of(facts, root, scope, line) is flow.binding_of(facts, root, call.scope, call.line)
               for root in heads(size))
    quotes = [f for f in m.findall(facts.module, m.FormattedString())
              if isinstance(f, cst.FormattedString) and id(node) in node_ids(f)]
    if quotes:  # ``f"...{config["bs"]}"``: before Python 3.12 the expression's ``"`` would close the string
        quote = quotes[0].start[-1]
        other = "'" if quote == '"' else '"'
        text = text if quote not in text else text.replace(quote, other) if other not in text else ""
    if not same or not text:
        work.leave(line, f"{name} is each process's share of the batch (global_batch_size={facts.code(size)}): "
                   "what is counted from it is N times off", f"read the global batch there ({facts.code(size)} as "
                   f"it was at line {call.line}), then convert again")
        return
    text = text if isinstance(size, (cst.Name, cst.Attribute, cst.Integer, cst.Subscript)) else f"({text})"
    work.edits.expr[id(node)] = lambda _node, text=text: cst.parse_expression(text)
    work.note(f"{name} -> {text}", "the global batch: after global_batch_size= the loader's batch_size is each "
              "process's share, and what the script counts from it would be N times off", line)


def _is_len(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Call) and dotted(node.func) == "len"


def _rename(node: cst.Call) -> cst.Call:
    """``data_loader(ds, 64, ...)`` / ``data_loader(ds, batch_size=64)`` -> ``data_loader(ds, global_batch_size=64)``
    (the batch size is the second argument, positional or named)."""
    args, position = [], 0
    for arg in node.args:
        positional = arg.keyword is None and not arg.star
        if positional and position == 1 or arg.keyword is not None and arg.keyword.value == "batch_size":
            arg = arg.with_changes(keyword=cst.Name("global_batch_size"),
                                   equal=arg.equal if arg.keyword is not None else _NO_SPACE)
        position += positional
        args.append(arg)
    return node.with_changes(args=args)


def _names(work: _Work, call: Call, size: cst.BaseExpression) -> set[str]:
    """The names the batch size goes by: its own (``batch_size``, ``args.batch_size``), what a parameter is passed
    (``get_loader(args.batch_size)``), and what is bound from any of them or they from (``bsz = args.batch_size``).

    >>> from ddpkit.commands.convert.scan import parse, scan
    >>> facts = scan(parse("def get(bs):\\n    return DataLoader(d, batch_size=bs)\\nl = get(a.n)\\nk = a.n\\n"))
    >>> loader = next(c for c in facts.calls if c.last == "DataLoader")
    >>> sorted(_names(type("W", (), {"facts": facts})(), loader, loader.node.args[1].value))
    ['a.n', 'bs', 'k']
    """
    read = names_in(size)  # (with its prefixes: ``self.args`` of self.args.batch_size is no name of the batch)
    names = {n for n in read if ("." in n or n == (size.value if isinstance(size, cst.Name) else "")) and
             not any(other.startswith(n + ".") for other in read)}
    facts = work.facts
    live = {id(call.scope)}  # the functions whose names these are: the loader's, and its callers that pass them
    for _round in range(DEPTH):
        more = set(names)
        for site in facts.calls:  # a parameter: what the calls of its function pass
            target = callee(facts, site)
            if target is not None and target[0] is call.scope:
                passed = [argument_for(site, n, call.scope, target[1]) for n in names if n in call.scope.params]
                more |= {name for arg in passed if (name := dotted(arg)) is not None}
                if passed:
                    live.add(id(site.scope))
        for b in facts.bindings:  # ``bsz = args.batch_size`` (either way round)
            value = dotted(b.value) if b.value is not None else None
            # (a name bound again in another function is that function's own: a model's ``generate`` with its local
            # ``batch_size = None``, set 26, made ``None`` a name of the batch size)
            elsewhere = id(b.scope) not in live and b.scope.name != "" and "." not in b.target
            if value in names or b.target in names and value is not None and not elsewhere:
                more |= {b.target, value} if value else {b.target}
        if more == names:
            break
        names = more
    return names
