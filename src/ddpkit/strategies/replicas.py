"""Replica fingerprints, on by default in ddp: every few steps the ranks compare their weights, a rank that left
the others is named with the step, the first tensor that differs and the likely cause, and with ``heal=`` the
majority's weights and optimizer state are copied to it and training goes on.

A fingerprint is, per parameter, the wrapping int64 sum of its elements' bit patterns (one read of the weights,
where they are: ~5 ms for 10M parameters on one CPU core, far less on a GPU). Any single flipped bit changes it;
no thread count or reduction order does. The ranks compare one mix of those sums, their optimizer-step counts and
their proposal for the next check: one all_gather of three int64 numbers. Only on a mismatch do they gather the
per-tensor sums, and the first differing tensor of a majority rank, to name the cause.

How often: every ``K`` training steps, ``K`` chosen from what a check cost and what a step takes, so that the
checks stay under :data:`BUDGET` of the run's time (the largest proposal of any rank wins: every rank decides
the same ``K`` without another collective). ``check_sync_every=K`` fixes it; ``0`` turns the checks off.

Example::

    >>> next_every(check_s=0.005, step_s=0.1)   # 5 ms a check, 100 ms a step: every 50 steps is 0.1 %
    50
    >>> next_every(check_s=0.005, step_s=0.001)  # a step of 1 ms: capped, a check at least every 1000 steps
    1000
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpkit.core import process
from ddpkit.strategies import replica_repair
from ddpkit.strategies.consistency import diverged_line

BUDGET = 0.001  # of the step time: a fifth of the 0.5 % the checks may cost (the bench measured more than the estimate)
FIRST = 2  # the first check after the start one: after the first optimizer step (a skipped one shows at once)
MAX_EVERY = 1000  # steps: however cheap the step, a check at least this often
PASS_STEPS = 100  # training steps of a loader between its pass-end checks (at the end of a pass that reaches it)
HEALS = (False, True, "rank0")

_LIVE: weakref.WeakSet[Replicas] = weakref.WeakSet()
_HOOKED: list[Any] = []  # the optimizer-step hook's handle, once per process
_SERIAL = itertools.count()  # models in the order the script made them: the same order on every rank

ReplicaError = replica_repair.ReplicaError


def next_every(check_s: float, step_s: float) -> int:
    """Steps between checks so that a check of ``check_s`` seconds costs :data:`BUDGET` of steps of ``step_s``."""
    if step_s <= 0 or not math.isfinite(check_s / step_s):
        return FIRST
    return max(1, min(MAX_EVERY, math.ceil(check_s / (BUDGET * step_s))))


def validate(every: Any, heal: Any) -> None:
    """One line for a ``check_sync_every`` or ``heal`` that is neither of the accepted values."""
    if every != "auto" and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise ValueError(f"check_sync_every={every!r} is not 'auto' or a whole number >= 0; pass 'auto' (the "
                         "default: as often as 0.1 % of the run's time allows), K (every K steps) or 0 (never)")
    if not any(heal is h for h in HEALS):
        raise ValueError(f"heal={heal!r} is not False, True or 'rank0'; pass heal=True to copy the majority's "
                         "weights to a rank that left it (3 or more ranks), heal='rank0' to let rank 0 win a tie")


def _fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor, the wrapping int64 sum of its elements' bits, on the tensors' device."""
    sums = [t.detach().contiguous().view(replica_repair.BITS[t.element_size()]).sum(dtype=torch.int64) for t in tensors]
    return torch.stack(sums)


def odd_weights(count: int, device: torch.device) -> torch.Tensor:
    """1, 3, 5, ...: the weights that mix per-tensor sums into one (odd: a single flipped bit never cancels)."""
    return torch.arange(1, 2 * count, 2, dtype=torch.int64, device=device)



