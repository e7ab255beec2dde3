"""What ``ddpkit convert`` changes in a script, and what it leaves to the user: the decisions over the scan.

Each rewrite is an :class:`Edit` (line, what, why); what cannot be converted safely is a :class:`Left` (line,
what, what to do). A ``Left`` with ``blocks=True`` means the result would run and train differently (a
training loader of unknown role, hand-fed batches, a script already distributed by hand): nothing is written
then. The rules for output (print, logging, TensorBoard, tqdm, saving) are :mod:`ddpkit.commands.convert.rules`.

Example::

    >>> p = plan("import torch\\nfrom torch.utils.data import DataLoader\\nmodel = Net()\\n"
    ...          "opt = torch.optim.SGD(model.parameters(), lr=0.1)\\n"
    ...          "for x, y in DataLoader(ds, batch_size=8, shuffle=True):\\n    loss(model(x), y).backward()\\n")
    >>> [e.what for e in p.edits]
    ['import ddpkit', 'model = ddpkit.prepare_model(...)', 'DataLoader -> ddpkit.data_loader (training)']
"""

from __future__ import annotations

import dataclasses

import libcst as cst
from libcst import matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from ddpkit.commands.check.rules import OPTIMIZERS
from ddpkit.commands.convert import device, flow, inits, parallel, rules
from ddpkit.commands.convert.apply import LOADER_PARAMETERS, Edits, first_use, loader_call, rewrite
from ddpkit.commands.convert.flow import binding_of, loops_reading, peek, roles_said
from ddpkit.commands.convert.scan import Binding, Call, Facts, Loop, Scope, dotted, parse, resolve, scan
from ddpkit.commands.convert.sums import sums_after

LOADER = "torch.utils.data.DataLoader"
# an evaluation loop calling these needs gradients: it cannot run under no_grad, so it is not sharded
NEEDS_GRAD = ("grad", "requires_grad_", "enable_grad", "set_grad_enabled", "backward", "vjp", "jacobian")
HAND_DISTRIBUTED = ("torch.distributed.", "torch.nn.parallel.", "torch.nn.DataParallel", "torch.multiprocessing.")


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

    @property
    def refused(self) -> bool:
        return any(left.blocks for left in self.left)


