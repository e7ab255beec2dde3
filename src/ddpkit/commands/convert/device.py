"""The device set-up of a script, as ``ddpkit convert`` rewrites it: ``device = torch.device(...)`` becomes
``state = ddpkit.init(...)`` and ``device = state.device``, keeping the script's own switch to the CPU (``cpu=``).
A device chosen in an ``if`` / ``else`` (pytorch/examples' ``if use_accel: device =
torch.accelerator.current_accelerator() else: device = torch.device("cpu")``) gets one init above the ``if``, so
every path has its state; each branch then reads ``state.device``.

Example::

    >>> from ddpkit.commands.convert.plan import plan
    >>> text = plan("import torch\\ndevice = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\\n").text
    >>> text.splitlines()[-2:]
    ['state = ddpkit.init()', 'device = state.device']

What a device expression says (its string, ``cpu=``) is :mod:`ddpkit.commands.convert.devicetext`'s.
"""

from __future__ import annotations

from typing import Any

import libcst as cst
import libcst.matchers as m

from ddpkit.commands.convert import flow, visible
from ddpkit.commands.convert.devicetext import (
    PROGRESS,
    as_string,
    available,
    cpu_when,
    flag_of,
    init_arguments,
    is_device,
    kind_of,
    text_of,
)
from ddpkit.commands.convert.names import dotted, names_in, resolve
from ddpkit.commands.convert.scan import Binding, Scope
from ddpkit.commands.convert.waits import main_guard

# the plan in the making (plan._Work): facts, edits, leave, note, devices, inits, state
_Work = Any

def _followed(binding: Binding) -> bool:
    """``dv = 'cuda' if x.is_cuda else 'cpu'`` in a method, ``x`` its parameter: the device of a tensor it is
    handed (a model's ``forward``), no set-up; not ``opt.is_cuda`` of the script's options."""
    test = binding.value.test if isinstance(binding.value, cst.IfExp) else None
    name = dotted(test) or "" if test is not None else ""
    head, _, attr = name.partition(".")
    return attr in ("is_cuda", "is_mps", "is_cpu") and bool(binding.scope.cls) and head in binding.scope.params and \
        head != "self"


def _loading_only(work: _Work, binding: Binding) -> bool:
    """A device read only as a load's ``map_location=`` (a resume loaded on the CPU, ``torch.load(p,
    map_location=device)``): where the checkpoint's tensors land, not where training runs (extra five of set 28:
    ``init(cpu=True)`` pinned a GPU run to the CPU)."""
    places = {id(n) for c in work.facts.calls for a in c.node.args if a.keyword is not None and
              a.keyword.value == "map_location" for n in m.findall(a.value, m.Name())}
    reads = [node for name, scope, _line, node in work.facts.reads if name == binding.target and
             (scope is binding.scope or not binding.scope.name)]
    return bool(reads) and all(id(node) in places for node in reads)


