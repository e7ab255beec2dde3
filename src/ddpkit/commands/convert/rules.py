"""The line-by-line rules of ``ddpkit convert``: output on rank 0 (print, logging, TensorBoard, tqdm), saving
on rank 0, folders every rank makes, loading onto this rank's device, and the few calls that must see the module
inside the wrapper (``ddpkit.unwrap``). The device set-up is :mod:`ddpkit.commands.convert.device`'s; the model
and the loaders are :mod:`ddpkit.commands.convert.plan`'s.

Example::

    >>> without_moves(cst.parse_expression("Net().to(device).cuda()")).func.value
    'Net'
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert import folders, paths, waits, wholemodel
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.devicetext import ACCELERATORS, PROGRESS, text_of
from ddpkit.commands.convert.flow import argument_for, binding_of, callers, visible
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import Binding

# the plan in the making (plan._Work, which imports this module): facts, edits, log, left, models, state
_Work = Any
# TensorBoard's writer as scripts import it (``from torch.utils.tensorboard.writer import SummaryWriter``, its own
# module: set 26, every rank wrote its event files into one folder)
WRITERS = ("tensorboard.SummaryWriter", "tensorboardX.SummaryWriter", "tensorboard.writer.SummaryWriter",
           "tensorboardX.writer.SummaryWriter")

LOG_CALLS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log")
# what copies or moves a file: beside a guarded torch.save (bearpaw's copy of the best checkpoint), rank 0's too
FILE_OPS = ("shutil.copyfile", "shutil.copy", "shutil.copy2", "shutil.move", "os.rename", "os.replace")
PRETRAINED = ("save_pretrained", "push_to_hub")  # Hugging Face's saves (a model's, a tokenizer's)
# thop / torchinfo / torchsummary walk the module's layers and hook them: through the wrapper they meet DDP's
UNWRAP = ("isinstance", "type", "copy.deepcopy", "torch.jit.script", "torch.jit.trace", "torch.onnx.export",
          "thop.profile", "torchinfo.summary", "torchsummary.summary")
# a TensorBoard writer's graph traces the model: through DDP it meets the process group (a RuntimeError on rank 0)
UNWRAP_METHODS = ("add_graph",)
# a walk over the layers (ABSA's ``for child in self.model.children(): if type(child) != BertModel: init``): the
# wrapper's one child is the whole module, and its names carry a ``module.`` prefix (a log of gradient norms keyed
# by ``named_parameters()`` would read ``module.0.weight`` where one process writes ``0.weight``)
WALKS = ("children", "named_children", "named_modules", "named_parameters", "named_buffers")


def without_moves(node: cst.BaseExpression) -> cst.BaseExpression:
    """``Net().to(device).cuda()`` -> ``Net()``: prepare_model moves the model (a ``.to`` that also casts,
    ``.to(torch.float64)``, stays)."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and \
            node.func.attr.value in ("to", "cuda") and (node.func.attr.value == "cuda" or _device_only(node)):
        node = node.func.value
    return node


def _device_only(call: cst.Call) -> bool:
    if len(call.args) != 1:
        return False
    arg = call.args[0]
    name = (dotted(arg.value) or "").lower()
    return arg.keyword is None and ("device" in name or name in ("gpu", "dev") or
                                    (text_of(arg.value) or "").split(":")[0] in ("cpu", *ACCELERATORS)) \
        or arg.keyword is not None and arg.keyword.value == "device"


# a progress bar's class method that prints a line above the bars (bert-classification-tutorial's epoch line)
TQDM_WRITES = ("tqdm.tqdm.write", "tqdm.write", "tqdm.auto.tqdm.write", "tqdm.std.tqdm.write")


