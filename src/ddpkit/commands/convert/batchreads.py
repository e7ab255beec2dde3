"""Where a script reads its training loader's batch size in training (``model.init_hidden(batch_size)``,
``x.view(args.batch_size, -1)`` in the loop, ``torch.zeros(batch_size)`` made above it, a model's ``forward``
reshaping by the module's ``batch_size``): sized for B, what a share of B/N would not fit, so :mod:`.batch`
keeps that loader's batch per process. Reads that size nothing are passed over: prints and progress lines, the
loader's own call, a sample counter ``n += batch_size``, a step count ``len(ds) // batch_size``.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nbs = 8\\n"
    ...          "loader = DataLoader(ds, batch_size=bs, shuffle=True)\\nnet = torch.nn.Linear(4, 1)\\n"
    ...          "opt = torch.optim.SGD(net.parameters(), lr=0.1)\\nfor x, y in loader:\\n"
    ...          "    net(x.view(bs, -1)).mean().backward()\\n    opt.step()\\n")
    >>> [x.what[:43] for x in p.left]
    ['batch_size=bs kept per process (a global ba']
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert.batchmeans import batch_size, stepped_losses
from ddpkit.commands.convert.flow import binding_of
from ddpkit.commands.convert.inits import node_ids
from ddpkit.commands.convert.names import dotted, measured, names_in, resolve
from ddpkit.commands.convert.scan import Call, Loop

_Work = Any  # the plan in the making (plan._Work)
QUIET = ("print", "ddpkit.print")  # a read of the batch size that sizes nothing
# what only shows or logs a value: a batch size read there sizes nothing (``save_image(..., nrow=int(math.sqrt(
# opt.batch_size)))`` in PyTorch-GAN, a progress line's "%d/%d")
SHOWS = {"save_image", "make_grid", "info", "debug", "warning", "log", "write", "add_scalar", "add_scalars",
         "add_image", "add_images", "set_description", "set_postfix", "format", "savefig", "imshow"}


def read_in_training(work: _Work, names: set[str], loops: list[Loop], call: Call | None) -> tuple[str, int] | None:
    """The first of :func:`reads_in_training`, or None."""
    found = reads_in_training(work, names, loops, call)
    return found[0] if found else None


def reads_in_training(work: _Work, names: set[str], loops: list[Loop], call: Call | None) -> list[tuple[str, int]]:
    """A read of the batch size's names (``batch_size``, ``args.batch_size``, ``bsz``) in a training loop's body or
    the loops around it, outside a print, a progress bar's total and the loader's own call (``call``, built in
    the loop over the splits; None: a loader another module builds, handsize.py): what the loop sizes from it."""
    if not names:
        return []
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
    quiet = quiet_nodes(work, loops) | (node_ids(call.node) if call is not None else set()) | \
        _counting(loops, names) | _step_counts(work, loops, names) | {i for node in rebuilt for i in node_ids(node)} | \
        _aside(work, loops)
    found = [(name, line) for name, scope, line, node in work.facts.reads if name in names and id(node) in inside
             and id(node) not in quiet and not _rebound(work, name, scope, line, loops, names)]
    for stmt, _scope, line in work.facts.statements:  # ``torch.ones(config['batch_size'], 1)`` in the loop
        if id(stmt) in inside and not node_ids(stmt) <= quiet and items_of(work, stmt) & names and \
                any(id(s) not in quiet and work.facts.code(s) in names for s in m.findall(stmt, m.Subscript())):
            found.append((next(iter(items_of(work, stmt) & names)), line))
    # (every read, in the order of the file: set 27's GAN lesson named one a round, three rounds for one cause)
    return list(dict.fromkeys(found + _made_before(work, names, loops, inside, quiet)))


def forward_read(work: _Work, names: set[str]) -> tuple[str, int] | None:
    """A read of a module-level batch-size name in a method of the script's own model classes (an autoencoder's
    ``x.view(batch_size, -1)`` in ``forward``): the model sizes each batch by it, and each rank would take
    batch_size / N."""
    for name, scope, line, _node in work.facts.reads:
        head = name.split(".")[0]  # (``args.batch_size`` of the module's settings too: set 27's homework)
        local = head in scope.params or any(b.target == head and b.scope is scope for b in work.facts.bindings)
        # (any method of a model class: ``forward``, an ``init_hidden`` it calls, an ``__init__`` keeping
        # ``self.bs = batch_size`` for ``forward``)
        model = scope.cls is not None and f"{scope.cls}.forward" in work.facts.scopes
        if name in names and head != "self" and model and not local:
            return name, line
    return None


def forward_literal(work: _Work, size: cst.BaseExpression, call: Call) -> tuple[str, int] | None:
    """The batch size, a number (``batch_size=16``, or a name bound once to one), written as a number into a
    reshape of a method of the script's own model classes (a homework FCN's ``x = x.view(16, 784)`` in
    ``forward``, set 26): each rank would take 16/N rows. ``(the code, its line)``."""
    bound = binding_of(work.facts, dotted(size) or "", call.scope, call.line) if isinstance(size, cst.Name) else None
    number = size if isinstance(size, cst.Integer) else bound.value if bound is not None else None
    if not isinstance(number, cst.Integer):
        return None
    for c in work.facts.calls:
        first = c.node.args[0].value if c.node.args and c.node.args[0].keyword is None else None
        # (of what ``forward`` is handed: not a constant table reshaped in ``__init__``, review 40)
        held = dotted(c.node.func.value) if isinstance(c.node.func, cst.Attribute) else None
        if c.scope.cls and c.scope.name.endswith(".forward") and c.last in ("view", "reshape") and \
                held in c.scope.params and held != "self" and isinstance(first, cst.Integer) and \
                first.evaluated_value == number.evaluated_value:
            return work.facts.code(c.node), c.line
    return None


def _rebound(work: _Work, name: str, scope: Any, line: int, loops: list[Loop], names: set[str]) -> bool:
    """The read at ``line`` sees a binding the training loop made from something else (a DCGAN's ``batch_size =
    x.size(0)`` above ``torch.randn(batch_size, nz)``): the batch's own size, not the loader's."""
    bound = binding_of(work.facts, name, scope, line)
    return bound is not None and bound.scope is scope and bound.line < line and bound.value is not None and \
        any(loop.line < bound.line <= loop.end for loop in loops) and not names_in(bound.value) & names


def _aside(work: _Work, loops: list[Loop]) -> set[int]:
    """The ``with torch.no_grad():`` blocks of the loops whose names nothing outside them reads, or that read
    nothing the loop's batch makes: samples drawn on the side (set 28's cGAN: ``lab = torch.LongTensor(
    np.random.randint(0, 10, batch_size))`` beside a ``fixed_noise`` of ``batch_size`` rows, collected for a
    picture), sized for each other, not for the batch."""
    aside: set[int] = set()
    for loop in loops:
        body = node_ids(loop.node)
        # (what the loop's batch makes: a block that reads none of it shows samples of its own, whatever it keeps,
        # MNIST-CGAN's ``fake = netG(fixed_noise, labels)`` kept in a picture list; the after-fix re-run)
        made = set(loop.targets)
        for _ in range(3):
            made |= {b.target for b in work.facts.bindings if b.scope is loop.scope and b.value is not None and
                     loop.line <= b.line <= loop.end and names_in(b.value) & made}
        for block in m.findall(loop.node.body, m.With()):
            assert isinstance(block, cst.With)
            if not any(m.findall(item.item, m.Attribute(attr=m.Name("no_grad") | m.Name("inference_mode")) |
                                 m.Name("no_grad")) for item in block.items):
                continue
            ids = node_ids(block)
            bound = {dotted(t.target) for a in m.findall(block, m.Assign()) if isinstance(a, cst.Assign)
                     for t in a.targets} | {dotted(a.target) for a in m.findall(block, m.AugAssign())
                                            if isinstance(a, cst.AugAssign)}
            # (read anywhere in the function outside it: ``acc += ... / batch_size`` shown after the loop; review 44)
            outside = {name for name, scope, _line, node in work.facts.reads
                       if (scope is loop.scope or id(node) in body) and id(node) not in ids}
            read = {name for name, _scope, _line, node in work.facts.reads if id(node) in ids}
            if not (bound - {None}) & outside or not read & made:
                aside |= ids
    return aside


def _step_counts(work: _Work, loops: list[Loop], names: set[str]) -> set[int]:
    """The batch size dividing the data's size into a count of steps (DeepLearningZeroToAll's ``total_batch =
    len(mnist_train) // batch_size`` in the epoch loop, its ``avg_cost += cost / total_batch``): a global batch keeps
    that count on every rank, so it sizes nothing. The data's size only: ``len(...)``, or a name bound to one
    (review: ``total_loss / batch_size`` and ``loss * x.shape[0] / batch_size`` size the loss by the batch).
    So does its inverse, the batch's share of the data (a VAE's KL weight ``batch_size / total_train_samples``,
    set 25: the global batch's share, what one process weighted by; the named fix ``x.size(0)`` halved it)."""
    batch = {t for loop in loops for t in loop.targets} | {b.target for loop in loops for b in work.facts.bindings
                                                           if loop.line <= b.line <= loop.end}

    def sized(node: cst.CSTNode, scope: Any, line: int, depth: int = 0, numbers: bool = True) -> bool:
        held = measured(node) if isinstance(node, cst.BaseExpression) else None
        if held is not None:  # the data's size, not the batch's (review 26: ``len(x)`` of the batch)
            return held.split(".")[0] not in batch
        bound = binding_of(work.facts, dotted(node) or "", scope, line) if isinstance(node, cst.Name) else None
        return bound is not None and bound.value is not None and bound.line < line and depth < 2 and \
            (numbers and isinstance(bound.value, cst.Integer) or
             sized(bound.value, bound.scope, bound.line, depth + 1, numbers))
    found: set[int] = set()
    for loop in loops:
        for owner in [loop, *loop.outer]:
            for div in m.findall(owner.node, m.BinaryOperation(operator=m.Divide() | m.FloorDivide())):
                if not isinstance(div, cst.BinaryOperation):
                    continue
                if dotted(div.right) in names and sized(div.left, loop.scope, loop.line):
                    found |= node_ids(div.right)
                elif dotted(div.left) in names and isinstance(div.operator, cst.Divide) and \
                        sized(div.right, loop.scope, loop.line, numbers=False):  # (``B / half``: a size)
                    found |= node_ids(div.left)
    return found


