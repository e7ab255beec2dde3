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

from collections.abc import Callable
from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert import flow
from ddpkit.commands.convert.flow import DEPTH, argument_for, binding_of, callee
from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import Call, Loop
from ddpkit.commands.convert.tokens import over_tokens

# the plan in the making (plan._Work): facts, edits, note, leave, keep, per_process_batch
_Work = Any
_NO_SPACE = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))
QUIET = ("print", "ddpkit.print")  # a read of the batch size that sizes nothing
# what only shows or logs a value: a batch size read there sizes nothing (``save_image(..., nrow=int(math.sqrt(
# opt.batch_size)))`` in PyTorch-GAN, a progress line's "%d/%d")
SHOWS = {"save_image", "make_grid", "info", "debug", "warning", "log", "write", "add_scalar", "add_scalars",
         "add_image", "add_images", "set_description", "set_postfix", "format", "savefig", "imshow"}


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
    names = _names(work, call, given.value) | ({code(given.value)} if isinstance(given.value, cst.Subscript) else set())
    read = _read_in_training(work, names, loops, call)
    if read is not None:
        work.leave(call.line, f"batch_size={size} kept per process (a global batch of {size} x N): the training "
                   f"loop reads {read[0]} at line {read[1]}, sized for a batch of {size}, and each process would "
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


def _spread(work: _Work, call: Call) -> tuple[cst.SimpleString, cst.DictElement, str] | None:
    """``DataLoader(training_set, **train_params)`` of a ``train_params = {'batch_size': 16, ...}`` that nothing
    else reads (the Hugging Face tutorials'): (the ``'batch_size'`` key, its element, the dict's name)."""
    spread = [a for a in call.node.args if a.star == "**"]
    name = dotted(spread[0].value) if len(spread) == 1 else None
    bound = binding_of(work.facts, name, call.scope, call.line) if name else None
    if name is None or bound is None or not isinstance(bound.value, cst.Dict) or bound.index >= 0:
        return None
    reads = [r for r, where, _line, _node in work.facts.reads if r.split(".")[0] == name and
             flow.visible(work.facts, name, bound.scope, where)]
    found = [e for e in bound.value.elements if isinstance(e, cst.DictElement) and
             isinstance(e.key, cst.SimpleString) and e.key.evaluated_value == "batch_size"]
    if len(reads) != 1 or len(found) != 1 or any(b.target == name and b is not bound for b in work.facts.bindings):
        return None
    key = found[0].key
    assert isinstance(key, cst.SimpleString)
    return key, found[0], str(name)


def _shown_rates(work: _Work, names: set[str], loops: list[Loop]) -> None:
    """A rate the training loop shows over the batch size's name (pointnet's ``correct.item() /
    float(opt.batchSize)`` accuracy, printed every step): each process's batch is now B/N, so the rate shown is 1/N
    of the one-process value. Listed, with the fix (the batch's own size)."""
    quiet = _quiet(work, loops)
    for loop in loops:
        if not flow.trains(work.facts, loop):
            continue
        # a per-batch quantity the loop computes (``correct``), over B: not a count of steps (``n_train // B``)
        computed = {b.target for b in work.facts.bindings if id(b.stmt) in node_ids(loop.node.body)}
        for div in m.findall(loop.node.body, m.BinaryOperation(operator=m.Divide())):
            inside = node_ids(div.right) if isinstance(div, cst.BinaryOperation) else set()
            read = next(((name, line) for name, _scope, line, node in work.facts.reads
                         if name in names and id(node) in inside), None)
            per_batch = isinstance(div, cst.BinaryOperation) and bool(names_in(div.left) & computed)
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
    quiet = _quiet(work, loops)
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
               for root in {n.split(".")[0] for n in names_in(size)})
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
    for _round in range(DEPTH):
        more = set(names)
        for site in facts.calls:  # a parameter: what the calls of its function pass
            target = callee(facts, site)
            if target is not None and target[0] is call.scope:
                passed = [argument_for(site, n, call.scope, target[1]) for n in names if n in call.scope.params]
                more |= {name for arg in passed if (name := dotted(arg)) is not None}
        for b in facts.bindings:  # ``bsz = args.batch_size`` (either way round)
            value = dotted(b.value) if b.value is not None else None
            if value in names or b.target in names and value is not None:
                more |= {b.target, value} if value else {b.target}
        if more == names:
            break
        names = more
    return names