def outputs(work: _Work) -> None:
    facts = work.facts
    printing = "print" not in {b.target for b in facts.bindings} and "print" not in facts.aliases
    if facts.aliases.get("print") == "builtins.print" or any(dotted(b.value) == "print" for b in facts.bindings):
        line = next((b.line for b in facts.bindings if dotted(b.value) == "print"), work.import_line())
        work.leave(line, "print is imported or renamed here: its calls print on every rank", "call "
                   "ddpkit.print(...) for what rank 0 alone should print")
    loads = [c for c in facts.calls if c.name == "torch.load"]
    for call in facts.calls:
        ranked = any(w in test.lower() for test in call.tests for w in RANK_WORDS)
        if call.name == "torch.save":
            wholemodel.whole_model(work, call)
        func = call.node.func
        if call.name == "print" and printing and isinstance(func, cst.Name) and not ranked:
            work.edits.expr[id(func)] = lambda node: cst.parse_expression("ddpkit.print")
            work.note("print -> ddpkit.print", "printed once, by rank 0", call.line)
        elif call.name in ("pprint.pprint", "pprint.pp", *TQDM_WRITES) and not ranked and call.stmt is not None and \
                len(call.stmt.body) == 1 and isinstance(call.stmt.body[0], cst.Expr) and \
                call.stmt.body[0].value is call.node:  # (DialoGPT's ``pprint(args.__dict__)``)
            work.edits.guard[id(call.stmt)] = waits.main_test(work, call.scope, call.line)
            work.note(f"{call.last} guarded: rank 0 prints", "printed once, as print -> ddpkit.print", call.line)
        elif call.name == "logging.getLogger":
            work.edits.expr[id(call.node)] = lambda node: node.with_changes(
                func=cst.parse_expression("ddpkit.get_logger"), args=node.args or [cst.Arg(cst.SimpleString('""'))])
            work.note("logging.getLogger -> ddpkit.get_logger", "logs on rank 0 only", call.line)
        elif call.name in tuple(f"logging.{f}" for f in LOG_CALLS):
            work.edits.expr[id(func)] = lambda node, f=call.last: cst.parse_expression(f'ddpkit.get_logger("").{f}')
            work.note(f"logging.{call.last} -> ddpkit.get_logger(\"\").{call.last}", "logs on rank 0 "
                      "only", call.line)
        elif (call.name or "").endswith(WRITERS):
            work.edits.expr[id(func)] = lambda node: cst.parse_expression("ddpkit.summary_writer")
            work.note("SummaryWriter -> ddpkit.summary_writer", "one event file, written by rank 0 "
                      "(the others get a writer that does nothing)", call.line)
        elif (call.name in PROGRESS or call.name in ("tqdm.trange", "tqdm.auto.trange")) and \
                not any(a.keyword is not None and a.keyword.value == "disable" for a in call.node.args):
            _progress(work, call)  # (a bar that says disable= is shown where the script chose: converted already)
        elif call.name == "torch.save" and not ranked:
            _save(work, call, loads)
        elif call.last in PRETRAINED and isinstance(func, cst.Attribute):
            _pretrained(work, call, ranked)
        elif call.name == "torch.save" and waits.read_back(work, call, loads) and not any(
                c.name == "ddpkit.barrier" or c.last == "barrier" for c in facts.calls):
            waits.unwaited(work, call, waits.read_back(work, call, loads)[0].line)
        elif call.name == "torch.load" and not any(a.keyword and a.keyword.value == "map_location"
                                                   for a in call.node.args):
            where = f"{work.state}.device" if waits.main_test(work, call.scope, call.line, said=False).startswith(
                work.state) else '"cpu"'
            work.edits.expr[id(call.node)] = lambda node, w=where: add_keyword(node, "map_location", w)
            work.note(f"torch.load(..., map_location={where})", "tensors load where this rank "
                      "works, not on the GPU they were saved from", call.line)
        elif call.name in UNWRAP or call.last in UNWRAP_METHODS and isinstance(func, cst.Attribute):
            _unwrap(work, call)
        elif call.last in WALKS and isinstance(func, cst.Attribute) and \
                dotted(func.value) in {b.target for b in work.models}:
            work.edits.expr[id(func.value)] = _unwrapped
            work.note(f"{dotted(func.value)}.{call.last}() -> ddpkit.unwrap(...).{call.last}()", "the prepared "
                      "model's only child is the wrapped module: a walk over its layers needs the module" if
                      call.last.endswith(("children", "modules")) else "the prepared model's names carry a "
                      "'module.' prefix; the module's are the names one process has", call.line)
        elif call.name in ("os.mkdir", "os.makedirs") or call.last == "mkdir" and folders.a_path(work, call):
            folders.mkdir(work, call)
        elif call.name in FILE_OPS and not ranked and call.stmt is not None and len(call.stmt.body) == 1 and any(
                c.name == "torch.save" and c.scope is call.scope for c in facts.calls):
            work.edits.guard[id(call.stmt)] = waits.main_test(work, call.scope, call.line)
            work.note(f"{call.name} guarded: rank 0 does it", "beside a torch.save that rank 0 alone makes: on "
                      "another rank the file may not be written yet (FileNotFoundError), and N copies race",
                      call.line)


