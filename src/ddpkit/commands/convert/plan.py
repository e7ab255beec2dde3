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
    batchstats,
    batchwide,
    calledorder,
    choices,
    counted,
    device,
    devicehelper,
    devicekeys,
    gradpen,
    handmade,
    lastbatch,
    lazy,
    loaders,
    losses,
    methods,
    models,
    moments,
    numpydraws,
    parallel,
    partners,
    probed,
    prompts,
    quantized,
    randomdata,
    removals,
    reread,
    retained,
    rules,
    seeded,
    shownbatch,
    splits,
    stepped,
    summedterms,
    tokens,
    trackers,
    unwrapped,
    wholebatch,
    writes,
)
from ddpkit.commands.convert.apply import Edits, first_use, rewrite
from ddpkit.commands.convert.crossing import EVAL, Ask, Crossing
from ddpkit.commands.convert.packages import full_name
from ddpkit.commands.convert.scan import Binding, Call, Facts, Scope, parse, scan

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
    # this module's functions whose returned device became ddpkit's (``def get_device(): ... return device``)
    devices: frozenset[str] = frozenset()

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
        anchor = _import_place(wrapper, work) if "ddpkit" not in facts.aliases or _imported_late(work) else None
        # (``import ddpkit as dk`` too: the edits say ``ddpkit.``; or the script's own import below their first use)
        text = methods.name_methods(rewrite(wrapper, work.edits, anchor), methods.loss_methods(work))
        text = gradpen.keep_batchnorm(text, gradpen.differentiated_twice(work))  # (a gradient penalty's model)
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
                sorted(work.kept, key=lambda e: e.line), work.asks, work.done, work.trains, device.returning(work))


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



def _imported_late(work: _Work) -> bool:
    """The script imports ddpkit itself only below the first statement the edits make use it (a user's ``import
    ddpkit`` written above the line a fix asked for, below ``logger = logging.getLogger(...)``)."""
    facts = work.facts
    defined = {s.name.value for s in facts.module.body if isinstance(s, (cst.FunctionDef, cst.ClassDef))}
    use = first_use(facts.module, work.edits, defined)
    order = {id(s): i for i, s in enumerate(facts.module.body)}
    own = [order[id(s)] for s in facts.imports if "ddpkit" in facts.code(s) and id(s) in order]
    return use is not None and id(use) in order and not any(i < order[id(use)] for i in own)


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
        self.per_process: set[int] = set()  # the training DataLoader calls whose batch stays per process (batch.py)
        self.crossing = crossing or Crossing()
        self.asks: list[Ask] = []  # what another module of the project should convert for this one
        self.done: list[str] = []  # the crossing's wants converted here
        self.trains = False  # a training DataLoader converted here (a project's loop elsewhere may be fed by it)
        self.plain: set[int] = set()  # the DataLoader calls left plain (each rank reads all of it)
        self.sharded: set[int] = set()  # the DataLoader calls made training ddpkit.data_loaders
        self.fed: set[int] = set()  # the loops (nodes' ids) over a training loader another module made one (imported)
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
        self.device_functions: list[Scope] = []  # functions whose returns became ddpkit's device (devicehelper.py)
        self._ifs: list[cst.If] | None = None  # every `if` of the script, outermost first (found once)
        ours = all(rules.bound_to_init(b) for b in facts.bindings if b.target == "state")
        self.state = "state" if ours else "ddp_state"  # a script's own ``state`` keeps its name

    def note(self, what: str, why: str, line: int) -> None:
        self.log.append(Edit(line, what, why))

    def keep(self, line: int, what: str, why: str) -> None:
        """A line left as it is because that is right for N processes (no edit, nothing to do); said once."""
        if not any(k.line == line and k.what == what for k in self.kept):  # (two loaders over one loop)
            self.kept.append(Edit(line, what, why))

    def import_line(self) -> int:
        return max(self.facts.import_lines, default=1)

    def leave(self, line: int, what: str, fix: str, blocks: bool = False) -> None:
        self.left.append(Left(line, what, fix, blocks))

    def decide(self) -> None:
        if not self._convertible():
            return
        device.devices(self)
        devicekeys.device_keys(self)
        devicehelper.device_functions(self)
        parallel.undo(self)
        models.models(self)
        partners.partners(self)
        parallel.modules(self)
        loaders.loaders(self)
        stepped.answer(self)
        unwrapped.unwrapped(self)
        methods.self_trained(self)
        methods.forward_called(self)
        batchstats.own_batch_norm(self)
        batchstats.model_optimizer(self)
        splits.splits(self, any(c.name in (loaders.LOADER, "ddpkit.data_loader") for c in self.facts.calls))
        randomdata.random_data(self)
        moments.moments(self)
        probed.probed(self)
        losses.summed_loss(self)
        summedterms.summed_terms(self)
        losses.step_loss_shown(self)
        seeded.seeded_noise(self)
        numpydraws.numpy_draws(self)
        retained.retained_graph(self)
        lastbatch.last_batch_size(self)
        batchwide.whole_batch_loss(self)
        tokens.token_mean_loss(self)
        batchwide.contrastive_loss(self)
        counted.count_normalised_loss(self)
        rules.outputs(self)
        rules.class_reads(self)
        removals.removals(self)
        writes.writes(self)
        trackers.trackers(self)
        choices.rank_chosen_saves(self)
        reread.reread(self)
        calledorder.tell(self)
        lazy.lazy_layers(self)
        quantized.quantized(self)
        wholebatch.whole_batch(self)
        shownbatch.shown_batches(self)
        shownbatch.peeks(self)
        prompts.prompts(self)

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

    # the model: what an optimizer trains (models.py); the other rules reach these through the plan
    def _wrap(self, binding: Binding, optimizer: Call | None) -> bool:
        return models.wrap(self, binding, optimizer)

    def _unconditional(self, binding: Binding) -> Binding:
        return models.unconditional(self, binding)

    def _source(self, binding: Binding) -> Binding:
        return models.source(self, binding)

    def _model_binding(self, target: str, call: Call) -> Binding | None:
        return models.model_binding(self, target, call)

    def _guard(self, stmt: cst.CSTNode | None) -> cst.If | None:
        """The innermost ``if`` that holds ``stmt`` (None: none does)."""
        if stmt is None:
            return None
        if self._ifs is None:
            self._ifs = [node for node in m.findall(self.facts.module, m.If()) if isinstance(node, cst.If)]
        return next((node for node in reversed(self._ifs) if models.within(stmt, node)), None)