def _read_in_training(work: _Work, names: set[str], loops: list[Loop], call: Call) -> tuple[str, int] | None:
    """A read of the batch size's names (``batch_size``, ``args.batch_size``, ``bsz``) in a training loop's body or
    the loops around it, outside a print, a progress bar's total and the loader's own call (``call``, built in
    the loop over the splits): what the loop sizes from it."""
    if not names:
        return None
    inside: set[int] = set()
    for loop in loops:
        inside |= node_ids(loop.node.body)
        for around in loop.outer:  # the loops around it, above the training loop (an epoch's init_hidden(B)):
            # what follows the training loop there shows or evaluates (an image grid of sqrt(B) rows)
            inside |= {i for stmt in around.node.body.body if _starts(work, stmt) <= loop.line
                       for i in node_ids(stmt)}
    # (the loader's own call, and a loader built again in the loop, glow's endless ``sample_data`` that rebuilds its
    # DataLoader on StopIteration: converted by this same rule, sized by nothing of the loop)
    rebuilt = [c.node for c in work.facts.calls if c.name == "torch.utils.data.DataLoader" and c.loops]
    quiet = _quiet(work, loops) | node_ids(call.node) | _counting(loops, names) | \
        {i for node in rebuilt for i in node_ids(node)}
    for name, scope, line, node in work.facts.reads:
        if name in names and id(node) in inside and id(node) not in quiet and not _rebound(work, name, scope, line,
                                                                                           loops, names):
            return name, line
    for stmt, _scope, line in work.facts.statements:  # ``torch.ones(config['batch_size'], 1)`` in the loop
        if id(stmt) in inside and not node_ids(stmt) <= quiet and _items(work, stmt) & names and \
                any(id(s) not in quiet and work.facts.code(s) in names for s in m.findall(stmt, m.Subscript())):
            return next(iter(_items(work, stmt) & names)), line
    return _made_before(work, names, loops, inside, quiet)


def _rebound(work: _Work, name: str, scope: Any, line: int, loops: list[Loop], names: set[str]) -> bool:
    """The read at ``line`` sees a binding the training loop made from something else (a DCGAN's ``batch_size =
    x.size(0)`` above ``torch.randn(batch_size, nz)``): the batch's own size, not the loader's."""
    bound = binding_of(work.facts, name, scope, line)
    return bound is not None and bound.scope is scope and bound.line < line and bound.value is not None and \
        any(loop.line < bound.line <= loop.end for loop in loops) and not names_in(bound.value) & names


def _counting(loops: list[Loop], names: set[str]) -> set[int]:
    """The nodes that count steps with the batch size, sizing nothing (DA-RNN's ``idx += batch_size`` and its
    ``losses[epoch * iters + idx / batch_size]``): ``+=`` of it into a counter, and the counter divided by it."""
    found: set[int] = set()
    for loop in loops:
        adds = [n for n in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
                if isinstance(n, cst.AugAssign) and dotted(n.value) in names and dotted(n.target)]
        divisions = [n for n in m.findall(loop.node, m.BinaryOperation(operator=m.Divide() | m.FloorDivide()))
                     if isinstance(n, cst.BinaryOperation) and dotted(n.right) in names]
        for counter in {dotted(n.target) or "" for n in adds}:
            # (only counted and divided back: ``preds[idx:idx + len(x)] = ...`` reads it as a position, review)
            allowed = {id(n.target) for n in adds} | {id(n.left) for n in divisions if dotted(n.left) == counter}
            used = [n for n in m.findall(loop.node, m.Name(value=counter) | m.Attribute()) if dotted(n) == counter]
            if any(id(n) not in allowed for n in used):
                continue
            found |= {i for n in adds if dotted(n.target) == counter for i in node_ids(n.value)}
            found |= {i for n in divisions if dotted(n.left) == counter for i in node_ids(n.right)}
    return found


def _made_before(work: _Work, names: set[str], loops: list[Loop], inside: set[int],
                 quiet: set[int]) -> tuple[str, int] | None:
    """A tensor sized by the batch before the loops and read in them (pytorch-GANs' ``real_gt = torch.ones(
    (config['batch_size'], 1))`` above the epoch loop, its BCE target each step): ``(the target, its line)``.
    ``names`` holds the batch size's code too when it is an item (``config['batch_size']``)."""
    scopes = {id(loop.scope) for loop in loops}
    first = min((loop.line for loop in loops), default=0)
    # (a read under an ``if`` of the loop, ``if i % 100 == 0: fake = netG(fixed_noise)``, shows, not trains)
    shown = quiet | {i for loop in loops for node in m.findall(loop.node.body, m.If()) for i in node_ids(node)}
    read_inside = {name for name, _scope, _line, node in work.facts.reads if id(node) in inside - shown}
    # (``label.resize_(batch_size)`` each step, conditional-GAN's: sized by the batch it holds; not ``x.data.resize_``,
    # which leaves ``x`` as it was: AC-GAN's IndexError)
    read_inside -= {dotted(c.node.func.value) for loop in loops for c in loop.calls
                    if c.last in ("resize_", "resize_as_") and isinstance(c.node.func, cst.Attribute)}
    # (the loop's own variables: jcjohnson's ``x = torch.randn(N, D_in)`` is the data, ``for x, y in loader`` rebinds)
    read_inside -= {t for loop in loops for t in loop.targets}
    for b in work.facts.bindings:
        made = resolve(dotted(b.value.func), work.facts.aliases) if isinstance(b.value, cst.Call) else None
        if id(b.scope) in scopes and b.line < first and b.value is not None and b.target in read_inside and \
                (made or "").startswith("torch.") and (made or "").rsplit(".", 1)[-1] in TENSOR_MAKERS and \
                (names_in(b.value) | _items(work, b.value)) & names:
            return b.target, b.line
    return None