def class_reads(work: _Work) -> None:
    """``model.__class__`` (``'VGG' in model.__class__.__name__``, an image-classifier's save helper) ->
    ``ddpkit.unwrap(model).__class__``: the prepared model's class is the wrapper's (DDP), as ``type()`` is."""
    wrapped = {b.target for b in work.models}
    for node in m.findall(work.facts.module, m.Attribute(attr=m.Name("__class__"))):
        assert isinstance(node, cst.Attribute)
        if _holds_model(work, node.value, wrapped) and id(node.value) not in work.edits.expr:
            work.edits.expr[id(node.value)] = _unwrapped
            line = next((r[2] for r in work.facts.reads if r[3] is node.value or r[3] is node), None)
            work.note(f"{dotted(node.value)}.__class__ -> ddpkit.unwrap(...).__class__", "the prepared model is a "
                      "wrapper; its class is the module's inside it", line or work.import_line())


def _holds_model(work: _Work, value: cst.BaseExpression, wrapped: set[str]) -> bool:
    """``value`` names a prepared model: its binding, or a parameter of the script's function every call of which
    hands it one (``train_model(net, ...)``, then ``model.__class__.__name__`` in it; set 27's CIFAR classifier)."""
    name = dotted(value)
    if name in wrapped:
        return True
    scope = next((r[1] for r in work.facts.reads if r[3] is value), None)
    if scope is None or name is None or name not in scope.params:
        return False
    skip = 1 if scope.cls and scope.params[:1] in (["self"], ["cls"]) else 0
    sites = callers(work.facts, scope)
    given = [argument_for(site, name, scope, skip) for site in sites]
    return bool(given) and all(g is not None and dotted(g) in wrapped for g in given)


def _progress(work: _Work, call: Any) -> None:
    node = call.node
    positional = [a for a in node.args if a.keyword is None]
    if call.last == "trange":
        work.edits.expr[id(node)] = lambda n: n.with_changes(
            func=cst.parse_expression("ddpkit.progress"),
            args=[cst.Arg(cst.Call(cst.Name("range"), args=[a for a in n.args if a.keyword is None]))] +
            [a for a in n.args if a.keyword is not None])
    elif positional or any(a.keyword and a.keyword.value == "iterable" for a in node.args):
        work.edits.expr[id(node.func)] = lambda n: cst.parse_expression("ddpkit.progress")
    elif _counted_bar(work, call):  # the script reads its count (``-loss / pbar.n``): a disabled bar counts nothing
        work.keep(call.line, f"{call.last} left on every rank", "the script reads the bar's count (.n), which a bar "
                  "disabled on the other ranks would leave at 0")
        return
    else:  # tqdm(total=...) updated by hand: no iterable to hand over; the bar shows on rank 0 only
        flag = f"not {waits.main_test(work, call.scope, call.line)}"
        work.edits.expr[id(node)] = lambda n: add_keyword(n, "disable", flag)
        work.note(f"{call.last}(...) -> {call.last}(..., disable={flag})", "one bar, on rank 0", call.line)
        return
    work.note(f"{call.last} -> ddpkit.progress", "one bar, on rank 0", call.line)


def _counted_bar(work: _Work, call: Any) -> bool:
    """The bar made by ``call`` (``pbar = tqdm(total=n)``, ``with tqdm(total=n) as pbar:``) has its ``.n`` read
    (pytorch-flows' ``-val_loss / pbar.n``)."""
    names = {b.target for b in work.facts.bindings if b.value is call.node}
    for node in m.findall(work.facts.module, m.With()):
        names |= {dotted(i.asname.name) for i in getattr(node, "items", ()) if i.item is call.node and i.asname}
    return any(name in {f"{n}.n" for n in names if n} for name, _scope, _line, _node in work.facts.reads)


