"""Where each step's time goes on this rank, in phases, and which rank is slow: the worker half of the report.

Under ``ddpkit launch --phase-window N`` (off by default: its cost, ~0.1 ms a step on a 2-core CPU machine, was
1.5-2.3 % of benchmarks/'s 10 ms step) every rank runs a :class:`PhaseClock`. It takes a
time stamp at the points a step already passes, and adds the time since the last stamp to the phase the
step was in:

- ``data``: a ddpkit training loader was asked for a batch, until it handed one out (workers, I/O, collate);
- ``compute``: the training forward of a prepared model started, until its last gradient was ready;
- ``comm``: the last gradient was ready, until the backward returned: the all-reduce that no compute hides,
  which is where a rank waits for a slower peer;
- ``optimizer``: inside ``optimizer.step()`` (torch's global optimizer hooks);
- ``other``: everything else in the loop (logging, moving the batch, the loss's ``.item()``).

A step runs from one batch request to the next (without a ddpkit loader: from one optimizer step to the next).
Every ``window`` steps the rank puts its window (mean ms per step in each phase, as JSON) in the group's store:
no collective, nothing per step leaves the process. Rank 0 reads the previous window of every rank, and says
once on the console when a straggler appears (:func:`ddpkit.core.straggler.verdict` names the same rank and
phase in two windows in a row). At shutdown each rank
puts its totals there too, and rank 0 writes ``phases.json`` for the launcher's final table.

Example (one process, no store: its own table)::

    clock = PhaseClock(rank=0, local_rank=0, host="h", window=200, store=None, report_path="phases.json")
    loader.watch_fetch(clock.fetch); clock.watch_model(model); clock.start()
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.core import atomic, contract, process, straggler
from ddpkit.runtime import phase_store
from ddpkit.runtime.stamps import Timeline
from ddpkit.strategies.syncbn import SyncBatchNorm

DEFAULT_WINDOW = 200  # the window to turn the report on with (ddpkit bench's runs use it)
FINAL_WAIT_S = 5.0  # rank 0 waits this long at shutdown for the other ranks' totals (as the final barrier does)
_KEY = "ddpkit/phases/"
Listener = Callable[[int, list[dict[str, Any]], "dict[str, Any] | None"], None]
_N = len(straggler.PHASES)
# marks one step may hold (~100 bytes each): a step that never ends (one batch reused, or fetches and no training)
# would otherwise keep every stamp of the run
_MAX_OPEN = 20_000
_MIN_SAID_STEPS = 20  # a straggler is said live once it held this many steps (and two windows) in a row
_DATA, _COMPUTE, _COMM, _OPT, _OTHER = range(_N)


class PhaseClock:
    """One rank's phase times: see the module docstring. ``store``: the group's store (None: one process)."""

    def __init__(self, rank: int, local_rank: int, host: str, window: int, store: Any, report_path: str | None,
                 world_size: int = 1, attempt: int = 0, cuda: bool = False):
        self.rank, self.local_rank, self.host, self.window = rank, local_rank, host, window
        self.store, self.report_path, self.world_size = store, report_path, world_size
        self.prefix = f"{_KEY}{attempt}/"
        self.line = Timeline(_N, cuda)
        self.phase = _OTHER
        self.step_start = 0  # the open step's first mark on the timeline
        self.grad: Any = None  # the stamp of the latest gradient of the running backward
        self.window_sums, self.total_sums, self.first_sums = [0.0] * _N, [0.0] * _N, [0.0] * _N
        self.window_steps = self.total_steps = self.first_steps = self.windows = 0
        self.stepped: set[int] = set()  # the optimizers that stepped since the last fetch
        # on CUDA a stamp is an event: only the gradient that came last in the previous backward is stamped (on
        # the CPU a stamp is a clock read, and every gradient takes one: a graph that changes between backwards,
        # a GAN's three, a branch, keeps its compute in compute)
        self.learn_last = cuda
        self.last_grad: int | None = None  # id() of the parameter whose gradient came last in the last backward
        self.latest_grad: int | None = None  # ... in the running one
        self.by_loader = self.by_optimizer = self.stepping = self.in_backward = False
        self.worked = False  # the open step ran a training forward, a backward or an optimizer step
        self.said: tuple[int, str] | None = None  # the straggler last said on the console
        self.seen: tuple[int, str] | None = None  # the last window's verdict
        self.streak = 0  # windows in a row with that verdict
        self.listeners: list[Listener] = []
        self.handles: list[Any] = []

    # -- the stamps -------------------------------------------------------------------------------------
    def _to(self, phase: int) -> None:
        """The time since the last stamp goes to the phase the step was in; from now the step is in ``phase``."""
        self.line.close(self.phase)
        self.phase = phase
        if len(self.line.marks) - self.step_start > _MAX_OPEN:  # a step that never ends (one batch reused, or
            self.by_loader = False  # fetches and no training): optimizer steps or backwards cut the steps from now
            self.line.skip_from(self.step_start)  # on, and what it held so far is no step's
            self._resolve()

    def fetch(self, starting: bool | None) -> None:
        """A ddpkit training loader starts fetching a batch (True), got one (False), or its pass ended (None:
        at its end, or left with ``break``). A fetch ends the step once the step did some work: a second
        loader's batch for the same step (two loaders zipped) is that step's data. After a pass, the time to the
        next pass's first fetch (evaluation, a save) is no step's."""
        if starting:
            self.by_loader = True
            self.stepped.clear()
            if self.worked or not self.stepping:
                self._next_step()
                self.phase = _DATA
            else:
                self._to(_DATA)
        elif starting is False:
            self._to(_OTHER)
        elif self.worked:  # left with break after training on the batch: its step is whole
            self._next_step()
            self.stepping = False
        elif self.phase == _DATA:  # the fetch found the end (or failed): the step it opened is none
            self._to(_OTHER)
            self.stepping = False
        # else: closed right after handing a batch out, before any work (next(iter(loader)) each step, a tool's
        # cap refusing the batch): the step goes on, the work on that batch (if any) is its

    def in_forward(self, module: nn.Module, phase: int) -> None:
        """A training forward reached the start of ``phase``: the prepared model's forward (compute), DDP's own
        part before it, a SyncBatchNorm's or an FSDP2 pre-forward's all-gather (comm: a wait for the peers, as
        much as the all-reduce after the backward is), the end of those (compute). Evaluation forwards stamp
        nothing (they are "other"); so does a trace by dynamo (a torch.compile around the prepared model), where
        the clock's Python state would break the graph and recompile it as the phase changes."""
        if not torch.compiler.is_compiling() and module.training and torch.is_grad_enabled():
            self.worked = True
            self._to(phase)

    def _ddp_forward(self, module: nn.Module, syncing: bool) -> None:
        """ddpkit's DDP wrapper: its forward starts (``syncing``: its buffer broadcast), or its module's does."""
        self.in_forward(module, _COMM if syncing else _COMPUTE)

    def grad_ready(self, param: torch.Tensor) -> None:
        # the stamp that ends compute is the last gradient's: see learn_last
        self.worked, self.latest_grad = True, id(param)
        if not self.learn_last or self.last_grad is None or self.latest_grad == self.last_grad:
            if self.grad is not None:
                self.line.discard(self.grad)
            self.grad = self.line.stamp()
        if not self.in_backward:
            self.in_backward = True
            # Callbacks run at the end of the backward in the order queued. Ours, queued first, queues one more:
            # that one runs after DDP's own (queued at its last bucket), which waits for the all-reduce.
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)

    def _requeue(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.in_backward = False
        # another parameter came last this time (a branch the graph took): learnt for the next backward
        learnt, self.last_grad = self.last_grad, self.latest_grad
        if self.learn_last and learnt is not None and learnt != self.latest_grad:
            # the graph changed (the learnt parameter came early, or got no gradient): the compute ran to about
            # here, a wait of this backward is not told apart (never compute counted as waiting)
            if self.grad is not None:
                self.line.discard(self.grad)
            self.grad = self.line.stamp()
        if self.grad is not None:  # up to the last gradient: compute (even with no forward stamped: compiled)
            self.line.close(_COMPUTE, self.grad)
            self.grad = None
        self.line.close(_COMM)  # from there to here: the communication no compute hid
        self.phase = _OTHER
        if not (self.by_loader or self.by_optimizer):  # no ddpkit loader, no torch optimizer: a backward is the step
            self._next_step()

    def optimizer_start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.by_optimizer = self.worked = True
        self._to(_OPT)

    def optimizer_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._to(_OTHER)
        if self.by_loader and id(optimizer) in self.stepped:  # stepped twice on one fetch: the loop reuses a batch
            self.by_loader = False
        self.stepped.add(id(optimizer))  # (a GAN's two optimizers step once each a batch)
        if not self.by_loader:  # no ddpkit loader, or one no longer read: an optimizer step is the step
            self._next_step()

    # -- steps and windows -------------------------------------------------------------------------------
    def _next_step(self) -> None:
        self._to(self.phase)
        if not self.stepping:  # the time before the first step (building, loading) or between passes: no step's
            self.line.skip_from(self.step_start)
        else:
            self.window_steps += 1
        self.stepping, self.worked = True, False
        self.step_start = len(self.line.marks)
        if self.window_steps >= self.window:
            self._publish_window()
            self.line.close(self.line.skip)  # the store's round trips are the clock's own time, no phase's

    def _resolve(self) -> None:
        for i, seconds in enumerate(self.line.resolve()):
            self.window_sums[i] += seconds
        self.step_start = 0

    def _mean(self, sums: list[float], steps: int, index: int) -> dict[str, Any]:
        ms = {p: 1000.0 * sums[i] / max(steps, 1) for i, p in enumerate(straggler.PHASES)}
        return straggler.window(self.rank, ms, steps, self.host, self.local_rank, index)

    def _publish_window(self) -> None:
        self._resolve()
        index, self.windows = self.windows, self.windows + 1
        mine = self._mean(self.window_sums, self.window_steps, index)
        # the first window (compile, allocator and cache warm-up) stays out of the run's totals and the verdict
        kept, counted = (self.first_sums, "first_steps") if index == 0 else (self.total_sums, "total_steps")
        for i in range(_N):
            kept[i] += self.window_sums[i]
        setattr(self, counted, getattr(self, counted) + self.window_steps)
        self.window_sums, self.window_steps = [0.0] * _N, 0
        if self.store is not None:
            phase_store.put(self.store, phase_store.key(self.prefix, index, self.rank), mine)
        if self.rank == 0 and index > 0:
            previous = [mine] if self.store is None else \
                phase_store.gather(self.store, self.prefix, index - 1, self.world_size)
            if previous and previous[0]["window"] > 0:
                self._judge(previous)

    def _judge(self, windows: list[dict[str, Any]]) -> None:
        found = straggler.verdict(windows)
        step = (windows[0]["window"] + 1) * self.window
        for listener in self.listeners:
            listener(step, windows, found)
        now = None if found is None else (found["rank"], found["phase"])
        self.streak = self.streak + 1 if now is not None and now == self.seen else int(now is not None)
        # said once it holds for two windows in a row, and at least 20 steps: one window's hiccup (a descheduled
        # process) is no straggler, nor are two steps' at --phase-window 1
        needed = max(2, -(-_MIN_SAID_STEPS // self.window))
        if now is not None and self.streak >= needed and now != self.said:
            print(f"ddpkit: {straggler.describe(found, f'over steps {step - needed * self.window}-{step}')}",
                  file=sys.stderr, flush=True)
            self.said = now
        self.seen = now

    # -- the run's end -----------------------------------------------------------------------------------
    def totals(self) -> dict[str, Any]:
        """This rank's phase means over every step so far but the first window's (warm-up), or over all of them
        when no step came after it; ``warmup``: the steps left out."""
        self._to(self.phase)
        self.line.skip_from(self.step_start)  # the step still open is no whole step
        self._resolve()
        sums = [t + w for t, w in zip(self.total_sums, self.window_sums)]
        steps = self.total_steps + self.window_steps
        warmup = self.first_steps
        if not steps:  # a run within its first window: its only figures
            sums, steps, warmup = [t + f for t, f in zip(sums, self.first_sums)], self.first_steps, 0
        return {**self._mean(sums, steps, self.windows), "warmup": warmup}

    def finish(self) -> None:
        """At shutdown: put this rank's totals in the store; rank 0 writes the run's report."""
        mine = self.totals()
        warmup = mine.pop("warmup")
        if self.store is not None:
            phase_store.put(self.store, f"{self.prefix}total/{self.rank}", mine)
        if self.rank != 0 or self.report_path is None:
            return
        windows, missing = ([mine], []) if self.store is None else \
            phase_store.final_totals(self.store, self.prefix, mine, self.world_size, FINAL_WAIT_S)
        rep = straggler.report(windows, missing, warmup)
        atomic.write_atomically(self.report_path, lambda f: f.write(straggler.dumps(rep).encode()))

    def watch_model(self, model: nn.Module, forward: bool = True) -> None:
        """Stamp the training forwards of ``model`` (``forward=False``: a compiled one, whose hooks dynamo would
        trace) and the moment each of its gradients is ready."""
        if forward:
            if not isinstance(model, DistributedDataParallel):  # ddpkit's DDP stamps itself: see start()
                self.handles.append(model.register_forward_pre_hook(_compute_starts))
            # FSDP2's pre-forward (prepended) all-gathers the layer: a wait too. A model FSDP2 sharded has imported
            # torch.distributed.fsdp; importing it here would cost every run ~2 s
            fsdp = sys.modules.get("torch.distributed.fsdp")
            sharded: type = getattr(fsdp, "FSDPModule", type(None))
            for layer in model.modules():
                if isinstance(layer, sharded):
                    self.handles.append(layer.register_forward_pre_hook(_wait_starts, prepend=True))
                    if layer is not model:
                        self.handles.append(layer.register_forward_pre_hook(_compute_starts))
            for layer in model.modules():  # their forward all-gathers the batch statistics of every rank
                if isinstance(layer, (nn.SyncBatchNorm, SyncBatchNorm)):
                    self.handles += [layer.register_forward_pre_hook(_wait_starts),
                                     layer.register_forward_hook(_compute_starts)]
        for param in model.parameters():
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(_grad_ready))

    def start(self) -> None:
        """Stamp every optimizer's step (torch's global hooks) from now on."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.handles += [register_optimizer_step_pre_hook(self.optimizer_start),
                         register_optimizer_step_post_hook(self.optimizer_end)]
        # called from DDP's untraced frames: run as it is, never compiled into a no-op. Wrapped here, not with a
        # decorator: torch.compiler.disable imports dynamo and inductor, seconds that an import of ddpkit must not pay
        process.current().on_ddp_forward = torch.compiler.disable(self._ddp_forward)

    def stop(self) -> None:
        proc = process.current()
        proc.on_ddp_forward = None
        if proc.phases is self:  # a model's hooks (and a deep copy's) find no clock from now on
            proc.phases = None
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def window_from(environ: Any) -> int:
    """Steps per window from ``DDPKIT_PHASE_WINDOW`` (unset or 0: no report); a bad value is one line naming it.

    >>> window_from({}), window_from({"DDPKIT_PHASE_WINDOW": "200"})
    (0, 200)
    """
    window = contract.PHASE_WINDOW.number(environ)
    if window is not None and window < 0:
        raise contract.ContractError(f"{contract.PHASE_WINDOW.name}={window} must be >= 0; give the steps per "
                                     f"window of the phase report (e.g. {DEFAULT_WINDOW}), or 0 to turn it off")
    return 0 if window is None else window


def start(state: Any, report_dir: str | None, window: int) -> PhaseClock | None:
    """This rank's clock under ``ddpkit launch`` (``report_dir`` set), unless ``window`` is 0."""
    if report_dir is None or window == 0:
        return None
    store = None
    if state.world_size > 1 and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
    clock = PhaseClock(state.rank, state.local_rank, socket.gethostname(), window, store,
                       os.path.join(report_dir, "phases.json"), state.world_size,
                       contract.RESTART_COUNT.number(os.environ) or 0, cuda=state.device.type == "cuda")
    clock.start()
    process.on_shutdown(clock.finish)
    process.on_shutdown(clock.stop, always=True)
    return clock


def current() -> PhaseClock | None:
    return process.current().phases


# The model's hooks are functions of this module, not the clock's bound methods: a model is deep-copied (an EMA
# copy) and pickled (torch.save(model)) with its hooks, and a clock holds the group's store, which neither can.
def _compute_starts(module: nn.Module, args: Any, output: Any = None) -> None:
    if (clock := current()) is not None:
        clock.in_forward(module, _COMPUTE)


def _wait_starts(module: nn.Module, args: Any) -> None:
    if (clock := current()) is not None:
        clock.in_forward(module, _COMM)


def _grad_ready(param: torch.Tensor) -> None:
    if (clock := current()) is not None:
        clock.grad_ready(param)


def watch_loader(loader: Any) -> None:
    """A ddpkit training loader: its batch fetches open the steps (nothing when no clock runs)."""
    clock = current()
    if clock is not None:
        loader.watch_fetch(clock.fetch)


def watch_model(model: nn.Module, compiled: bool = False) -> None:
    """A prepared model: its training forwards and gradients are stamped (nothing when no clock runs)."""
    clock = current()
    if clock is not None:
        clock.watch_model(model, forward=not compiled)


def waits(collective: Callable[..., Any]) -> Callable[..., Any]:
    """A collective a script calls (``ddpkit.reduce``, ``barrier``, ...): its time is a wait for the peers,
    ``comm``, not the phase around it (a loop that logs ``ddpkit.reduce(loss.item())`` each step would put a
    slow peer's lag in "other", where the verdict cannot see it as waiting)."""
    @functools.wraps(collective)
    def waiting_for_peers(*args: Any, **kwargs: Any) -> Any:
        if current() is None:
            return collective(*args, **kwargs)
        with waiting():
            return collective(*args, **kwargs)
    return waiting_for_peers


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """A wait for the peers inside a phase (a stream's ranks agreeing inside the fetch): ``comm`` meanwhile."""
    clock = current()
    if clock is None:
        yield
        return
    phase = clock.phase
    clock._to(_COMM)
    try:
        yield
    finally:
        clock._to(phase)


def add_listener(listener: Listener) -> None:
    """``listener(step, windows, verdict)`` on rank 0 after each window (e.g. TensorBoard scalars)."""
    clock = current()
    if clock is not None:
        clock.listeners.append(listener)