def devices(work: _Work) -> None:
    """``device = torch.device(...)`` -> ``state = ddpkit.init(...)`` and ``device = state.device``; a device
    chosen in an ``if`` / ``else``: one init above it (:func:`_chosen`)."""
    facts = work.facts
    visible.visible_devices(work)
    chosen = [b for choice in _choices(work) for b in _chosen(work, *choice)]
    found = [b for b in facts.bindings if b.stmt is not None and is_device(b.value, b.target, facts.aliases)
             and b not in chosen and not _followed(b) and not _loading_only(work, b)]
    upgraded = _upgrades(work, found)
    found = [b for b in found if all(b is not u for _, u in upgraded.values())]
    found = [b for b in found if not _fallback(work, b, found) and not _rewrapped(work, b, found)]
    for b in found:
        # (the same set-up written again, a notebook's cell repeated: one init each, the same device; set 26)
        again = [o for o in found if o.target == b.target and o.scope is b.scope and o is not b and
                 work.facts.code(o.value) != work.facts.code(b.value)]
        if again:  # device = "cpu"; if torch.cuda.is_available(): device = "cuda": the first init would win
            work.leave(b.line, f"{b.target} is chosen over several lines ({', '.join(str(o.line) for o in again)})",
                       f"write it as one: {b.target} = torch.device('cuda' if torch.cuda.is_available() else "
                       "'cpu'), a switch of the script's own in the test ('cuda' if args.use_cuda and "
                       "torch.cuda.is_available() else 'cpu'), then convert again", blocks=True)
            return
    for b in found:
        small = b.stmt.body[0] if len(b.stmt.body) == 1 else None
        if isinstance(small, cst.AnnAssign) and small.value is not None and _options(work, b.stmt):
            # (an options class's default, a Tap / dataclass ``device: str = "cuda:0"``: read as ``args.device``; a
            # string stays a string, a ``torch.device`` a device: review, ``cfg.device.type``)
            args, text = init_arguments(b.value), as_string(b.value)
            work.devices.append(b)
            work.edits.expr[id(b.value)] = lambda node, a=args, t=text: cst.parse_expression(
                f"str(ddpkit.init({a}).device)" if t else f"ddpkit.init({a}).device")
            work.note(f"{b.target}: ... = {'str(' if text else ''}ddpkit.init().device{')' if text else ''}", "the "
                      "options' default device: init() starts the process group and gives each rank its own (a "
                      "--device given on the command line wins)", b.line)
            continue
        if len(b.stmt.body) != 1 or not isinstance(b.stmt.body[0], cst.Assign) \
                or len(b.stmt.body[0].targets) != 1:
            work.leave(b.line, "the device set-up shares its line with other statements: left as it is",
                       f"put {b.target} = ... on a line of its own, then convert again", blocks=True)
            continue
        assert b.value is not None
        args = "" if id(b) in upgraded else init_arguments(b.value)  # (the accelerator when there is one)
        if b.target.startswith("self."):
            work.devices.append(b)
            work.edits.expr[id(b.value)] = lambda node, a=args: cst.parse_expression(f"ddpkit.init({a}).device")
            work.note(f"{b.target} = ddpkit.init().device", "ddpkit.init() starts the process group and "
                      "gives each rank its own device", b.line)
            continue
        work.devices.append(b)
        flag = flag_of(b.value)
        if flag is not None:  # (an InfoGAN's ``torch.device(args.device) if torch.cuda.is_available() else ...``)
            work.keep(b.line, f"{work.facts.code(flag)} is not read", "where a GPU is available init() "
                      "gives each rank its own (the GPUs a run may use are the launch's: CUDA_VISIBLE_DEVICES); a "
                      "flag naming the CPU there is not read: launch with --device cpu for that")
        init = f"{work.state} = ddpkit.init({args})"
        read = f"{b.target} = {work.state}.device" + (".type" if as_string(b.value) else "")
        if as_string(b.value) and ":" in (text_of(b.value) or ""):  # ``'cuda:0'``: its index may be read
            read = f"{b.target} = str({work.state}.device)"  # (AGCRN's ``set_device(int(args.device[5]))``)
        # (what the init's own arguments read: ``torch.device(args.device) if ...`` reads ``args`` for no cpu=)
        given: Any = cst.parse_expression(f"f({args})")
        early = _first_ddpkit_use(work, b.scope, b.line, names_in(b.value) & set().union(
            *(names_in(a.value) for a in given.args)))
        if early is None and args and b.scope.name:
            _at_import(work, b)  # (a print at the module's top runs at import, before this function's init)
        if early is None:
            work.edits.replace[id(b.stmt)] = [init, read]
        else:  # a loader or a print above would start ddpkit with the defaults first: start it there, as asked
            work.edits.before.setdefault(id(early.stmt), []).append(init)
            work.edits.replace[id(b.stmt)] = [read]
        guard = work._guard(b.stmt)  # (bound under ``if args.no_cuda:`` only: ``state`` may be unbound below)
        if guard is None or main_guard(work.facts.module.code_for_node(guard.test)):
            work.inits.append(b.scope)
        work.init_lines.setdefault(id(b.scope), (early.line if early is not None else b.line, args))
        said = " (str(): the script's device is a string with the GPU's index, which it may read)" if "str(" in read \
            else " (.type: the script's device is a string, and it may be tested as one)" if as_string(b.value) else ""
        work.note(f"{b.target} = ... -> {init}; {read}", "init() starts the process group and gives each rank its "
                  "own device" + said, b.line)


