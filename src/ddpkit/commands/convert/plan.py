"""What ``ddpkit convert`` changes in a script, and what it leaves to the user: the decisions over the scan.

Each rewrite is an :class:`Edit` (line, what, why); what cannot be converted safely is a :class:`Left` (line,
what, what to do). A ``Left`` with ``blocks=True`` means the result would run and train differently (a
training loader of unknown role, hand-fed batches, a script already distributed by hand): nothing is written
then. The loaders are :mod:`ddpkit.commands.convert.loaders`'s, the rules for output (print, logging,
TensorBoard, tqdm, saving) :mod:`ddpkit.commands.convert.rules`'s.

Example::

    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nmodel = Net()\\n"
    ...          "opt = torch.optim.SGD(model.parameters(), lr=0.1)\\n"
    ...          "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\\n    loss(model(x), y).backward()\\n")
    >>> [e.what for e in p.edits][1:3]
    ['model = ddpkit.prepare_model(...)', 'batch_size=8 -> global_batch_size=8']
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import libcst as cst
from libcst import matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from ddpkit.commands.convert import (
    batch,
    batchstats,
    branches,
    choices,
    crossing,
    device,
    handed,
    handmade,
    holders,
    inherited,
    inits,
    listed,
    loaders,
    methods,
    moments,
    parallel,
    partners,
    removals,
    reread,
    rules,
    splits,
    stepped,
    tokens,
    trained,
    unwrapped,
    writes,
)
from ddpkit.commands.convert.apply import Edits, first_use, rewrite
from ddpkit.commands.convert.crossing import EVAL, MODEL, Ask, Crossing
from ddpkit.commands.convert.flow import binding_of, callee, part_of
from ddpkit.commands.convert.packages import full_name
from ddpkit.commands.convert.scan import Binding, Call, Facts, Scope, dotted, imported_from, parse, resolve, scan

HAND_DISTRIBUTED = ("torch.distributed.", "torch.nn.parallel.", "torch.nn.DataParallel", "torch.multiprocessing.")
# of those, what only says how loader workers start or share tensors: no process of training is started by it
WORKER_SETUP = ("torch.multiprocessing.set_start_method", "torch.multiprocessing.set_sharing_strategy",
                "torch.multiprocessing.get_start_method", "torch.multiprocessing.freeze_support")
# DataParallel's own pieces, in one process over its GPUs (a vendored sync-BN for nn.DataParallel, deeplab's): no
# process of training is started by them, and prepare_model turns that BatchNorm into SyncBatchNorm
DATA_PARALLEL_PIECES = ("torch.nn.parallel._functions.", "torch.nn.parallel.comm.", "torch.nn.parallel.scatter_gather.",
                        "torch.nn.parallel.replicate", "torch.nn.parallel.parallel_apply")


@dataclasses.dataclass(frozen=True)
class Edit:
    line: int
    what: str
    why: str


@dataclasses.dataclass(frozen=True)
class Left:
    line: int
    what: str
    fix: str
    blocks: bool = False


@dataclasses.dataclass
class Plan:
    source: str
    edits: list[Edit]
    left: list[Left]
    text: str  # the converted script (the source itself when nothing changes or a Left blocks)
    kept: list[Edit] = dataclasses.field(default_factory=list)  # left as it is, rightly: said, not to do
    asks: list[Ask] = dataclasses.field(default_factory=list)  # names another module of the project builds
    done: list[str] = dataclasses.field(default_factory=list)  # the names asked of this one, converted
    trains: bool = False  # a training DataLoader of this file became a ddpkit.data_loader

    @property
    def refused(self) -> bool:
        return any(left.blocks for left in self.left)


def plan(source: str, per_process_batch: bool = False, crossing: Crossing | None = None) -> Plan:
    """Scan ``source`` (raises :class:`libcst.ParserSyntaxError` on a file that is not Python) and decide;
    ``per_process_batch``: a training loader's ``batch_size`` stays per process (else it is the global batch);
    ``crossing``: in a project, what other modules need of this one and did for it (:mod:`.crossing`)."""
    single = handmade.single_device(source)  # a --local_rank script: its single-device path, converted
    scanned = single if single is not None else source
    wrapper = parse(scanned)
    facts = scan(wrapper)
    facts.own = crossing.own if crossing is not None else frozenset()
    if crossing is not None:  # (``from .trainer import X``: the project's full name, through packages' re-exports)
        facts.aliases = {k: full_name(v, crossing.package, crossing.exported) for k, v in facts.aliases.items()}
        # (``from . import data``, ``from pkg import data``: a module, read as ``import pkg.data as data`` is)
        facts.modules.update({k: v for k, v in facts.aliases.items()
                              if v in crossing.modules and k not in facts.modules})
        facts.exported = crossing.exported
    facts.steps = stepped.marked(facts, crossing)  # (another module's training step run here)
    facts.eval_steps = stepped.marked(facts, crossing, EVAL)
    work = _Work(facts, per_process_batch, crossing)
    work.decide()
    text = scanned
    if work.edits and not any(left.blocks for left in work.left):
        anchor = _import_place(wrapper, work) if "ddpkit" not in facts.aliases else None  # (``import ddpkit as
        # dk`` too: the edits say ``ddpkit.``)
        text = methods.name_methods(rewrite(wrapper, work.edits, anchor), methods.loss_methods(work))
    said = [e for e in work.log if "prepare_model(" in e.what]
    if said and text.count("prepare_model(") < len(said) and text != source:  # said, and lost to another edit
        work.leave(said[0].line, "convert said it prepares the model here, but its edits lost the wrap (a case it "
                   "does not handle)", "wrap the model yourself where it is built: model = ddpkit.prepare_model("
                   "model), then convert again", blocks=True)
        text = source
    if single is not None:
        _undone(work, source, single)
        text = source if any(left.blocks for left in work.left) else text
    return Plan(source, sorted(work.log, key=lambda e: e.line), sorted(work.left, key=lambda e: e.line), text,
                sorted(work.kept, key=lambda e: e.line), work.asks, work.done, work.trains)


def _undone(work: _Work, source: str, single: str) -> None:
    """The lines said of the single-device version, said of the script's own lines; and that version said."""
    lines = handmade.line_map(source, single)

    def moved(line: int) -> int:
        return lines[line] if 0 < line < len(lines) else line

    def said(text: str) -> str:  # "the optimizer at line 15": the script's own line
        return re.sub(r"\bline (\d+)", lambda found: f"line {moved(int(found.group(1)))}", text)

    work.log = [dataclasses.replace(e, line=moved(e.line), what=said(e.what), why=said(e.why)) for e in work.log]
    work.left = [dataclasses.replace(x, line=moved(x.line), what=said(x.what), fix=said(x.fix)) for x in work.left]
    work.kept = [dataclasses.replace(e, line=moved(e.line), what=said(e.what), why=said(e.why)) for e in work.kept]
    first = next((n for n, text in enumerate(source.splitlines(), 1) if "local_rank" in text and
                  re.search(r"\b(if|elif|else)\b", text)), 1)
    work.note("the hand-written distribution taken out: each test of local_rank decided for -1",
              "run without a launcher (local_rank -1) the script is a single-device one: that path is kept and "
              "converted (DistributedSampler, DistributedDataParallel and init_process_group went with the other "
              "branches); ddpkit launch passes no --local_rank", first)


