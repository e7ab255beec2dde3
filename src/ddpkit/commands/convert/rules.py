"""The line-by-line rules of ``ddpkit convert``: the device set-up, output on rank 0 (print, logging,
TensorBoard, tqdm), saving on rank 0, loading onto this rank's device, and the few calls that must see the
module inside the wrapper (``ddpkit.unwrap``). The model and the loaders are :mod:`ddpkit.commands.convert.plan`'s.

Example::

    >>> init_arguments(cst.parse_expression('torch.device("cuda" if torch.cuda.is_available() else "cpu")'))
    ''
    >>> init_arguments(cst.parse_expression('torch.device(args.device)'))
    'cpu=torch.device(args.device).type == "cpu"'
"""

from __future__ import annotations

from typing import Any

import libcst as cst

from ddpkit.commands.check.rules import RANK_WORDS
from ddpkit.commands.convert.apply import add_keyword
from ddpkit.commands.convert.flow import callee, visible
from ddpkit.commands.convert.scan import Binding, Scope, dotted, names_in, resolve

# the plan in the making (plan._Work, which imports this module): facts, edits, log, left, models, state
_Work = Any

ACCELERATORS = ("cuda", "mps", "xpu")
LOG_CALLS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log")
PROGRESS = ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm")
UNWRAP = ("isinstance", "type", "copy.deepcopy", "torch.jit.script", "torch.jit.trace", "torch.onnx.export")


def _text(node: cst.BaseExpression) -> str | None:
    """A device string: ``"cuda"``, or ``torch.device("cuda")``'s."""
    if isinstance(node, cst.Call) and dotted(node.func) in ("torch.device", "device") and len(node.args) == 1:
        node = node.args[0].value
    return node.evaluated_value if isinstance(node, cst.SimpleString) else None  # type: ignore[return-value]


def _branches(value: cst.BaseExpression) -> list[str]:
    """``"cuda" if a else "mps" if b else "cpu"``: ["cuda", "mps", "cpu"] ("" for a branch that is no string)."""
    found = []
    while isinstance(value, cst.IfExp):
        found.append(_text(value.body) or "")
        value = value.orelse
    return [*found, _text(value) or ""]


def _kind(text: str) -> str:
    return "cpu" if text.startswith("cpu") else "accelerator" if text.startswith(ACCELERATORS) else ""


def is_device(value: cst.BaseExpression | None, target: str, aliases: dict[str, str]) -> bool:
    """``torch.device(...)``, ``"cuda" if ... else "cpu"`` (either way round, or of ``torch.device`` calls), or
    a device string bound to a ``*device`` name."""
    if isinstance(value, cst.Call):  # a fixed torch.device("cpu") is a set-up only as the script's ``device``
        fixed = _text(value) is not None and _kind(_text(value) or "") == "cpu"
        return resolve(dotted(value.func), aliases) == "torch.device" and \
            (not fixed or target.split(".")[-1] == "device")
    if isinstance(value, cst.IfExp):  # "cuda" if a else "mps" if b else "cpu"; "cpu" if a else "cuda" if b ...
        kinds = [_kind(b) for b in _branches(value)]
        return "" not in kinds and kinds.count("cpu") == 1 and kinds[0] != kinds[-1] and \
            (kinds[-1] == "cpu" or kinds[0] == "cpu")
    text = _text(value) if value is not None else None
    return "device" in target.lower() and text is not None and _kind(text) != ""


def init_arguments(value: cst.BaseExpression) -> str:
    """What ``ddpkit.init(...)`` needs to pick the device the script picked: nothing where it picks an
    accelerator when there is one (ddpkit does too, one per rank), ``cpu=...`` where the script can be told
    to stay on the CPU."""
    module = cst.Module(body=[])
    if isinstance(value, cst.Call) and value.args:
        inner = value.args[0].value
        if isinstance(inner, (cst.IfExp, cst.SimpleString)):
            return init_arguments(inner)
        return f'cpu=torch.device({module.code_for_node(inner)}).type == "cpu"'
    if isinstance(value, cst.IfExp):
        test, on_cpu = value.test, _kind(_text(value.body) or "") == "cpu"  # "cpu" if args.no_cuda else "cuda"
        if not on_cpu and isinstance(test, cst.Call) and \
                (dotted(test.func) or "").endswith(("cuda.is_available", "mps.is_available")):
            return ""
        code = module.code_for_node(test)
        simple = isinstance(test, (cst.Name, cst.Attribute, cst.Call))
        if on_cpu:
            return f"cpu={code}" if simple else f"cpu=bool({code})"
        return f"cpu=not {code}" if simple else f"cpu=not ({code})"
    text = _text(value) if isinstance(value, cst.SimpleString) else None
    return "cpu=True" if text is not None and text.startswith("cpu") else ""