def _options(work: _Work, stmt: cst.CSTNode) -> bool:
    """``stmt`` is a statement of the body of a class of options (a Tap, a pydantic model, a dataclass, a class
    named ``...Args`` / ``...Config``): a default the command line may override, not a helper's own pin (review)."""
    for c in m.findall(work.facts.module, m.ClassDef()):
        if isinstance(c, cst.ClassDef) and isinstance(c.body, cst.IndentedBlock) and \
                any(s is stmt for s in c.body.body):
            bases = {(dotted(a.value) or "").rsplit(".", 1)[-1] for a in c.bases}
            decorated = {(dotted(d.decorator) or dotted(getattr(d.decorator, "func", None)) or "").rsplit(".", 1)[-1]
                         for d in c.decorators}
            return bool(bases & OPTION_BASES or "dataclass" in decorated or c.name.value.endswith(OPTION_NAMES))
    return False


OPTION_BASES = {"Tap", "BaseModel", "BaseSettings", "Namespace"}
OPTION_NAMES = ("Args", "Arguments", "Config", "Options", "Params", "Settings", "Hparams", "HParams", "CFG", "Cfg",
                "Conf", "Opt", "Opts")  # (a Kaggle notebook's ``class CFG:``, review 26)


def _fallback(work: _Work, b: Binding, found: list[Binding]) -> bool:
    """``else: args.device = 'cpu'`` under ``if torch.cuda.is_available():`` (AGCRN), beside an accelerator's
    device converted: the CPU when there is no accelerator is ddpkit.init()'s choice too: kept as it is, said."""
    kinds = [kind_of(text_of(o.value) or "") for o in found if o is not b and o.value is not None]
    if b.value is None or kind_of(text_of(b.value) or "") != "cpu" or "accelerator" not in kinds:
        return False
    for node in m.findall(work.facts.module, m.If()):
        assert isinstance(node, cst.If)
        negated = isinstance(node.test, cst.UnaryOperation) and isinstance(node.test.operator, cst.Not)
        inner = node.test.expression if isinstance(node.test, cst.UnaryOperation) else node.test
        block = node.body if negated else node.orelse.body if isinstance(node.orelse, cst.Else) else None
        if available(inner) and isinstance(block, cst.IndentedBlock) and any(s is b.stmt for s in block.body):
            work.keep(b.line, f"{b.target} = ... (the CPU when there is no accelerator) left as it is",
                      "ddpkit.init() makes the same choice")
            work.devices.append(b)  # (read as converted: a model moved to it is on ddpkit's device)
            return True
    return False


def _rewrapped(work: _Work, b: Binding, found: list[Binding]) -> bool:
    """``device = torch.device(device)`` below ``device = "cuda" if ... else "cpu"`` (hkproj's transformer: the
    string chosen, printed, then made a device): the choice converts, and this line becomes ``state.device``."""
    value = b.value
    if "." in b.target:  # (``self.device``: its choice becomes ``ddpkit.init().device``, no state name: review)
        return False
    if not (isinstance(value, cst.Call) and (resolve(dotted(value.func), work.facts.aliases) or "") == "torch.device"
            and len(value.args) == 1 and dotted(value.args[0].value) == b.target and b.stmt is not None and
            len(b.stmt.body) == 1 and isinstance(b.stmt.body[0], cst.Assign)):
        return False
    if not any(o.target == b.target and o.scope is b.scope and o.line < b.line and o is not b for o in found):
        return False
    work.edits.replace[id(b.stmt)] = [f"{b.target} = {work.state}.device"]
    work.devices.append(b)
    work.note(f"{b.target} = torch.device({b.target}) -> {b.target} = {work.state}.device", "the choice above "
              "became ddpkit's device (as text there, for the lines that read it as one)", b.line)
    return True