# torch's calls that make a tensor of a given size: a target or a noise batch sized by the batch size (and the
# legacy typed constructors of older scripts, AC-GAN's ``aux_label = torch.LongTensor(opt.batchSize)``)
TENSOR_MAKERS = ("ones", "zeros", "full", "empty", "randn", "rand", "randint", "normal", "tensor", "Tensor",
                 "FloatTensor", "LongTensor", "DoubleTensor", "IntTensor", "ByteTensor", "HalfTensor", "BoolTensor")


def _items(work: _Work, node: cst.CSTNode) -> set[str]:
    """The code of each ``name['key']`` item in ``node``."""
    return {work.facts.code(s) for s in m.findall(node, m.Subscript(value=m.Name() | m.Attribute()))
            if isinstance(s, cst.Subscript)}


def _quiet(work: _Work, loops: list[Loop]) -> set[int]:
    """The nodes that only show a value: a print's or a logger's arguments, an f-string, ``"%d" % ...``, a progress
    bar's ``total=`` (``tqdm(total=len(ds) - len(ds) % batch_size)``: what the bar counts to)."""
    quiet = {i for c in work.facts.calls if c.name in QUIET or c.last in SHOWS for i in node_ids(c.node)}
    quiet |= {i for c in work.facts.calls if c.last in ("tqdm", "trange") for a in c.node.args
              if a.keyword is not None and a.keyword.value in ("total", "desc", "postfix") for i in node_ids(a.value)}
    return quiet | {i for loop in loops for n in m.findall(loop.node, m.FormattedString() | m.BinaryOperation(
        operator=m.Modulo(), left=m.SimpleString())) for i in node_ids(n)}


def _starts(work: _Work, stmt: cst.CSTNode) -> int:
    """The first line of a statement the scan recorded (0: none)."""
    inside = node_ids(stmt)
    return min((line for s, _scope, line in work.facts.statements if id(s) in inside), default=0)


# optimizers whose step is normalised by the gradient's own size: a sum's 1/N scale leaves it as it was (the
# pytorch/examples VAE sums its loss and trains with Adam)
SCALE_FREE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam"}
SUMMED = ("the training loss is a sum over the batch, not a mean: DDP averages the ranks' gradients, so each "
          "rank's sum over B/N samples makes every step 1/N of the original's")


def summed_loss(work: _Work) -> None:
    """A training loss summed over the batch (``loss.sum().backward()``, ``reduction='sum'`` or the old
    ``size_average=False`` in a training loop, a function it calls, or a criterion it calls), stepped by an
    optimizer whose step follows the gradient's scale (SGD; not Adam's kin): listed once, with the fix (converting
    it silently gave steps N times smaller; ``ddpkit verify`` names it)."""
    stepping = {c.last for c in work.facts.calls if c.last in OPTIMIZERS}
    if not work.models or stepping and stepping <= SCALE_FREE:
        return
    backwards = [c for c in work.facts.calls if c.last == "backward"]
    training = {id(c.loops[-1]) for c in backwards if c.loops}  # an evaluation's summed loss is no step's
    # and the functions a training loop calls (the VAE's loss_function(recon, x, mu, logvar))
    helpers = {id((callee(work.facts, c) or (None,))[0]) for c in work.facts.calls
               if any(id(loop) in training for loop in c.loops)}
    for call in work.facts.calls:
        func = call.node.func
        summed_backward = call.last == "backward" and isinstance(func, cst.Attribute) and \
            isinstance(func.value, cst.Call) and isinstance(func.value.func, cst.Attribute) and \
            func.value.func.attr.value == "sum"
        summed_reduction = any(a.keyword is not None and (
            a.keyword.value == "reduction" and isinstance(a.value, cst.SimpleString) and
            a.value.evaluated_value == "sum" or a.keyword.value == "size_average" and
            isinstance(a.value, cst.Name) and a.value.value == "False") for a in call.node.args)
        # (a criterion built before the loop, ``nn.MSELoss(size_average=False)``, called in it: vdsr)
        bound = {b.target for b in work.facts.bindings if b.value is call.node}
        # (its innermost loop trains: an evaluation loop inside the epoch loop, under no_grad, does not)
        trains = not call.no_grad and (call.loops and id(call.loops[-1]) in training or id(call.scope) in helpers
                                       or any(dotted(c.node.func) in bound and c.loops and id(c.loops[-1])
                                              in training and not c.no_grad for c in work.facts.calls))
        if summed_reduction and over_tokens(work, call):  # (divided by the kept tokens: tokens.py lists it)
            continue
        if summed_backward or summed_reduction and trains:
            work.leave(call.line, SUMMED, "average it (reduction='mean', loss.mean()), or keep the sum and multiply "
                       "it by the number of processes (loss.sum() * state.world_size) where it trains")
            return