def plan(source: str) -> Plan:
    """Scan ``source`` (raises :class:`libcst.ParserSyntaxError` on a file that is not Python) and decide."""
    wrapper = parse(source)
    facts = scan(wrapper)
    work = _Work(facts)
    work.decide()
    text = source
    if work.edits and not any(left.blocks for left in work.left):
        anchor = _import_place(wrapper, work) if "ddpkit" not in facts.aliases else None  # (``import ddpkit as
        # dk`` too: the edits say ``ddpkit.``)
        text = rewrite(wrapper, work.edits, anchor)
    return Plan(source, sorted(work.log, key=lambda e: e.line), sorted(work.left, key=lambda e: e.line), text)


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

    def __init__(self, facts: Facts):
        self.facts = facts
        self.edits = Edits()
        self.log: list[Edit] = []
        self.left: list[Left] = []
        self.models: list[Binding] = []  # the bindings wrapped (or already wrapped) in prepare_model
        self.inits: list[Scope] = []  # where the plan binds the state (``state = ddpkit.init()``)
        self.devices: list[Binding] = []  # the device set-ups converted
        ours = all(rules.bound_to_init(b) for b in facts.bindings if b.target == "state")
        self.state = "state" if ours else "ddp_state"  # a script's own ``state`` keeps its name

    def note(self, what: str, why: str, line: int) -> None:
        self.log.append(Edit(line, what, why))

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
        parallel.modules(self)
        self._loaders()
        rules.outputs(self)

    def _convertible(self) -> bool:
        for call in self.facts.calls:
            if call.name and call.name.startswith(HAND_DISTRIBUTED) and not parallel.single_process(call.name):
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
            target = _trained(call)
            if target is None:
                continue
            binding = self._model_binding(target, call) if target else None
            if binding is None and not target:
                self.leave(call.line, "the model this optimizer trains is built inside the optimizer call",
                           "build it first: model = ddpkit.prepare_model(Net()), then the optimizer over "
                           "model.parameters()", blocks=True)
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
            if binding is not None and binding.value is not None:
                return self._source(binding)
        return None

    def _source(self, binding: Binding, depth: int = 0) -> Binding:
        """Where an alias (``model, config = self.model, self.config``) got its value: the model is wrapped
        where it is built or moved, once, not in every method that reads it."""
        bare = parallel.inner(binding.value, self.facts.aliases)  # model = DataParallel(model): the one before
        alias = dotted(bare)
        if alias is None or alias == binding.target and bare is binding.value or depth >= 4:
            return binding
        found = binding_of(self.facts, alias, binding.scope, binding.line - 1)
        return self._source(found, depth + 1) if found is not None and found.value is not None else binding

    def _wrap(self, binding: Binding, optimizer: Call) -> None:
        value = binding.value
        assert value is not None
        aliases = self.facts.aliases
        if _prepared(value, aliases) or any(_prepared(b.value, aliases) for b in self.facts.bindings
                                            if b.target == binding.target and b.value is not None):
            return  # converted already
        moves = [c for c in self.facts.calls if c.scope is binding.scope and c.last in ("to", "cuda")
                 and binding.line < c.line <= optimizer.line and c.stmt is not None
                 and isinstance(c.node.func, cst.Attribute) and dotted(c.node.func.value) == binding.target
                 and len(c.stmt.body) == 1 and isinstance(c.stmt.body[0], cst.Expr)]
        unread = self._unread_device([value, *(m.node for m in moves)], binding)
        if unread is not None:
            self.leave(binding.line, f"the model moves to {unread.target}, set up at line {unread.line} in a form "
                       "convert does not read: prepare_model would put it on ddpkit's device and the data would "
                       f"go to {unread.target}", f"write {unread.target} = torch.device('cuda' if "
                       "torch.cuda.is_available() else 'cpu') (or with your own switch), then convert again",
                       blocks=True)
            return
        if inits.place(self, binding, moves):  # ``netG.apply(weights_init)`` below the build: the wrap below it
            return
        if moves:  # ``model.to(device)`` on its own line: that line becomes the wrap
            move = moves[-1]
            self.edits.replace[id(move.stmt)] = [f"{binding.target} = ddpkit.prepare_model({binding.target})"]
            self.note(f"{binding.target}.{move.last}(...) -> {binding.target} = ddpkit.prepare_model("
                      f"{binding.target})", "prepare_model moves it to this rank's device, converts BatchNorm to "
                      "SyncBatchNorm and wraps it in DDP", move.line)
            return
        self.edits.expr[id(value)] = lambda node: cst.parse_expression(
            f"ddpkit.prepare_model({self.facts.module.code_for_node(rules.without_moves(node))})")
        self.note(f"{binding.target} = ddpkit.prepare_model(...)", "the model the optimizer at line "
                  f"{optimizer.line} trains: prepare_model moves it to this rank's device, converts BatchNorm "
                  "and wraps it in DDP", binding.line)

    def _unread_device(self, nodes: list[cst.CSTNode], model: Binding) -> Binding | None:
        """The binding of a device the model is moved to (``.to(device)``) that the device rules did not
        convert: the data would still go there while prepare_model picks ddpkit's."""
        for node in nodes:
            while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
                if node.func.attr.value == "to" and node.args:
                    name = dotted(node.args[0].value)
                    found = binding_of(self.facts, name, model.scope, model.line) if name else None
                    if found is not None and found.value is not None and found not in self.devices and \
                            not (dotted(found.value) or "").endswith(".device"):
                        return found
                node = node.func.value
        return None

    # the loaders: training or evaluation, found by what their loops do
    def _loaders(self) -> None:
        loaders = [c for c in self.facts.calls if c.name == LOADER]
        training = False
        for call in loaders:
            training |= self._loader(call)
        backward = [c for c in self.facts.calls if c.last == "backward"]
        training |= any(c.name == "ddpkit.data_loader" for c in self.facts.calls)
        if backward and not training and not loaders and not uses_ddpkit(self.facts):  # (ddpkit: by hand)
            self.leave(backward[0].line, "the training batches do not come from a torch DataLoader (fed by hand): "
                       "each rank would train on all of them", "build them with a Dataset and a DataLoader, then "
                       "convert again; or split them by state.rank yourself (docs/guide.md)", blocks=True)

    def _loader(self, call: Call) -> bool:
        """Rewrite one ``DataLoader(...)``; whether it is a training one."""
        positional = [a for a in call.node.args if a.keyword is None and not a.star]
        if len(positional) > len(LOADER_PARAMETERS) or any(a.star == "*" for a in call.node.args):
            self.leave(call.line, "DataLoader(*args) or more positional arguments than it takes",
                       "pass its arguments by name, then convert again", blocks=True)
            return True
        kwargs = {a.keyword.value: a.value for a in call.node.args if a.keyword is not None}
        kwargs.update({LOADER_PARAMETERS[i]: a.value for i, a in enumerate(positional) if i >= 2})
        kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, cst.Name) and v.value == "None")}
        if "batch_sampler" in kwargs:
            self.leave(call.line, "DataLoader(batch_sampler=...): batches are not split across ranks by ddpkit",
                       "pass sampler= and batch_size= instead, then convert again", blocks=True)
            return True
        binding = next((b for b in self.facts.bindings if b.value is call.node), None)
        loops = loops_reading(self.facts, binding.target, binding.scope) if binding else \
            [loop for loop in self.facts.loops if isinstance(loop.node, cst.For) and call.line == loop.line]
        if binding is None and not loops:  # in a comprehension or an argument: one call, maybe several roles
            self.leave(call.line, "a DataLoader built inside an expression (a comprehension, a call's argument): "
                       "its loaders' roles cannot be followed", "bind each loader to a name (train_loader = "
                       "DataLoader(...)), then convert again", blocks=True)
            return False
        peeks = [loop for loop in loops if peek(loop)]  # a look at the first batch: no role, nothing to sum
        loops = [loop for loop in loops if loop not in peeks]
        role = flow.role(self.facts, loops, binding, call)
        if role == "eval" and not loops:  # said by a name only: its loop, and what it sums, were not found
            self.leave(call.line, "an evaluation DataLoader (by its name) whose loop was not found: left as it is "
                       "(every rank evaluates the whole set, which is right)", "to share the work: "
                       "ddpkit.data_loader(..., train=False) and ddpkit.reduce the sums after its loop")
            return False
        if role is None and uses_ddpkit(self.facts):  # a ddpkit script's own plain loader: its choice
            self.leave(call.line, "a plain DataLoader in a ddpkit script, whose loops neither train nor evaluate "
                       "visibly: left as it is (every rank reads all of it)", "if it should be sharded: "
                       "ddpkit.data_loader(dataset, batch_size) to train, or train=False to evaluate")
            return False
        if role is None:
            self.leave(call.line, f"a DataLoader whose role cannot be told: {roles_said(self.facts, loops)}",
                       "convert it yourself: ddpkit.data_loader(dataset, batch_size) to train, "
                       "ddpkit.data_loader(..., train=False) to evaluate (one loader per role)", blocks=True)
            return False
        if not self._reductions(loops, call, role == "train"):
            return False
        how = "training: each rank takes its own shard, reshuffled every epoch" if role == "train" else \
            "evaluation (train=False): each rank its part, no sample twice"
        starred = any(a.star == "**" for a in call.node.args)
        keywords = {"train": "False"} if role == "eval" and "train" not in kwargs else {}
        if role == "train" and not {"shuffle", "sampler"} & set(kwargs) and not starred:
            keywords["shuffle"] = "False"  # torch's default, kept: data_loader's would shuffle
            how = "training: each rank takes its own shard, in order (shuffle=False: torch's default, kept)"
        elif role == "train" and starred and not {"shuffle", "sampler"} & set(kwargs):
            how += " (unless the ** arguments say shuffle=False; a torch DataLoader did not shuffle by default)"
        self.edits.expr[id(call.node)] = lambda node: loader_call(node, keywords)
        self.note(f"DataLoader -> ddpkit.data_loader ({'training' if role == 'train' else 'train=False'})",
                  how, call.line)
        return role == "train"

    def _reductions(self, loops: list[Loop], call: Call, training: bool) -> bool:
        """Sum across ranks what the loops over a loader accumulate and the code below reads
        (:mod:`ddpkit.commands.convert.sums`); an evaluation loop also runs under ``torch.no_grad()`` (a DDP
        forward with gradients on is collective, and the ranks' shards differ in length: the longer one would
        wait forever). False, before any edit: an evaluation loader is then left as it is (every rank evaluates
        the whole set, which is right, only slower), when a loop keeps results this cannot sum."""
        fors = [loop for loop in loops if isinstance(loop.node, cst.For)]
        datasets = frozenset(filter(None, [dotted(call.node.args[0].value)])) if call.node.args else frozenset()
        plans = []
        for loop in fors:
            stored = loop.stored[0] if loop.stored and not training else None
            needs = next((c.last for c in loop.calls if c.last in NEEDS_GRAD), None)
            if not training and not loop.no_grad and stored is None and needs:
                stored = (f"{needs}() results (it needs gradients, so it cannot run under no_grad)", loop.line)
            plan = sums_after(self.facts, loop, training, datasets) if stored is None else None
            if plan is None and not training:
                line = stored[1] if stored else loop.line
                why = f"keeps per-batch results in {stored[0]}" if stored else "may stop before its shard ends " \
                    "(a break)" if loop.breaks else "divides by a count of its own batches (its loop variable)"
                self.leave(line, f"the evaluation loop {why}: the result would be this rank's only, so the "
                           f"DataLoader at line {call.line} is left as it is (each rank evaluates the whole set)",
                           "to share the work: ddpkit.data_loader(..., "
                           "train=False), then ddpkit.gather(...) the results or ddpkit.reduce(...) the sums "
                           "and counts (docs/convert.md)")
                return False
            plans += plan or []
        for anchor, names, lens in plans:
            self.edits.after.setdefault(id(anchor.node), []).extend(f"{n} = ddpkit.reduce({n})" for n in names)
            self.note(f"after the {'training' if training else 'evaluation'} loop: {', '.join(names)} "
                      "summed across ranks (ddpkit.reduce)", "each rank accumulated only its own shard", anchor.end)
            for node in lens:  # ``total / len(loader)``: every rank's batches, as the sum is every rank's
                self.edits.expr[id(node)] = lambda n: cst.parse_expression(
                    f"ddpkit.reduce({self.facts.module.code_for_node(n)})")
                self.note("len(loader) -> ddpkit.reduce(len(loader))", "every rank's batches, as the sum "
                          "divided by it is every rank's", anchor.end)
        for loop in fors if not training else ():
            if not loop.no_grad and id(loop.node) not in self.edits.no_grad:
                self.edits.no_grad.add(id(loop.node))
                self.note("the evaluation loop runs under torch.no_grad()", "a DDP forward with "
                          "gradients on is collective, and the ranks' evaluation shards differ in length",
                          loop.line)
        return True