def _handed_out(call: Call) -> bool:
    """``return torch.optim.Adam(self.parameters(), ...)``: a method that returns the optimizer it makes (one kept
    as ``self.opt`` in ``__init__`` is the class's own)."""
    first = call.stmt.body[0] if call.stmt is not None else None
    return isinstance(first, cst.Return) and first.value is call.node


def _import_place(wrapper: MetadataWrapper, work: _Work) -> cst.CSTNode | None:
    """Add ``import ddpkit`` after the script's last import above its first use of ddpkit (its last import
    overall may come below that use); with no import above it, right above the use. The import it follows."""
    facts = work.facts
    defined = {s.name.value for s in facts.module.body if isinstance(s, (cst.FunctionDef, cst.ClassDef))}
    use = first_use(facts.module, work.edits, defined)
    order = {id(s): i for i, s in enumerate(facts.module.body)}
    above = [s for s in facts.imports if use is None or order[id(s)] < order[id(use)]]
    place = above[-1] if above else use
    line = wrapper.resolve(PositionProvider)[place].start.line if place is not None else 1
    if above or use is None:
        work.edits.imports.append("import ddpkit")
    else:
        work.edits.before.setdefault(id(use), []).insert(0, "import ddpkit")
    why = "the converted calls need it"
    if place is not None and facts.imports and place is not facts.imports[-1]:
        why += ", above their first use (the script imports more below it)"
    work.note("import ddpkit", why, line)
    return above[-1] if above else None