# lightly's losses that take their negatives (or statistics) from the batch, and gather them across ranks when told
GATHERING = ("NTXentLoss", "DCLLoss", "DCLWLoss", "BarlowTwinsLoss", "VICRegLoss", "TiCoLoss")
# (not a Siamese network's ``ContrastiveLoss``: a margin loss over given pairs, no negatives from the batch)
CONTRASTIVE = ("ntxent", "nt_xent", "infonce", "info_nce", "supcon", "simclr", "barlow", "vicreg")


def contrastive_loss(work: _Work) -> None:
    """A loss whose negatives are the other samples of the batch (SimCLR's NT-Xent): at N processes each rank
    contrasts its share only, another objective. lightly's losses gather the batch across ranks when told
    (``gather_distributed=True``, added); another such loss is listed (lightly's SimCLR example ran on, silently)."""
    if not work.models:
        return
    for call in work.facts.calls:
        keywords = {a.keyword.value for a in call.node.args if a.keyword is not None}
        if (call.name or "").startswith("lightly.loss") and call.last in GATHERING:
            positional = any(a.keyword is None for a in call.node.args)  # (its place differs by class: named)
            if positional and "gather_distributed" not in keywords:
                work.leave(call.line, f"{call.last}: its negatives are this rank's share of the batch at N "
                           "processes", f"pass gather_distributed=True to {call.last}(...) (its arguments by name), "
                           "then convert again")
            elif "gather_distributed" not in keywords:
                work.edits.expr[id(call.node)] = lambda node: node.with_changes(args=[
                    *node.args, cst.Arg(keyword=cst.Name("gather_distributed"), value=cst.Name("True"),
                                        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                              whitespace_after=cst.SimpleWhitespace("")))])
                work.note(f"{call.last}(...) -> {call.last}(..., gather_distributed=True)", "its negatives are "
                          "the whole global batch, as one process's were, not this rank's share", call.line)
            continue
        word = call.last.lower()  # a loss by its name (SupConLoss, info_nce_loss), not SimCLRProjectionHead
        if any(w in word for w in CONTRASTIVE) and "loss" in word or word in ("ntxent", "nt_xent", "infonce"):
            work.leave(call.line, f"{call.last}: a contrastive loss over the batch: at N processes each rank's "
                       "negatives are its share of the batch only, another objective than one process's",
                       "gather the embeddings across ranks before the loss (ddpkit.gather keeps no gradient: use "
                       "torch.distributed.nn.functional.all_gather), or keep it if that is acceptable")
            return


# losses of the whole batch at once (an overlap ratio): not a mean of per-sample terms
WHOLE = ("dice", "iou", "jaccard", "tversky", "lovasz")
METRICS = ("metric", "score", "coef", "acc", "eval")  # a measure logged beside the loss, not what trains


def whole_batch_loss(work: _Work) -> None:
    """A training loss over the whole batch at once (``DiceLoss()``, ``dice_loss(pred, y)``, a Tversky or Lovasz
    loss): at N processes each rank's is over its share, and DDP averages the ranks' gradients, which is not the
    one-process loss of the global batch. Listed once (``ddpkit verify`` FAILs it; converting it said nothing)."""
    if not work.models:
        return
    facts = work.facts
    called = {dotted(c.node.func) for c in facts.calls if any(flow.trains(facts, loop) for loop in c.loops)}
    for c in facts.calls:
        word = c.last.lower()
        if not any(w in word for w in WHOLE) or any(w in word for w in METRICS):
            continue
        bound = [b.target for b in facts.bindings if b.value is c.node]
        if dotted(c.node.func) in called or any(name in called for name in bound):
            work.leave(c.line, f"{c.last}: a loss over the whole batch at once, not a mean over its samples: at N "
                       "processes each rank's is over its share of the batch, and DDP averages the ranks' "
                       "gradients, which is not the one-process loss of the global batch (ddpkit verify FAILs it)",
                       "keep it if that is acceptable (the usual DDP behaviour of such losses), or compute it on "
                       "every rank's predictions and targets gathered with ddpkit.gather(...)")
            return