def _counting(loops: list[Loop], names: set[str]) -> set[int]:
    """The nodes that count steps with the batch size, sizing nothing (DA-RNN's ``idx += batch_size`` and its
    ``losses[epoch * iters + idx / batch_size]``): ``+=`` of it into a counter (or ``n = n + B``), and the counter
    divided by it, compared (``if n > 32:``, a display every so many samples) or set back to a number."""
    found: set[int] = set()
    for loop in loops:
        # (counter, what it adds, the counter's read in ``n = n + B``): ``+=`` and its spelled-out form
        adds: list[tuple[Any, Any, Any]] = [
            (n.target, n.value, None) for n in m.findall(loop.node, m.AugAssign(operator=m.AddAssign()))
            if isinstance(n, cst.AugAssign) and dotted(n.value) in names and dotted(n.target)]
        adds += [(a.targets[0].target, a.value.right, a.value.left) for a in m.findall(loop.node, m.Assign())
                 if isinstance(a, cst.Assign) and len(a.targets) == 1 and isinstance(a.value, cst.BinaryOperation)
                 and isinstance(a.value.operator, cst.Add) and dotted(a.value.right) in names and
                 dotted(a.value.left) == dotted(a.targets[0].target) and dotted(a.value.left)]
        reads = {id(left) for _, _, left in adds if left is not None}
        resets = {id(t.target) for a in m.findall(loop.node, m.Assign()) if isinstance(a, cst.Assign) and
                  isinstance(a.value, (cst.Integer, cst.Float)) for t in a.targets}
        compared = {id(c.left) for c in m.findall(loop.node, m.Comparison()) if isinstance(c, cst.Comparison)}
        divisions = [n for n in m.findall(loop.node, m.BinaryOperation(operator=m.Divide() | m.FloorDivide()))
                     if isinstance(n, cst.BinaryOperation) and dotted(n.right) in names]
        for counter in {dotted(t) or "" for t, _, _ in adds}:
            # (only counted and divided back: ``preds[idx:idx + len(x)] = ...`` reads it as a position, review)
            allowed = {id(t) for t, _, _ in adds} | {id(n.left) for n in divisions if dotted(n.left) == counter} | \
                reads | resets | compared
            used = [n for n in m.findall(loop.node, m.Name(value=counter) | m.Attribute()) if dotted(n) == counter]
            if any(id(n) not in allowed for n in used):
                continue
            found |= {i for t, v, _ in adds if dotted(t) == counter for i in node_ids(v)}
            found |= {i for n in divisions if dotted(n.left) == counter for i in node_ids(n.right)}
    return found