class _Work:
    """One plan being made: the facts, the edits so far and the report."""

    def __init__(self, facts: Facts, per_process_batch: bool = False, crossing: Crossing | None = None):
        self.facts = facts
        self.per_process_batch = per_process_batch
        self.crossing = crossing or Crossing()
        self.asks: list[Ask] = []  # what another module of the project should convert for this one
        self.done: list[str] = []  # the crossing's wants converted here
        self.trains = False  # a training DataLoader converted here (a project's loop elsewhere may be fed by it)
        self.plain: set[int] = set()  # the DataLoader calls left plain (each rank reads all of it)
        self.sharded: set[int] = set()  # the DataLoader calls made training ddpkit.data_loaders
        self.reduced: list[Any] = []  # evaluation loops whose sums a ddpkit.reduce follows
        self.edits = Edits()
        self.log: list[Edit] = []
        self.left: list[Left] = []
        self.kept: list[Edit] = []
        self.models: list[Binding] = []  # the bindings wrapped (or already wrapped) in prepare_model
        self.lists: set[str] = set()  # lists whose every model is wrapped where it is made (listed.py)
        self.inits: list[Scope] = []  # where the plan binds the state (``state = ddpkit.init()``)
        self.init_lines: dict[int, tuple[int, str]] = {}  # a scope's id -> (the init's line, its arguments)
        self.devices: list[Binding] = []  # the device set-ups converted
        self._ifs: list[cst.If] | None = None  # every `if` of the script, outermost first (found once)
        ours = all(rules.bound_to_init(b) for b in facts.bindings if b.target == "state")
        self.state = "state" if ours else "ddp_state"  # a script's own ``state`` keeps its name

    def note(self, what: str, why: str, line: int) -> None:
        self.log.append(Edit(line, what, why))

    def keep(self, line: int, what: str, why: str) -> None:
        """A line left as it is because that is right for N processes (no edit, nothing to do)."""
        self.kept.append(Edit(line, what, why))

    def import_line(self) -> int:
        return max(self.facts.import_lines, default=1)

    def leave(self, line: int, what: str, fix: str, blocks: bool = False) -> None:
        self.left.append(Left(line, what, fix, blocks))

    def decide(self) -> None:
        if not self._convertible():
            return
        device.devices(self)
        parallel.undo(self)
        self._models()
        partners.partners(self)
        parallel.modules(self)
        loaders.loaders(self)
        stepped.answer(self)
        unwrapped.unwrapped(self)
        batchstats.own_batch_norm(self)
        batchstats.model_optimizer(self)
        splits.splits(self, any(c.name in (loaders.LOADER, "ddpkit.data_loader") for c in self.facts.calls))
        moments.moments(self)
        batch.summed_loss(self)
        batch.whole_batch_loss(self)
        tokens.token_mean_loss(self)
        batch.contrastive_loss(self)
        rules.outputs(self)
        removals.removals(self)
        writes.writes(self)
        choices.rank_chosen_saves(self)
        reread.reread(self)

    def _convertible(self) -> bool:
        for call in self.facts.calls:
            if call.name and call.name.startswith(HAND_DISTRIBUTED) and not parallel.single_process(call.name) \
                    and call.name not in WORKER_SETUP and not call.name.startswith(DATA_PARALLEL_PIECES):
                self.leave(call.line, f"{call.name}: the script is already distributed by hand",
                           "convert the single-device version, or replace the hand-written set-up with "
                           "ddpkit.init() / ddpkit.prepare_model() yourself (docs/guide.md)", blocks=True)
                return False
            if call.last == "get_worker_info":
                self.leave(call.line, "get_worker_info(): the dataset splits its stream by worker itself",
                           "remove the split (ddpkit.data_loader splits a stream across ranks and workers) and "
                           "convert again", blocks=True)
                return False
        return True

    # the model: what an optimizer trains
    def _models(self) -> None:
        for call in self.facts.calls:
            for target in trained.trained_all(self.facts, call):
                self._model_of(target, call)
        for name, kind in self.crossing.wants.items():
            if kind == MODEL and ":" in name:  # a model this file hands to a function of another (handed.py)
                handed.wrap_passed(self, name)
            elif kind == MODEL:
                self._wanted_model(name)

    def _wanted_model(self, name: str) -> None:
        """A module-level model that an optimizer in another module of the project trains: wrapped here."""
        if any(b.target == name for b in self.models):  # prepared here already, for an optimizer of this module
            self.done.append(name)
            return
        bound = [b for b in self.facts.bindings if b.target == name and b.scope.name == "" and b.value is not None
                 and not (isinstance(b.value, cst.Name) and b.value.value == "None")]  # (``model = None``: not built)
        found = inherited.wanted(self.facts, name)  # ``Exp_Basic.self.model``: a base class's
        if isinstance(found, list):  # built by a base class of another module: asked of it in turn
            inherited.asks(self, found, 1)
            if any(crossing.key(*f) in self.crossing.provided for f in found):
                self.done.append(name)
            return
        bound += [found] if found is not None else []
        bound += filter(None, [holders.wanted(self.facts, name)])  # ``Analyzer().model``: a plain object's
        if not bound:
            return
        binding = self._unconditional(self._source(bound[-1]))
        if any(b is binding for b in self.models) or self._wrap(binding, None):
            self.models.append(binding)
            self.done.append(name)

    def _model_of(self, target: str, call: Call) -> None:
        if holders.holder(self, target, call):  # ``analyzer.model`` of a plain object: where its class builds it
            return
        binding = self._model_binding(target, call) if target else None
        if binding is None and not target:
            self.leave(call.line, "the model this optimizer trains is built inside the optimizer call",
                       "build it first: model = ddpkit.prepare_model(Net()), then the optimizer over "
                       "model.parameters()", blocks=True)
        elif binding is None and (origin := imported_from(self.facts, target)):
            # the wrap belongs in the other module; asked of it when the project is converted together
            (module, name), head = origin, target.split(".")[0]
            self.asks.append(Ask(module, name, MODEL, call.line))  # whatever the answer: settle asks in rounds
            if crossing.key(module, name) in self.crossing.provided:
                self.keep(call.line, f"the optimizer over {head} left as it is", f"{head} is prepared where it is "
                          f"built, in {self.crossing.provided[crossing.key(module, name)]} (imported from {module})")
                return
            self.leave(call.line, f"the model {target!r} this optimizer trains is imported from {module}, and "
                       "convert does not follow a name from one module to another outside a project", "convert "
                       f"them together (ddpkit convert --imports SCRIPT, or a folder), or wrap it in {module} "
                       f"where it is built: {head} = ddpkit.prepare_model(...)")
        elif binding is None and (held := listed.listed(self, target, call)):  # ``for m in models``: each
            if isinstance(held, Binding) and all(b is not held for b in self.models):  # blocks of a model: it
                self.models.append(held)
                self._wrap(held, call)
        elif binding is None and handed.ask(self, target, call):  # a parameter: the files that call it wrap it
            pass
        elif binding is None and (sites := handed.passed_here(self, target, call)) and all(t for _, t in sites):
            for site, models in sites:  # ``create_optimizer(lr, net.parameters())``: what each call passes
                for model in models:
                    self._model_of(model, site)
        elif binding is None and target == "self" and _handed_out(call) and not any(
                c.last == "backward" and c.scope.cls == call.scope.cls for c in self.facts.calls):
            # a method that returns the model's optimizer and no training in the class: the script steps it
            self.keep(call.line, "an optimizer the model's own method makes over self.parameters() left as it is",
                      "the class does not train itself: the script that calls the method prepares the model, and "
                      "the method, called through the wrapper, makes it over the same parameters")
        elif binding is None and target == "self":  # a module that owns its optimizer
            self.leave(call.line, "the model this optimizer trains is the class itself (an optimizer over "
                       "self.parameters(), made in its own method)", "build the optimizer outside the class, over "
                       "the prepared model: model = ddpkit.prepare_model(Net()); opt = torch.optim.Adam(model."
                       "parameters()); and take the step where model(x) is called, through the wrapper (a "
                       "backward inside the class's own methods is not synchronised), then convert again",
                       blocks=True)
        elif binding is None and (base := inherited.inherited(self.facts, target, call)) is not None:
            inherited.wrap(self, base, call, inherited.attribute(target) or target)
        elif binding is None:
            self.leave(call.line, f"the model {target!r} this optimizer trains: where it is built was not "
                       "found", f"wrap it yourself where it is built: {target} = ddpkit.prepare_model("
                       f"{target})", blocks=True)
        elif all(b is not binding for b in self.models):
            self.models.append(binding)
            self._wrap(binding, call)

    def _model_binding(self, target: str, call: Call) -> Binding | None:
        parts = target.split(".")
        for end in range(2 if parts[0] == "self" else 1, len(parts) + 1):  # model.fc.parameters(): model
            binding = binding_of(self.facts, ".".join(parts[:end]), call.scope, call.line)
            for _ in range(3):  # (SCINet's ``self.model, lr, e = load_model(self.model, path)`` under ``if resume``)
                if binding is None or not _reloaded(binding):
                    break
                binding = binding_of(self.facts, binding.target, binding.scope, binding.line - 1)
            if binding is not None and _built(binding):
                return self._unconditional(self._source(binding))
        return None

    def _unconditional(self, binding: Binding) -> Binding:
        """A model moved again under an ``if`` (``if use_gpu: model = model.cuda()``) that a binding before it, outside
        that ``if``, built: that one is wrapped (a wrap under the ``if`` leaves the model unwrapped wherever the test
        is false: each rank then trains its own copy). A new model bound under the ``if`` stays: :mod:`.branches`
        prepares it below the ``if``."""
        guard = self._guard(binding.stmt)
        while guard is not None:
            earlier = binding_of(self.facts, binding.target, binding.scope, binding.line - 1)
            if earlier is None or not _built(earlier) or _within(earlier.stmt, guard):
                return binding
            bare = parallel.inner(binding.value, self.facts.aliases)
            if bare is None or dotted(rules.without_moves(bare)) != binding.target:
                return binding  # ``if args.pretrained: net = load(p)``: another model, prepared below the if
            binding = self._source(earlier)
            guard = self._guard(binding.stmt)
        return binding

    def _guard(self, stmt: cst.CSTNode | None) -> cst.If | None:
        """The innermost ``if`` that holds ``stmt`` (None: none does)."""
        if stmt is None:
            return None
        if self._ifs is None:
            self._ifs = [node for node in m.findall(self.facts.module, m.If()) if isinstance(node, cst.If)]
        return next((node for node in reversed(self._ifs) if _within(stmt, node)), None)

    def _source(self, binding: Binding, depth: int = 0) -> Binding:
        """Where an alias (``model, config = self.model, self.config``) got its value: the model is wrapped
        where it is built or moved, once, not in every method that reads it."""
        bare = parallel.inner(binding.value, self.facts.aliases)  # model = DataParallel(model): the one before
        alias = part_of(bare)  # ``head = model[-1]``, ``head = model.fc``: a part of the model, which is wrapped
        if alias is None or alias == binding.target and bare is binding.value or depth >= 4:
            return binding
        parts = alias.split(".")
        for end in range(len(parts), 1 if parts[0] == "self" else 0, -1):
            found = binding_of(self.facts, ".".join(parts[:end]), binding.scope, binding.line - 1)
            if found is not None and _built(found):
                return self._source(found, depth + 1)
        return binding

    def _wrap(self, binding: Binding, optimizer: Call | None) -> bool:
        """Wrap the model ``optimizer`` trains (None: an optimizer of another module) where ``binding`` builds it;
        False where it is left to the user instead."""
        value = binding.value  # None: one of several names a call's result is unpacked to (net, name = f())
        aliases = self.facts.aliases
        if _prepared(value, aliases) or any(_prepared(b.value, aliases) for b in self.facts.bindings
                                            if b.target == binding.target and b.value is not None):
            return True  # converted already
        until = optimizer.line if optimizer is not None else max((c.line for c in self.facts.calls), default=0)
        moves = [c for c in self.facts.calls if c.scope is binding.scope and c.last in ("to", "cuda")
                 and binding.line < c.line <= until and c.stmt is not None
                 and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == binding.target
                 and len(c.stmt.body) == 1 and isinstance(c.stmt.body[0], cst.Expr)
                 and self._guard(c.stmt) is self._guard(binding.stmt)]  # not one under an `if` of its own
        unread = self._unread_device([n for n in (value, *(c.node for c in moves)) if n is not None], binding)
        if unread is not None:
            self.leave(binding.line, f"the model moves to {unread.target}, set up at line {unread.line} in a form "
                       "convert does not read: prepare_model would put it on ddpkit's device and the data would "
                       f"go to {unread.target}", f"write {unread.target} = torch.device('cuda' if "
                       "torch.cuda.is_available() else 'cpu') (or with your own switch), then convert again",
                       blocks=True)
            return False
        if self._at_data_parallel(binding, until):  # ``if a: m = A() elif b: m = B()``, then ``m = DataParallel(m)``
            return True
        if branches.place(self, binding, optimizer):  # ``if resume: net = ckpt['net'] else: net = Net()``: below the if
            return True
        if inits.place(self, binding, moves):  # ``netG.apply(weights_init)`` below the build: the wrap below it
            return True
        if moves:  # ``model.to(device)`` on its own line: that line becomes the wrap
            move = moves[-1]
            self.edits.replace[id(move.stmt)] = [f"{binding.target} = ddpkit.prepare_model({binding.target})"]
            self.note(f"{binding.target}.{move.last}(...) -> {binding.target} = ddpkit.prepare_model("
                      f"{binding.target})", "prepare_model moves it to this rank's device, converts BatchNorm to "
                      "SyncBatchNorm and wraps it in DDP", move.line)
            return True
        if value is None:  # ``net, name = get_network()``: the wrap on the line below
            assert binding.stmt is not None
            self.edits.after.setdefault(id(binding.stmt), []).append(
                f"{binding.target} = ddpkit.prepare_model({binding.target})")
        elif self._moved_alias(binding, value) is not None:  # ``model = MODEL.to(d)``, then MODEL trained on
            alias = self._moved_alias(binding, value)
            assert binding.stmt is not None
            self.edits.replace[id(binding.stmt)] = [f"{binding.target} = {alias} = ddpkit.prepare_model({alias})"]
        else:
            self.edits.expr[id(value)] = lambda node: cst.parse_expression(
                f"ddpkit.prepare_model({self.facts.module.code_for_node(rules.without_moves(node))})")
        trains = f"the optimizer at line {optimizer.line}" if optimizer is not None else "an optimizer in " \
            "another module of the project"
        self.note(f"{binding.target} = ddpkit.prepare_model(...)", f"the model {trains} trains: prepare_model moves "
                  "it to this rank's device, converts BatchNorm and wraps it in DDP", binding.line)
        return True

    def _moved_alias(self, binding: Binding, value: cst.BaseExpression) -> str | None:
        """``model = MODEL.to(DEVICE)`` with ``MODEL`` read below (TextAugmentation-GPT2 hands ``MODEL`` to its
        loop): ``.to()`` returns the same module, so both names are the model; the wrap binds both."""
        inner = rules.without_moves(value)
        if inner is value or not isinstance(inner, cst.Name) or inner.value == binding.target or \
                binding.stmt is None or len(binding.stmt.body) != 1 or not isinstance(binding.stmt.body[0], cst.Assign):
            return None
        name = inner.value
        read = any(n == name and sc is binding.scope and line > binding.line for n, sc, line, _ in self.facts.reads)
        # (a module global read in a function: binding it there would make it local, UnboundLocalError)
        local = any(b.target == name and b.scope is binding.scope for b in self.facts.bindings)
        if read and not local:
            self.leave(binding.line, f"{binding.target} = {name}.to(...) is the same module as {name}, which is used "
                       f"below under that name: {name} stays unprepared (its forward outside DDP)", f"use "
                       f"{binding.target} below, or prepare {name} where it is built ({name} = "
                       f"ddpkit.prepare_model(...)), then convert again")
        return name if read and local else None

    def _at_data_parallel(self, binding: Binding, until: int) -> bool:
        """The model built under an ``if`` and wrapped in DataParallel below it, on a line under no ``if``: that line
        reaches every path, so it becomes the wrap (random-erasing's ``if arch == 'wrn': ... elif ...:`` then
        ``model = torch.nn.DataParallel(model).cuda()``). Also below the optimizer (augmix builds SGD over the
        model, then wraps it): DDP keeps the parameters the optimizer holds; not in a loop."""
        first_loop = min((lp.line for lp in self.facts.loops if lp.scope is binding.scope and lp.line > binding.line),
                         default=None)  # (a wrap line below a loop came after training: not the wrap)
        wraps = [c for c in self.facts.calls if parallel.is_wrapper(c.name) and c.scope is binding.scope and
                 binding.line < c.line and (c.line <= until or not c.loops and c.node.args and
                                            dotted(c.node.args[0].value) == binding.target and
                                            (first_loop is None or c.line < first_loop)) and
                 c.stmt is not None and id(c.stmt) in self.edits.remove and not c.tests and
                 self._guard(c.stmt) is None]
        if not wraps or self._guard(binding.stmt) is None:
            return False
        stmt, line = wraps[-1].stmt, wraps[-1].line
        self.edits.remove.discard(id(stmt))
        self.edits.replace[id(stmt)] = [f"{binding.target} = ddpkit.prepare_model({binding.target})"]
        self.log = [e for e in self.log if not (e.line == line and "DataParallel" in e.what)]
        self.note(f"{binding.target} = DataParallel({binding.target}) -> {binding.target} = ddpkit.prepare_model("
                  f"{binding.target})", "the model is built in the branches of an if above: this line reaches every "
                  "path; prepare_model wraps it once, from the launch (DataParallel or DDP)", line)
        return True

    def _returns_device(self, binding: Binding) -> bool:
        """``self.device = self._acquire_device()``: a function of the script whose returned name is a device
        set-up converted here (Informer's experiment classes)."""
        made = next((c for c in self.facts.calls if c.node is binding.value), None)
        target = callee(self.facts, made) if made is not None else None
        returned = [dotted(v) for s, v in self.facts.returns if target is not None and s is target[0]]
        return bool(returned) and all(any(d.target == r and d.scope is target[0] for d in self.devices)
                                      for r in returned if target is not None)

    def _unread_device(self, nodes: list[cst.CSTNode], model: Binding) -> Binding | None:
        """The binding of a device the model is moved to (``.to(device)``) that the device rules did not
        convert: the data would still go there while prepare_model picks ddpkit's."""
        for node in nodes:
            while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
                if node.func.attr.value == "to" and node.args:
                    name = dotted(node.args[0].value)
                    found = binding_of(self.facts, name, model.scope, model.line) if name else None
                    if found is not None and found.value is not None and found not in self.devices and \
                            not (dotted(found.value) or "").endswith(".device") and not self._returns_device(found):
                        return found
                node = node.func.value
        return None