def _trained(call: Call) -> str | None:
    """The model an optimizer call trains: ``M`` of ``Adam(M.parameters())`` (``M.fc.parameters()``,
    ``filter(..., M.parameters())``, parameter groups) or of ``M.configure_optimizers(...)``."""
    if call.last == "configure_optimizers" and isinstance(call.node.func, cst.Attribute):
        return dotted(call.node.func.value)
    if call.last not in OPTIMIZERS or not (call.name or "").startswith(("torch.optim", call.last)):
        return None
    for arg in call.node.args:
        for node in m.findall(arg.value, m.Call()):  # in the order a visit meets them: the outermost first
            func = node.func if isinstance(node, cst.Call) else None
            if isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters"):
                return dotted(func.value) or ""  # "": built in the call itself (optim.SGD(Net().parameters()))
    return None


def _prepared(value: cst.BaseExpression | None, aliases: dict[str, str]) -> bool:
    """``ddpkit.prepare_model(...)``, also as ``dk.prepare_model`` or an imported ``prepare_model``."""
    return isinstance(value, cst.Call) and resolve(dotted(value.func), aliases) == "ddpkit.prepare_model"


def uses_ddpkit(facts: Facts) -> bool:
    """The script imports ddpkit (under any name)."""
    return any(full == "ddpkit" or full.startswith("ddpkit.") for full in facts.aliases.values())