def _made_before(work: _Work, names: set[str], loops: list[Loop], inside: set[int],
                 quiet: set[int]) -> list[tuple[str, int]]:
    """A tensor sized by the batch before the loops and read in them (pytorch-GANs' ``real_gt = torch.ones(
    (config['batch_size'], 1))`` above the epoch loop, its BCE target each step): ``(the target, its line)``.
    ``names`` holds the batch size's code too when it is an item (``config['batch_size']``)."""
    scopes = {id(loop.scope) for loop in loops}
    first = min((loop.line for loop in loops), default=0)
    # (a read under an ``if`` of the loop, ``if i % 100 == 0: fake = netG(fixed_noise)``, shows, not trains)
    # (not one that computes the loss the step takes: ``if p: loss = crit(D(x), self.target_real)``, set 27)
    stepped = {n for loop in loops for n in stepped_losses(loop)}
    shown = quiet | {i for loop in loops for node in m.findall(loop.node.body, m.If()) if not any(
        isinstance(a, cst.Assign) and any(dotted(t.target) in stepped for t in a.targets)
        for a in m.findall(node, m.Assign())) for i in node_ids(node)}
    # (``noise[:x.size(0)]``: cut to the batch each step, the named fix for a tensor made before the loop)
    sizes = {b.target for b in work.facts.bindings if any(lp.line < b.line <= lp.end for lp in loops) and
             b.value is not None and batch_size(b.value)}  # (``b = x.size(0)``, then ``noise[:b]``)
    trimmed = {id(sub.value) for loop in loops for sub in m.findall(loop.node.body, m.Subscript())
               if isinstance(sub, cst.Subscript) and _to_batch(sub, sizes)}
    read_inside = {name for name, _scope, _line, node in work.facts.reads if id(node) in inside - shown - trimmed}
    # (``label.resize_(batch_size)`` each step, conditional-GAN's: sized by the batch it holds; not ``x.data.resize_``,
    # which leaves ``x`` as it was: AC-GAN's IndexError)
    read_inside -= {dotted(c.node.func.value) for loop in loops for c in loop.calls
                    if c.last in ("resize_", "resize_as_") and isinstance(c.node.func, cst.Attribute)}
    # (the loop's own variables: jcjohnson's ``x = torch.randn(N, D_in)`` is the data, ``for x, y in loader`` rebinds)
    read_inside -= {t for loop in loops for t in loop.targets}
    found = []
    for b in work.facts.bindings:
        made = resolve(dotted(b.value.func), work.facts.aliases) if isinstance(b.value, cst.Call) else None
        # (or kept by the class's ``__init__``, ``self.target_real = torch.ones(self.batch_size, 1)``, read in its
        # training method: a GAN trainer's targets, set 27)
        held = b.target.startswith("self.") and b.scope.cls is not None and b.scope.name.endswith(".__init__") and \
            any(loop.scope.cls == b.scope.cls for loop in loops)
        if (id(b.scope) in scopes and b.line < first or held) and b.value is not None and b.target in read_inside and \
                (made or "").startswith("torch.") and (made or "").rsplit(".", 1)[-1] in TENSOR_MAKERS and \
                (names_in(b.value) | items_of(work, b.value)) & names:
            found.append((b.target, b.line))
    return found