def _save(work: _Work, call: Any, loads: list[Any]) -> None:
    if call.stmt is None or len(call.stmt.body) > 1:
        if _per_rank(work, call):
            return
        where = "on the line of its if / for / with" if call.stmt is None else "on a line with other statements"
        work.leave(call.line, f"torch.save {where}: every rank writes the file (guarding the line would keep "
                   "the rest from the other ranks)", "put the save on a line of its own, then convert again")
        return
    if _per_rank(work, call):
        return
    work.edits.guard[id(call.stmt)] = waits.main_test(work, call.scope, call.line)
    saved = _saved_to(call)  # (``last.pth`` saved, ``best.pth`` read: no wait owed for the first)
    read_back = [r for r in waits.read_back(work, call, loads)
                 if paths.maybe_same(work.facts, call, saved, r, paths.first_path(r))]
    if read_back and waits.branched(work, call) and \
            (waits.wait_before(work, call, read_back) or waits.own_barrier(work, call, read_back) or
             waits.barrier_between(work, call, read_back)):
        return
    if read_back and waits.branched(work, call) and \
            all(waits.callers_apart(work, call.scope, r.scope) for r in read_back):
        work.keep(call.line, f"a file is read at line {read_back[0].line} in {read_back[0].scope.name}(), a function "
                  f"apart from {call.scope.name}() that saves here; no function of this file runs both", "a caller "
                  "that saves and then loads should put ddpkit.barrier() between the two calls")
        read_back = []
    if read_back and waits.branched(work, call):  # (one rank may skip it)
        work.leave(call.line, f"a file is read at line {read_back[0].line} (maybe the one saved here), and the "
                   f"save is {waits.branch_said(work, call)}: the other ranks may read it before rank 0 has written it",
                   waits.BARRIER_FIX)
        read_back = []
    elsewhere = waits.read_elsewhere(work, call) if not read_back else None
    if elsewhere is not None:  # DANN: ``torch.save(net, path)`` each epoch, then ``test(...)`` of test.py loads it
        work.edits.after.setdefault(id(call.stmt), []).append("ddpkit.barrier()")
        work.note("torch.save guarded: rank 0 saves, then every rank waits for it (barrier)", f"{elsewhere}() of "
                  "another module of the project runs next and may read the file", call.line)
        return
    skipped = waits.skipped_read(work, call) if not read_back else None
    if skipped is not None:
        work.leave(call.line, f"{skipped}() of another module of the project runs next and may read the file, and a "
                   "continue, break or return of the loop may take one rank around this save (a barrier here could "
                   "hang)", waits.BARRIER_FIX)
        return
    loader = waits.loaded_elsewhere(work, call) if not read_back else None
    if loader is not None:
        work.edits.after.setdefault(id(call.stmt), []).append("ddpkit.barrier()")
        work.note("torch.save guarded: rank 0 saves, then every rank waits for it (barrier)", f"{loader}, another "
                  "module of the project, loads a file with torch.load and may run next", call.line)
        return
    if read_back:  # the file is read again below: the other ranks wait until rank 0 has written it
        work.edits.after.setdefault(id(call.stmt), []).append("ddpkit.barrier()")
    work.note("torch.save guarded: rank 0 saves" + (", then every rank waits for it (barrier)"
                                                               if read_back else ""),
              "every rank holds the same weights; N writers of one file race" +
              (f"; a file is read at line {read_back[0].line}" if read_back else ""), call.line)