def devices(work: _Work) -> None:
    """``device = torch.device(...)`` -> ``state = ddpkit.init(...)`` and ``device = state.device``."""
    facts = work.facts
    found = [b for b in facts.bindings if b.stmt is not None and is_device(b.value, b.target, facts.aliases)]
    for b in found:
        again = [o for o in found if o.target == b.target and o.scope is b.scope and o is not b]
        if again:  # device = "cpu"; if torch.cuda.is_available(): device = "cuda": the first init would win
            work.leave(b.line, f"{b.target} is chosen over several lines ({', '.join(str(o.line) for o in again)})",
                       f"write it as one: {b.target} = torch.device('cuda' if torch.cuda.is_available() else "
                       "'cpu'), then convert again", blocks=True)
            return
    for b in found:
        if len(b.stmt.body) != 1 or not isinstance(b.stmt.body[0], cst.Assign) \
                or len(b.stmt.body[0].targets) != 1:
            work.leave(b.line, "the device set-up shares its line with other statements: left as it is",
                       f"put {b.target} = ... on a line of its own, then convert again", blocks=True)
            continue
        assert b.value is not None
        args = init_arguments(b.value)
        if b.target.startswith("self."):
            work.devices.append(b)
            work.edits.expr[id(b.value)] = lambda node, a=args: cst.parse_expression(f"ddpkit.init({a}).device")
            work.note(f"{b.target} = ddpkit.init().device", "ddpkit.init() starts the process group and "
                      "gives each rank its own device", b.line)
            continue
        work.devices.append(b)
        init = f"{work.state} = ddpkit.init({args})"
        early = _first_ddpkit_use(work, b)
        if early is None:
            work.edits.replace[id(b.stmt)] = [init, f"{b.target} = {work.state}.device"]
        else:  # a loader or a print above would start ddpkit with the defaults first: start it there, as asked
            work.edits.before.setdefault(id(early.stmt), []).append(init)
            work.edits.replace[id(b.stmt)] = [f"{b.target} = {work.state}.device"]
        work.inits.append(b.scope)
        work.note(f"{b.target} = ... -> {work.state} = ddpkit.init({args}); {b.target} = "
                  f"{work.state}.device", "init() starts the process group and gives each rank its own device", b.line)


STARTS_DDPKIT = ("print", "torch.utils.data.DataLoader", "torch.utils.tensorboard.SummaryWriter", *PROGRESS)


def _first_ddpkit_use(work: _Work, device: Binding) -> Any:
    """The first statement above the device line, in its block, whose converted call starts ddpkit (with the
    defaults: ``cpu=`` would come too late), when the init's arguments are bound by then; else None."""
    args = names_in(device.value) if device.value is not None else set()
    for call in work.facts.calls:
        if call.scope is not device.scope or call.line >= device.line or call.name not in STARTS_DDPKIT \
                or call.stmt is None or call.loops or call.tests:
            continue
        bound = {b.target for b in work.facts.bindings if b.line < call.line}
        if all(a in bound or a in work.facts.aliases for a in args if "." not in a):
            return call
        if args - {"torch"}:  # the switch is read later than that: cpu= would come too late, and say nothing
            work.leave(call.line, f"this line starts ddpkit (with the defaults) before the device set-up at line "
                       f"{device.line} can say cpu=", f"move the device set-up (and what it reads) above line "
                       f"{call.line}, then convert again", blocks=True)
        return None
    return None


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
                                    (_text(arg.value) or "").split(":")[0] in ("cpu", *ACCELERATORS)) \
        or arg.keyword is not None and arg.keyword.value == "device"