def _upgrades(work: _Work, found: list[Binding]) -> dict[int, tuple[Binding, Binding]]:
    """``DEVICE = 'cpu'`` then ``if torch.cuda.is_available(): DEVICE = 'cuda'`` (TextAugmentation-GPT2): one
    choice over two lines, the accelerator when there is one, as ddpkit.init() makes it. The ``if`` goes (its
    only line removed); keyed by the first binding's id: (it, the one in the ``if``)."""
    ifs = [n for n in m.findall(work.facts.module, m.If()) if isinstance(n, cst.If) and n.orelse is None and
           available(n.test) and isinstance(n.body, cst.IndentedBlock) and len(n.body.body) == 1]
    pairs: dict[int, tuple[Binding, Binding]] = {}
    for b in found:
        later = [o for o in found if o.target == b.target and o.scope is b.scope and o is not b]
        if len(later) != 1 or later[0].line < b.line or b.value is None or later[0].value is None or \
                kind_of(text_of(b.value) or "") != "cpu" or kind_of(text_of(later[0].value) or "") != "accelerator":
            continue
        # (the ``if`` a statement beside the first binding: one nested in ``if args.use_cuda:`` keeps a switch)
        beside = next((blk.body for blk in [work.facts.module, *m.findall(work.facts.module, m.IndentedBlock())]
                       if isinstance(blk, (cst.Module, cst.IndentedBlock)) and any(st is b.stmt for st in blk.body)),
                      ())
        if any(n.body.body[0] is later[0].stmt and any(n is st for st in beside) for n in ifs) and \
                later[0].stmt is not None and len(later[0].stmt.body) == 1:  # (``DEVICE = 'cuda'; ...``: kept)
            work.edits.remove.add(id(later[0].stmt))
            work.note(f"if ...is_available(): {b.target} = ... removed", "ddpkit.init() picks the accelerator when "
                      "there is one, as this choice did", later[0].line)
            pairs[id(b)] = (b, later[0])
            work.devices.append(later[0])  # (converted: a model moved to it is on ddpkit's device)
    return pairs


STARTS_DDPKIT = ("print", "pprint.pprint", "pprint.pp", "torch.utils.data.DataLoader",
                 "torch.utils.tensorboard.SummaryWriter", "torch.utils.tensorboard.writer.SummaryWriter", *PROGRESS)


def _first_ddpkit_use(work: _Work, scope: Scope, line: int, args: set[str]) -> Any:
    """The first statement above the device set-up at ``line``, in its block, whose converted call starts ddpkit
    (with the defaults: ``cpu=`` would come too late), when the init's arguments (``args``) are bound by then;
    else None."""
    for call in work.facts.calls:
        # (under ``if __name__ == "__main__":`` as the device set-up: the same block, every path)
        tests = [t for t in call.tests if "__main__" not in t]
        if call.scope is not scope or call.line >= line or not (call.name in STARTS_DDPKIT or _starts_within(
                work, call)) or call.stmt is None or call.loops or tests:
            continue
        bound = {b.target for b in work.facts.bindings if b.line < call.line and (b.scope is scope or
                                                                                   not b.scope.name)}
        late = {b.target for b in work.facts.bindings if b.target in args and "." in b.target and b.line >= call.line}
        if all(a in bound or a in work.facts.aliases for a in args if "." not in a) and not late - bound:
            return call  # (not ``args.use_cuda = ...`` set below the loader: the init there would read it unset)
        if call.tests:  # in the ``__main__`` block, before its switch is read: the init stays at the set-up
            return None
        if not {a for a in args if "." not in a} - {"torch"} - _availability(work, args):
            return None  # (``use_cuda = torch.cuda.is_available()``: the defaults choose the same)
        if args - {"torch"}:  # the switch is read later than that: cpu= would come too late, and say nothing
            work.leave(call.line, f"this line starts ddpkit (with the defaults) before the device set-up at line "
                       f"{line} can say cpu=", f"move the device set-up (and what it reads) above line "
                       f"{call.line}, then convert again", blocks=True)
        return None
    return None