def _pretrained(work: _Work, call: Any, ranked: bool) -> None:
    """``model.save_pretrained(d)`` / ``.push_to_hub(repo)`` -> ``if state.is_main:
    ddpkit.unwrap(model).save_pretrained(d)``: one writer (N ranks would write one folder, or push N commits), and
    the prepared model's own module (the wrapper is no Hugging Face model); a ``from_pretrained`` below reads
    it back only after a barrier, as a ``torch.save`` read back does."""
    func = call.node.func
    name = dotted(func.value)
    found = binding_of(work.facts, name, call.scope, call.line) if name else None
    if found is not None and any(found is b or found.target == b.target and visible(
            work.facts, b.target, b.scope, call.scope) for b in work.models):
        work.edits.expr[id(func.value)] = lambda node: cst.parse_expression(f"ddpkit.unwrap({name})")
        work.note(f"{name}.{call.last}(...) -> ddpkit.unwrap({name}).{call.last}(...)", "the prepared model is a "
                  "wrapper: the Hugging Face model is the module inside it", call.line)
    if ranked:
        return
    if call.stmt is None or len(call.stmt.body) > 1:
        where = "on the line of its if / for / with" if call.stmt is None else "on a line with other statements"
        work.leave(call.line, f"{call.last} {where}: every rank writes it", "put it on a line of its own, then "
                   "convert again")
        return
    work.edits.guard[id(call.stmt)] = waits.main_test(work, call.scope, call.line)
    loads = [c for c in work.facts.calls if c.last == "from_pretrained"] if call.last == "save_pretrained" else []
    read_back = waits.read_back(work, call, loads)
    if read_back and any(c.last == "save_pretrained" and c.scope is call.scope and call.line < c.line <
                         read_back[0].line for c in work.facts.calls):
        read_back = []  # (a tokenizer saved below it: one barrier, after the last save, does for both)
    if read_back and waits.branched(work, call):
        work.leave(call.line, f"{call.last} inside an if or a loop, and from_pretrained reads at line "
                   f"{read_back[0].line}: the other ranks may read before rank 0 has written", waits.BARRIER_FIX)
    elif read_back:
        work.edits.after.setdefault(id(call.stmt), []).append("ddpkit.barrier()")
    work.note(f"{call.last} guarded: rank 0 {'pushes' if call.last == 'push_to_hub' else 'saves'}" +
              (", then every rank waits for it (barrier)" if read_back and id(call.stmt) in work.edits.after else ""),
              "every rank holds the same weights; N writers of one folder race (N pushes: N commits)", call.line)


def _saved_to(call: Any) -> Any:
    """The file ``torch.save(obj, f)`` writes: its second argument, or ``f=``."""
    positional = [a.value for a in call.node.args if a.keyword is None and not a.star]
    named = [a.value for a in call.node.args if a.keyword is not None and a.keyword.value == "f"]
    return positional[1] if len(positional) > 1 else named[0] if named else None


def _per_rank(work: _Work, call: Any) -> bool:
    """A save each rank makes to its own file (:func:`per_rank` of its path). Guarding it would leave the other
    ranks without their file."""
    return len(call.node.args) > 1 and per_rank(work, [call.node.args[1].value])


def per_rank(work: _Work, paths: list[cst.BaseExpression]) -> bool:
    """Each rank's own file: a path that names the rank, or one under a temporary directory (each rank creates
    its own; followed through the variables the path is built from)."""
    if any("rank" in work.facts.code(path).lower() for path in paths):
        return True
    names: set[str] = set().union(*(names_in(path) for path in paths)) if paths else set()
    seen: set[str] = set()
    for _ in range(3):  # best = os.path.join(tmp, "best.pt"); with TemporaryDirectory() as tmp
        values = [b.value for b in work.facts.bindings if b.target in names - seen and b.value is not None]
        if any(isinstance(v, cst.Call) and (resolve(dotted(v.func), work.facts.aliases) or "").endswith(
                ("TemporaryDirectory", "mkdtemp")) for v in values):
            return True
        seen |= names
        names = names.union(*(names_in(v) for v in values))
    return False


def _unwrap(work: _Work, call: Any) -> None:
    wrapped = {b.target for b in work.models}
    args = call.node.args
    if not args or dotted(args[0].value) not in wrapped:
        return
    work.edits.expr[id(args[0].value)] = _unwrapped
    work.note(f"{call.last}({dotted(args[0].value)}) -> {call.last}(ddpkit.unwrap(...))",
              "the prepared model is a wrapper; this call needs the module inside it", call.line)


def _unwrapped(node: cst.BaseExpression) -> cst.BaseExpression:
    """``model`` -> ``ddpkit.unwrap(model)``."""
    return cst.parse_expression(f"ddpkit.unwrap({cst.Module(body=[]).code_for_node(node)})")


def bound_to_init(b: Binding) -> bool:
    return isinstance(b.value, cst.Call) and dotted(b.value.func) == "ddpkit.init"