def _main(work: _Work, scope: Scope) -> str:
    """An expression for "this is rank 0" in ``scope``: ``state.is_main`` where the init's state is seen."""
    if any(visible(work.facts, work.state, s, scope) for s in work.inits) or \
            any(b.target == work.state and visible(work.facts, work.state, b.scope, scope)
                for b in work.facts.bindings):
        return f"{work.state}.is_main"
    return "ddpkit.init().is_main"


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
        func = call.node.func
        if call.name == "print" and printing and isinstance(func, cst.Name) and not ranked:
            work.edits.expr[id(func)] = lambda node: cst.parse_expression("ddpkit.print")
            work.note("print -> ddpkit.print", "printed once, by rank 0", call.line)
        elif call.name == "logging.getLogger":
            work.edits.expr[id(call.node)] = lambda node: node.with_changes(
                func=cst.parse_expression("ddpkit.get_logger"), args=node.args or [cst.Arg(cst.SimpleString('""'))])
            work.note("logging.getLogger -> ddpkit.get_logger", "logs on rank 0 only", call.line)
        elif call.name in tuple(f"logging.{f}" for f in LOG_CALLS):
            work.edits.expr[id(func)] = lambda node, f=call.last: cst.parse_expression(f'ddpkit.get_logger("").{f}')
            work.note(f"logging.{call.last} -> ddpkit.get_logger(\"\").{call.last}", "logs on rank 0 "
                      "only", call.line)
        elif (call.name or "").endswith(("tensorboard.SummaryWriter", "tensorboardX.SummaryWriter")):
            work.edits.expr[id(func)] = lambda node: cst.parse_expression("ddpkit.summary_writer")
            work.note("SummaryWriter -> ddpkit.summary_writer", "one event file, written by rank 0 "
                      "(the others get a writer that does nothing)", call.line)
        elif call.name in PROGRESS or call.name in ("tqdm.trange", "tqdm.auto.trange"):
            _progress(work, call)
        elif call.name == "torch.save" and not ranked:
            _save(work, call, loads)
        elif call.name == "torch.save" and loads and not any(c.name == "ddpkit.barrier" or c.last == "barrier"
                                                              for c in facts.calls):
            work.leave(call.line, f"rank 0 saves here, and a file is read at line {loads[0].line} with no barrier "
                       "between: the other ranks may read it before it is written", "put ddpkit.barrier() after the "
                       "save where every rank passes")
        elif call.name == "torch.load" and not any(a.keyword and a.keyword.value == "map_location"
                                                   for a in call.node.args):
            where = f"{work.state}.device" if _main(work, call.scope).startswith(work.state) else '"cpu"'
            work.edits.expr[id(call.node)] = lambda node, w=where: add_keyword(node, "map_location", w)
            work.note(f"torch.load(..., map_location={where})", "tensors load where this rank "
                      "works, not on the GPU they were saved from", call.line)
        elif call.name in UNWRAP:
            _unwrap(work, call)


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
    else:  # tqdm(total=...) updated by hand: no iterable to hand over; the bar shows on rank 0 only
        flag = f"not {_main(work, call.scope)}"
        work.edits.expr[id(node)] = lambda n: add_keyword(n, "disable", flag)
    work.note(f"{call.last} -> ddpkit.progress", "one bar, on rank 0", call.line)


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
    work.edits.guard[id(call.stmt)] = _main(work, call.scope)
    # read below, or in a function (defined above, it may run after the save); a load above in the same block
    # ran before (a resume at the start)
    read_back = [c for c in loads if c.line > call.line or c.scope is not call.scope and c.scope.name]
    if read_back and (call.tests or call.loops or _called_in_branch(work, call.scope)):  # (one rank may skip it)
        work.leave(call.line, f"a file is read at line {read_back[0].line} (maybe the one saved here), and the "
                   "save is inside an if or a loop: the other ranks may read it before rank 0 has written it",
                   "put ddpkit.barrier() after the save where every rank passes (outside rank- or data-dependent "
                   "branches)")
        read_back = []
    if read_back:  # the file is read again below: the other ranks wait until rank 0 has written it
        work.edits.after.setdefault(id(call.stmt), []).append("ddpkit.barrier()")
    work.note("torch.save guarded: rank 0 saves" + (", then every rank waits for it (barrier)"
                                                               if read_back else ""),
              "every rank holds the same weights; N writers of one file race" +
              (f"; a file is read at line {read_back[0].line}" if read_back else ""), call.line)


def _called_in_branch(work: _Work, scope: Scope, depth: int = 0) -> bool:
    """A function some call of which sits under an ``if`` (or any call of which cannot be found): a barrier in it
    would be a collective that one rank may skip."""
    if not scope.name or depth > 3:
        return False
    sites = [c for c in work.facts.calls if (callee(work.facts, c) or (None,))[0] is scope]
    return not sites or any(c.tests or _called_in_branch(work, c.scope, depth + 1) for c in sites)


def _per_rank(work: _Work, call: Any) -> bool:
    """A save each rank makes to its own file: a path that names the rank, or one under a temporary directory
    (each rank creates its own; followed through the variables the path is built from). Guarding it would
    leave the other ranks without their file."""
    path = call.node.args[1].value if len(call.node.args) > 1 else None
    if path is None:
        return False
    if "rank" in work.facts.code(path).lower():
        return True
    names, seen = names_in(path), set[str]()
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
    work.edits.expr[id(args[0].value)] = lambda node: cst.parse_expression(
        f"ddpkit.unwrap({cst.Module(body=[]).code_for_node(node)})")
    work.note(f"{call.last}({dotted(args[0].value)}) -> {call.last}(ddpkit.unwrap(...))",
              "the prepared model is a wrapper; this call needs the module inside it", call.line)


def bound_to_init(b: Binding) -> bool:
    return isinstance(b.value, cst.Call) and dotted(b.value.func) == "ddpkit.init"