def _starts_within(work: _Work, call: Any) -> bool:
    """``call`` runs a function of this file that makes such a call itself (a homework's ``train_loader =
    get_loaders(16)`` above ``device = ...``, its DataLoader a ddpkit.data_loader once converted: set 26, the
    init below it with ``cpu=`` came too late, and its flag was not read)."""
    target = flow.callee(work.facts, call)
    return target is not None and not target[0].cls and any(
        c.scope is target[0] and c.name in STARTS_DDPKIT and c.name != "print" for c in work.facts.calls)


def _at_import(work: _Work, b: Binding) -> None:
    """A call at the module's own level (not under ``if __name__ == "__main__":``) that starts ddpkit once converted
    (``print(torch.__version__)``): it runs at import, before the function's ``init(cpu=...)``, which then finds
    ddpkit started with the defaults (on a GPU host the script's CPU switch is lost). Listed (review 34)."""
    top = next((c for c in work.facts.calls if not c.scope.name and not c.tests and not c.loops and
                c.name in STARTS_DDPKIT and c.stmt is not None), None)
    if top is not None:
        work.leave(top.line, f"this line starts ddpkit at import, with the defaults, before the device set-up of "
                   f"{b.scope.name}() at line {b.line} can say cpu=: there the script's CPU switch would be lost",
                   f"move it into {b.scope.name}() below the device set-up, then convert again")


def _availability(work: _Work, args: set[str]) -> set[str]:
    """The names among ``args`` bound only to ``torch.cuda.is_available()`` (x-vector's ``use_cuda``): no user's
    choice in them, what ``ddpkit.init()`` chooses by default."""
    found = set()
    for name in args:
        bound = [b.value for b in work.facts.bindings if b.target == name]
        if bound and all(isinstance(v, cst.Call) and not v.args and
                         resolve(dotted(v.func), work.facts.aliases) == "torch.cuda.is_available" for v in bound):
            found.add(name)
    return found


def _chain(node: cst.If) -> tuple[list[cst.BaseExpression], list[cst.BaseSuite], bool]:
    """An ``if`` / ``elif`` / ``else`` chain's tests, its blocks in order, and whether it ends in an ``else``."""
    tests: list[cst.BaseExpression] = []
    blocks: list[cst.BaseSuite] = []
    branch: Any = node
    while isinstance(branch, cst.If):
        tests.append(branch.test)
        blocks.append(branch.body)
        branch = branch.orelse.body if isinstance(branch.orelse, cst.Else) else branch.orelse
    return tests, blocks + ([branch] if branch is not None else []), branch is not None


def _choices(work: _Work) -> list[tuple[cst.If, list[cst.BaseExpression], list[Binding]]]:
    """Each ``if`` / ``elif`` / ``else`` chain whose every branch binds one name to a device (CPU or an
    accelerator) on its own line: the chain, its tests and those bindings, in order. (A chain without an
    ``else`` has a path where the device is not chosen there: not one of these.)"""
    facts = work.facts
    found: list[tuple[cst.If, list[cst.BaseExpression], list[Binding]]] = []
    elifs: set[int] = set()
    for node in m.findall(facts.module, m.If()):
        assert isinstance(node, cst.If)
        elifs.add(id(node.orelse))
        tests, blocks, ends_in_else = _chain(node)
        if id(node) in elifs or not ends_in_else:
            continue
        picks = [[b for b in facts.bindings if b.value is not None and _kind(b.value)
                  and any(b.stmt is s for s in block.body)] for block in blocks]
        if all(len(p) == 1 for p in picks) and len({p[0].target for p in picks}) == 1:
            found.append((node, tests, [p[0] for p in picks]))
    return found