class Replicas:
    """The fingerprint checks of one DDP model: its forward calls :meth:`check` once ``next`` steps are done."""

    def __init__(self, module: nn.Module, group: Any, *, every: int | str = "auto", heal: bool | str = False,
                 buffers: bool = False, ignore: frozenset[str] = frozenset(), local: frozenset[str] = frozenset()):
        validate(every, heal)
        self.module, self.group, self.heal = module, group, heal
        self.auto = every == "auto"
        self.every = FIRST if self.auto else int(every)
        self.next = self.every
        skip = set(ignore) | set(local)
        named = list(module.named_parameters()) + (list(module.named_buffers()) if buffers else [])
        kept = [(n, replica_repair.local(t)) for n, t in named if n not in skip and t.is_floating_point()]
        kept = [(n, t) for n, t in kept if t.numel()]  # a shard may be empty (more ranks than rows)
        self.names = [n for n, _ in kept]
        self.tensors = [t for _, t in kept]
        self.params = {id(p) for p in module.parameters()}
        # a rank of the group -> its rank in the job (hsdp's replica groups are not the whole job)
        self.ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] if group \
            is not None else list(range(dist.get_world_size()))
        self.optimizers: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.optimizer_steps = 0
        # the training forwards through the wrapper so far, told by the wrapper that counts them (DDP's); None: not
        # counted, nothing is concluded from it
        self.forwards: Callable[[], int] | None = None
        self.check_s = 0.0  # what the last check took
        self.since = (time.perf_counter(), 0)  # when the last check ended, and at which step
        self.agreed = 0  # the step of the last check that found the replicas equal
        self.baseline: list[int] = []  # each rank's optimizer steps then (a joined rank steps less: a new baseline)
        self.seen = 0  # training steps so far
        self.ending = False  # the check at the job's end: nothing is healed there
        # a model the script prepared, on every rank alike, in the same order; a copy (deepcopy on one rank only:
        # an EMA) or a model never checked takes no number, so the others keep theirs on every rank
        self.serial, self.pid = (next(_SERIAL) if self.every else -1), os.getpid()  # forked workers hold kernels'
        if self.every:
            _LIVE.add(self)
        if not _HOOKED:  # torch's global hook: counts each optimizer's steps, nothing of the optimizer changes
            _HOOKED.append(register_optimizer_step_post_hook(_count_step))

    def owns(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` steps this model's parameters (asked once per optimizer)."""
        if optimizer not in self.optimizers:
            self.optimizers[optimizer] = any(id(p) in self.params for g in optimizer.param_groups
                                             for p in g["params"])
        return self.optimizers[optimizer]

    # Called from DDP's untraced forward, whose callees dynamo would trace: the step number changes every call and
    # would recompile it each step (torch.compile of a prepared model must meet nothing of ddpkit's)
    @torch.compiler.disable
    def check(self, step: int) -> None:
        """Compare the replicas; raise (every rank, one line) or heal when they differ."""
        start = time.perf_counter()
        ended, at = self.since
        proposal = next_every(self.check_s, (start - ended) / max(1, step - at)) if self.auto else self.every
        sums = _fingerprint(self.tensors)
        mixed = (sums * odd_weights(len(sums), sums.device)).sum()
        mine = torch.stack([mixed, sums.new_tensor(self.optimizer_steps), sums.new_tensor(proposal)])
        rows = self._gather(mine)
        if len({int(r[0]) for r in rows}) > 1:  # the weights; step counts differ by design after a join
            self._differ(step, sums, rows)
        if not self.auto:  # asked for by the script: NaN / inf on every rank (a divergence, the ranks agree) too
            finite = torch.stack([torch.isfinite(t).all() for t in self.tensors])
            if not bool(finite.all()):
                raise ReplicaError(diverged_line(self.names[int((~finite).nonzero()[0])]))
        self.agreed, self.baseline = step, [int(r[1]) for r in rows]
        self.every = max(int(r[2]) for r in rows)
        self.next = step + self.every
        self.since = (time.perf_counter(), step)
        self.check_s = self.since[0] - start

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        return replica_repair.gather_rows(mine, self.group)

    def _differ(self, step: int, sums: torch.Tensor, rows: torch.Tensor) -> None:
        """Every rank is here (each saw the same rows): name what differs, then heal or raise."""
        per_tensor = self._gather(sums)  # (ranks, tensors)
        classes: dict[int, list[int]] = {}
        for rank, row in enumerate(rows.tolist()):
            classes.setdefault(row[0], []).append(rank)
        ordered = sorted(classes.values(), key=lambda ranks: (-len(ranks), ranks[0]))
        majority = ordered[0] if len(ordered[0]) * 2 > len(rows) else None
        reference = majority[0] if majority else 0
        differing = [i for i in range(per_tensor.shape[1]) if bool((per_tensor[:, i] != per_tensor[0, i]).any())]
        since = [int(r[1]) - (self.baseline[i] if self.baseline else 0) for i, r in enumerate(rows)]
        found = replica_repair.Finding(step, self.agreed, since, ordered, majority,
                                       reference, [self.names[i] for i in differing], self.ranks)
        if differing:
            mine = [opt for opt, owned in self.optimizers.items() if owned]
            found.detail = replica_repair.compare(self.tensors[differing[0]], reference, self.group, mine)
        if not (self.heal is True and majority or self.heal == "rank0"):
            raise ReplicaError(found.message(self.heal, self.ending))
        replica_repair.heal(self, found, [self.tensors[i] for i in differing])
        healed = _fingerprint(self.tensors)
        again = self._gather(torch.stack([(healed * odd_weights(len(healed), healed.device)).sum()]))
        if len({int(r[0]) for r in again}) > 1:
            raise ReplicaError(f"{found.message(self.heal)}; healing failed: the replicas still differ after the "
                               "copy (a rank that keeps changing them)")


def live() -> list[int]:
    """The serial numbers of the checked models this process made and still holds."""
    return sorted(r.serial for r in list(_LIVE) if r.pid == os.getpid() and r.every > 0 and r.tensors)


def parse_live(raw: bytes) -> set[int]:
    """A peer's :func:`live` as it arrived through the store (anything else: no model, so none is checked).

    >>> parse_live(b"[0, 2]"), parse_live(b"1"), parse_live(b'[[0]]')
    ({0, 2}, set(), set())
    """
    try:
        value = json.loads(raw[:65536]) if len(raw) <= 65536 else None
    except (ValueError, RecursionError):
        return set()
    return {v for v in value if type(v) is int} if isinstance(value, list) else set()


_MAX_MODELS = 64  # models a process checks at a pass's end (their numbers go in one small all_gather)


def check_all() -> None:
    """Compare now every model that trained half its cadence or more since its last check: every rank calls it at
    the same point (the end of a pass over the training data). The models every rank holds are agreed first (one
    all_gather of their numbers: a model dropped by the script may be collected on one rank only)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    state = process.current().state
    device = state.device if state is not None else torch.device("cpu")
    mine = live()[:_MAX_MODELS]
    row = torch.full((_MAX_MODELS + 1,), -1, dtype=torch.int64, device=device)
    row[0] = len(mine)
    if mine:
        row[1:1 + len(mine)] = torch.tensor(mine, dtype=torch.int64, device=device)
    held = [set(r[1:1 + int(r[0])].tolist()) for r in replica_repair.gather_rows(row)]
    common = set.intersection(*held)
    for replicas in sorted((r for r in list(_LIVE) if r.serial in common and r.pid == os.getpid()),
                           key=lambda r: r.serial):
        # counted alike on every rank (a join's steps are not counted); half a cadence since the last check at
        # least, so that these checks cost no more than the budget again
        if replicas.seen - replicas.agreed >= max(1, replicas.every // 2):
            replicas.check(replicas.seen + 1)


def check_at_exit(serials: set[int]) -> str | None:
    """The last check of the models ``serials`` (those every rank still holds), as the job ends (every rank at
    its exit, none gone): what trained since the last check is compared too, so no run ends with replicas that
    differ, unsaid. Returns the line (said on every rank), or None. Each is checked whatever its step count:
    ranks that joined uneven inputs counted different steps."""
    for replicas in sorted((r for r in list(_LIVE) if r.serial in serials and r.pid == os.getpid()),
                           key=lambda r: r.serial):
        replicas.heal, replicas.ending = False, True  # at the end the run's outputs are written: say it, copy none
        try:
            replicas.check(replicas.seen + 1)  # the steps done
        except ReplicaError as exc:
            return f"at the end of training: {exc}"
    return None


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch calls it after every ``optimizer.step()`` of this process."""
    for replicas in list(_LIVE):
        if replicas.owns(optimizer):
            if not replicas.optimizer_steps and (line := bypassed(replicas, optimizer)):
                raise ReplicaError(line)
            replicas.optimizer_steps += 1


def bypassed(replicas: Replicas, optimizer: Any) -> str | None:
    """The line for a first step whose gradients no forward through the prepared model made: a part called
    directly (``model.G(z)``, ``model.module(x)``, a method that runs the layers) runs outside DDP's forward, so
    DDP averages none of them and each rank steps with its own. Every rank runs the same code and meets it at
    the same step. None when the wrapper's forward ran, or no parameter of the model has a gradient.

    Checked at the first step only: later, a gradient left from an earlier step (``zero_grad(set_to_none=False)``)
    cannot be told from a new one."""
    if replicas.forwards is None or replicas.forwards():
        return None
    names = {id(p): n for n, p in replicas.module.named_parameters()}
    # zeros are no gradient: torch.distributed.checkpoint steps a fresh optimizer over zero gradients to make its
    # state before a load (a resume); a read of each, once, at the first step only
    graded = [names[id(p)] for g in optimizer.param_groups for p in g["params"]
              if id(p) in names and p.grad is not None and bool(p.grad.any())]
    if not graded:
        return None
    return (f"the first optimizer step has gradients in '{graded[0]}' ({len(graded)} tensor(s)) but the prepared "
            "model's forward never ran: a part called directly (model.G(z), model.module(x), a method that runs "
            "the layers) runs outside DDP, which then averages no gradient, and each rank would train its own "
            "model; prepare each part the loop calls (G = ddpkit.prepare_model(G)), call the prepared model "
            "itself (its forward may run the parts), or name the method the loss comes from: "
            "ddpkit.prepare_model(model, forward_methods=('log_probs',))")