def _reloaded(binding: Binding) -> bool:
    """The model bound again from a call handed the model itself (``model = load_model(model, path)``, ``self.model,
    lr, epoch = load_model(self.model, ...)``): the same model, loaded; its build is the binding before."""
    value = binding.whole if binding.whole is not None else binding.value
    name = (dotted(value.func) or "").rsplit(".", 1)[-1].lower() if isinstance(value, cst.Call) else ""
    # (a loader's name only: ``model = WithHead(model)``, ``torch.compile(model)`` make a new module, the build)
    return isinstance(value, cst.Call) and any(w in name for w in ("load", "restore", "resume")) and \
        any(dotted(a.value) == binding.target for a in value.args)


def _built(binding: Binding) -> bool:
    """The binding gives the name a value of the script's (``net = Net()``; ``net, name = get_network()``), not a
    parameter's or a loop variable's."""
    return binding.value is not None or binding.whole is not None


def _within(stmt: cst.CSTNode | None, node: cst.CSTNode) -> bool:
    return stmt is not None and any(found is stmt for found in m.findall(node, m.SimpleStatementLine()))


def _prepared(value: cst.BaseExpression | None, aliases: dict[str, str]) -> bool:
    """``ddpkit.prepare_model(...)``, also as ``dk.prepare_model`` or an imported ``prepare_model``."""
    return isinstance(value, cst.Call) and resolve(dotted(value.func), aliases) == "ddpkit.prepare_model"