def _to_batch(sub: cst.Subscript, sizes: set[str]) -> bool:
    """``t[:x.size(0)]`` (``len(x)``, ``x.shape[0]``, or a name bound to one in the loop, ``sizes``): the first rows
    of ``t``, as many as the batch holds."""
    first = sub.slice[0].slice if sub.slice else None
    return isinstance(first, cst.Slice) and first.lower is None and first.step is None and \
        first.upper is not None and (batch_size(first.upper) or dotted(first.upper) in sizes)


# torch's calls that make a tensor of a given size: a target or a noise batch sized by the batch size (and the
# legacy typed constructors of older scripts, AC-GAN's ``aux_label = torch.LongTensor(opt.batchSize)``)
TENSOR_MAKERS = ("ones", "zeros", "full", "empty", "randn", "rand", "randint", "normal", "tensor", "Tensor",
                 "FloatTensor", "LongTensor", "DoubleTensor", "IntTensor", "ByteTensor", "HalfTensor", "BoolTensor")


def items_of(work: _Work, node: cst.CSTNode) -> set[str]:
    """The code of each ``name['key']`` item in ``node``."""
    return {work.facts.code(s) for s in m.findall(node, m.Subscript(value=m.Name() | m.Attribute()))
            if isinstance(s, cst.Subscript)}


def quiet_nodes(work: _Work, loops: list[Loop]) -> set[int]:
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