def _kind(value: Any) -> str:
    """"cpu" or "accelerator" for a device a branch binds; an accelerator whenever one is available, else the CPU
    (``torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')``, in each branch of a ``multigpu`` switch)
    is ddpkit's own choice, read as "accelerator"; "" for anything else."""
    if isinstance(value, cst.Call) and dotted(value.func) in ("torch.device", "device") and len(value.args) == 1:
        value = value.args[0].value
    if isinstance(value, cst.IfExp) and available(value.test) and not isinstance(value.orelse, cst.IfExp) and \
            kind_of(text_of(value.body) or "") == "accelerator" and kind_of(text_of(value.orelse) or "") == "cpu":
        return "accelerator"
    return kind_of(text_of(value) or "")


def _chosen(work: _Work, node: cst.If, tests: list[cst.BaseExpression], picks: list[Binding]) -> list[Binding]:
    """One ``state = ddpkit.init(...)`` above the chain (every path needs the state, not only the branch that
    bound it), and ``device = state.device`` in each branch; the chain itself goes when it did nothing else.
    The bindings converted, or none (a CPU branch between two accelerator ones: the switch is not one test)."""
    kinds = [_kind(b.value) for b in picks]
    first = kinds.index("cpu") if "cpu" in kinds else len(kinds)
    cpu_tail = first > 0 and all(k == "cpu" for k in kinds[first:])  # (pyg's cuda / elif mps: cpu / else cpu)
    if not cpu_tail and (kinds.count("cpu") > 1 or "cpu" in kinds[1:-1]):
        return []
    code = cst.Module(body=[]).code_for_node
    if "cpu" not in kinds or cpu_tail and all(available(t) for t in tests[:first]):
        args = ""  # an accelerator whenever there is one: ddpkit's own choice
    elif kinds[0] == "cpu":
        args = cpu_when(tests[0], negate=False)
    else:  # the CPU when no test before the first CPU branch holds
        before = tests[:first]
        args = cpu_when(before[0] if len(before) == 1 else cst.parse_expression(
            " or ".join(code(t) if isinstance(t, (cst.Name, cst.Attribute, cst.Call)) else f"({code(t)})"
                        for t in before)), negate=True)
    target, scope, line = picks[0].target, picks[0].scope, picks[0].line - 1
    strings = all(as_string(b.value) for b in picks)  # ``device = "cuda"`` / ``"cpu"``: kept a string
    init, read = f"{work.state} = ddpkit.init({args})", f"{target} = {work.state}.device" + (".type" if strings else "")
    early = _first_ddpkit_use(work, scope, line, set().union(*(names_in(t) for t in tests)))
    only = all(len(block.body) == 1 for block in _chain(node)[1])
    if early is not None:  # a loader or a print above would start ddpkit with the defaults first
        work.edits.before.setdefault(id(early.stmt), []).append(init)
    if only:
        work.edits.replace[id(node)] = ([] if early is not None else [init]) + [read]
    else:
        if early is None:
            work.edits.before.setdefault(id(node), []).append(init)
        for b in picks:
            work.edits.replace[id(b.stmt)] = [read]
    work.devices.extend(picks)
    work.inits.append(scope)
    work.init_lines.setdefault(id(scope), (early.line if early is not None else line, args))
    work.note(f"{target} chosen in an if / else -> {init} above it; {read} on every path", "init() starts the "
              "process group and gives each rank its own device; every path needs the state, not one branch",
              picks[0].line)
    return picks


def returning(work: _Work) -> frozenset[str]:
    """The module-level functions that return a device set-up converted here (``def get_device(): if
    torch.cuda.is_available(): ... return device``): another module's ``device = utils.get_device()`` is then
    ddpkit's device (crossing.devices)."""
    return frozenset(scope.name for scope, value in work.facts.returns if scope.name and "." not in scope.name and
                     (any(d.target == dotted(value) and d.scope is scope for d in work.devices) or
                      any(s is scope for s in work.device_functions)))

