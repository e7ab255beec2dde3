"""When the replicas' fingerprints differ (:mod:`ddpkit.strategies.replicas`): what differs, its likely cause, the
one-line report, and the repair that copies a reference rank's weights and optimizer state to the others.

Every function here is called on every rank alike (each saw the same fingerprints), so the collectives meet.

Example of the report::

    replicas out of sync at step 40 (equal at step 20): rank 1 differs from ranks 0, 2 in '0.weight': one bit
    flipped (bit 30 of element 17): silent data corruption ...; pass prepare_model(model, heal=True) ...
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


class ReplicaError(RuntimeError):
    """The replicas differ: raised on every rank with the same line."""


# [differing elements, elements, bits of the one differing, its bit, its index, largest, scale, hyperparameters]
_DETAIL = 8


@dataclasses.dataclass
class Finding:
    """What one check found: ranks grouped by fingerprint (largest group first), the majority if there is one."""

    step: int
    agreed: int  # the step of the last check that found the replicas equal
    steps: list[int]  # optimizer steps per rank since the last check that found the replicas equal
    classes: list[list[int]]
    majority: list[int] | None
    reference: int  # whose weights are the reference: the majority's lowest rank, else rank 0
    tensors: list[str]  # the names of the tensors that differ, in the model's order
    ranks: list[int] | None = None  # a rank of the group -> its rank in the job (None: the same)
    detail: list[list[float]] | None = None  # per rank, for the first differing tensor (see _DETAIL)

    def job(self, ranks: Sequence[int]) -> list[int]:
        return [self.ranks[r] for r in ranks] if self.ranks else list(ranks)

    def odd(self) -> list[int]:
        """The ranks outside the reference's group."""
        return sorted(r for group in self.classes if self.reference not in group for r in group)

    def who(self) -> str:
        odd = self.odd()
        verb = "differs" if len(odd) == 1 else "differ"
        if self.majority:
            return f"{_ranks(self.job(odd))} {verb} from {_ranks(self.job(self.majority))}"
        mine = next(group for group in self.classes if self.reference in group)
        return f"{_ranks(self.job(odd))} {verb} from {_ranks(self.job(mine))} (no majority: which is right cannot " \
               "be told)"

    def why(self) -> str:
        ranks = self.job(range(len(self.steps)))
        if not self.detail:  # no tensor differs: the mixed fingerprints collided (one in 2**64)
            return cause(self.steps, 0, 0, 0, 0, 0, 0.0, 0.0, ranks)
        first = self.detail[self.odd()[0]]
        differing, elements, bits, bit, element = (int(v) for v in first[:5])
        return cause(self.steps, differing, elements, bits, bit, element, first[5], first[6], ranks,
                     [int(row[7]) for row in self.detail])

    def message(self, heal: Any = False, at_exit: bool = False) -> str:
        what = (f"in {self.tensors[0]!r}" + (f" and {len(self.tensors) - 1} more tensor(s)" if len(self.tensors) > 1
                                             else "")) if self.tensors else "in no tensor"
        if at_exit:
            fix = ("nothing is healed at the end (what the run saved is written): weights rank 0 saved may be its "
                   "own diverged copy")
        elif self.majority:
            fix = "pass prepare_model(model, heal=True) to copy the majority's weights to it and go on"
        else:
            fix = ("no majority to heal from" if heal is True else "with no majority (2 ranks, or a tie)") + \
                  ": prepare_model(model, heal='rank0') lets rank 0's weights win"
        if not at_exit and self._spread():  # (K-FAC: healed, the next steps part the replicas again)
            fix += ("; but differences in most elements come from the updates, and would part the replicas again "
                    "after healing: fix the cause first")
        return (f"replicas out of sync at step {self.step} (equal at step {self.agreed}): {self.who()} {what}: "
                f"{self.why()}; {fix}")

    def _spread(self) -> bool:
        """Most elements of the first differing tensor differ, with the same step counts and optimizer settings on
        every rank: an update that is not the same everywhere, not a one-time write."""
        if not self.detail or len(set(self.steps)) > 1:
            return False
        first = self.detail[self.odd()[0]]
        hypers = {int(row[7]) for row in self.detail}
        return len(hypers) == 1 and math.isfinite(first[5]) and first[0] > max(1, first[1] // 1000)


def _ranks(ranks: Sequence[int]) -> str:
    """
    >>> _ranks([1]), _ranks([0, 2])
    ('rank 1', 'ranks 0, 2')
    """
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def cause(steps: list[int], differing: int, elements: int, bits: int, bit: int, element: int, largest: float,
          scale: float, ranks: Sequence[int] | None = None, hypers: Sequence[int] | None = None) -> str:
    """The likely cause, from what differs on the first rank outside the majority: its optimizer-step count
    beside the others'; how many of a tensor's ``elements`` differ; the ``bits`` that differ in a single
    differing element; the largest difference against the tensor's largest magnitude ``scale``; ``ranks``: the
    job's rank of each (default: the same numbers); ``hypers``: per rank, a digest of its optimizers'
    hyperparameters (``param_groups``: lr, momentum, ...).

    >>> cause([10, 9, 10], 40, 4096, 0, 0, 0, 0.5, 1.0)[:40]
    'rank 1 took 9 optimizer steps, the other'
    >>> cause([4, 4], 1, 100, 1, 3, 7, 1e-6, 1.0)[:35]
    'one bit flipped (bit 3 of element 7'
    >>> cause([4, 4], 100, 100, 0, 0, 0, 1e-7, 1.0)[:30]
    'small differences in every ele'
    """
    if len(set(steps)) > 1:
        common = max(set(steps), key=steps.count)
        odd = [r for r, s in enumerate(steps) if s != common]
        who = (ranks or range(len(steps)))[odd[0]]
        return (f"rank {who} took {steps[odd[0]]} optimizer steps, the others {common}: a step one rank "
                "skipped (an `if` on the rank, or on a value only this rank computed, before optimizer.step())")
    if hypers and len(set(hypers)) > 1:
        common = max(set(hypers), key=list(hypers).count)
        odd = [r for r, h in enumerate(hypers) if h != common]
        return (f"rank {(ranks or range(len(hypers)))[odd[0]]}'s optimizer has other hyperparameters than the "
                "others' (its param_groups: a rank-dependent learning rate, schedule or weight decay)")
    if not math.isfinite(largest):
        return ("NaN or inf on this rank only: a value only this rank computed (its own loss or data) reached "
                "the weights outside the all-reduce")
    if differing == 1 and bits == 1:
        return (f"one bit flipped (bit {bit} of element {element}): silent data corruption in this rank's memory "
                "or device, or a write into the weights from outside training")
    if differing <= max(1, elements // 1000):
        return (f"{differing} of {elements} elements changed on this rank only: a write into the weights outside "
                "training (an in-place edit under a rank condition)")
    if largest <= 1e-4 * max(scale, 1e-30):
        return ("small differences in every element: an update that is not the same on every rank (a "
                "rank-dependent learning rate or scale, a non-deterministic op in the update, a gradient that "
                "was not all-reduced)")
    # (prepare_model made them equal: set apart since, or updated apart by more than the all-reduced gradients)
    return ("large differences: weights set differently on this rank after prepare_model (an init or a load under "
            "a per-rank seed, a rank-dependent branch), or updated differently (an optimizer that preconditions with "
            "statistics of this rank's own batches, such as K-FAC or Shampoo, gradients changed on one rank after "
            "the all-reduce, or a second backward through one forward of the model, backward(retain_graph=True) "
            "then another: DDP averages the gradients once per forward)")


# element size -> the integer type its bits are read as
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare(tensor: torch.Tensor, reference: int, group: Any, optimizers: Sequence[Any]) -> list[list[float]]:
    """Every rank's difference from rank ``reference``'s ``tensor``, and a digest of its ``optimizers``'
    hyperparameters (see ``_DETAIL``), gathered."""
    mine = tensor.detach().contiguous()
    theirs = mine.clone()
    dist.broadcast(theirs, dist.get_global_rank(group, reference) if group is not None else reference, group=group)
    kind = BITS[mine.element_size()]
    a, b = mine.reshape(-1).view(kind), theirs.reshape(-1).view(kind)
    where = (a != b).nonzero().reshape(-1)
    hypers = json.dumps([[key, value] for _, key, value in _group_numbers(optimizers)])
    detail = [float(len(where)), float(mine.numel()), 0.0, 0.0, 0.0, 0.0, 0.0, float(zlib.crc32(hypers.encode()))]
    if len(where) == 1:
        flipped = (int(a[where[0]]) ^ int(b[where[0]])) & ((1 << (8 * mine.element_size())) - 1)
        detail[2:5] = [float(bin(flipped).count("1")), float(flipped.bit_length() - 1), float(where[0])]
    if len(where):
        diff = (mine.double() - theirs.double()).abs().nan_to_num(nan=float("inf"))
        detail[5:7] = [float(diff.max()), float(theirs.double().abs().nan_to_num(nan=0.0).max())]
    return gather_rows(torch.tensor(detail, dtype=torch.float64, device=mine.device), group).tolist()


def heal(replicas: Any, found: Finding, differing: Sequence[torch.Tensor]) -> None:
    """Copy rank ``found.reference``'s differing weights and every optimizer state of the model to every rank,
    check that the fingerprints now agree, and say so in one line (rank 0)."""
    group, src = replicas.group, found.reference
    optimizers = [opt for opt, mine in replicas.optimizers.items() if mine]
    shape = _state_shape(optimizers)
    shapes = gather_rows(torch.tensor([zlib.crc32(shape.encode())], dtype=torch.int64, device=_device(replicas)),
                         group)
    if len(set(shapes[:, 0].tolist())) > 1:
        raise ReplicaError(f"{found.message(replicas.heal)}; cannot heal: the optimizer state has a different "
                           "layout on some ranks (one rank stepped a parameter the others did not)")
    device, moved = _device(replicas), 0
    with torch.no_grad():
        for tensor in list(differing) + list(_state_tensors(optimizers)):
            moved += _copy_from(tensor, src, group, device)
        # the hyperparameters too (lr): a rank-dependent one would make it drift again at once
        moved += _copy_numbers(_state_numbers(optimizers) + _group_numbers(optimizers), src, group, device)
    if dist.get_rank(group) == 0:
        print(f"ddpkit: healed {_ranks(found.job(found.odd()))} at step {found.step} from rank "
              f"{found.job([src])[0]}: {len(found.tensors)} "
              f"tensor(s) differed (first {found.tensors[0] if found.tensors else '-'}: {found.why()}); copied "
              f"{len(differing)} weight tensor(s) and the state of {len(optimizers)} optimizer(s), "
              f"{moved / 1e6:.3f} MB", file=sys.stderr, flush=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (hsdp), else the tensor itself."""
    if not callable(getattr(tensor, "to_local", None)):
        return tensor
    # detached first: the local view of a parameter that needs grad is an autograd view, which a heal may not
    # write into (the next backward would refuse it)
    return tensor.detach().to_local()  # type: ignore[attr-defined]  # a DTensor


def _device(replicas: Any) -> torch.device:
    return replicas.tensors[0].device


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def gather_rows(mine: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``mine`` (on the group's device), stacked by rank, on the CPU."""
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return torch.stack(everyone).cpu()


def _copy_from(tensor: torch.Tensor, src: int, group: Any, device: torch.device) -> int:
    """Rank ``src``'s ``tensor`` into everyone's, through the group's device (Adam's step count is a CPU tensor)."""
    data = local(tensor.detach())
    carrier = data.contiguous().to(device)  # itself when it is there already
    dist.broadcast(carrier, _global(group, src), group=group)
    if carrier.data_ptr() != data.data_ptr():
        data.copy_(carrier)
    return data.numel() * data.element_size()


def _states(optimizers: Sequence[Any]) -> Iterator[tuple[dict[str, Any], str, Any]]:
    """(state, key, value) of every optimizer, in the same order on every rank (groups, parameters, keys)."""
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                state = opt.state.get(param, {})
                for key in sorted(state, key=str):
                    yield state, key, state[key]


def _state_shape(optimizers: Sequence[Any]) -> str:
    """The layout of the optimizers' state and hyperparameters: what the heal copies, equal on every rank first."""
    return json.dumps([[str(key), list(local(v).shape) if torch.is_tensor(v) else type(v).__name__]
                       for _, key, v in _states(optimizers)] +
                      [[key, len(v) if isinstance(v, tuple) else 0] for _, key, v in _group_numbers(optimizers)])


def _state_tensors(optimizers: Sequence[Any]) -> Iterator[torch.Tensor]:
    return (v for _, _, v in _states(optimizers) if torch.is_tensor(v))


def _group_numbers(optimizers: Sequence[Any]) -> list[tuple[dict[str, Any], str, Any]]:
    """(group, key, value) of every number (or tuple of numbers: Adam's ``betas``) of the optimizers'
    ``param_groups``, in the same order on every rank."""
    found = []
    for opt in optimizers:
        for group in opt.param_groups:
            for key in sorted(k for k in group if k != "params"):
                value = group[key]
                items = value if isinstance(value, tuple) else (value,)
                if items and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
                    found.append((group, key, value))
    return found


def _copy_numbers(numbers: list[tuple[dict[str, Any], str, Any]], src: int, group: Any,
                  device: torch.device) -> int:
    """Rank ``src``'s numbers (an optimizer's state or hyperparameters) into everyone's, each keeping its type."""
    flat = [float(v) for _, _, value in numbers for v in (value if isinstance(value, tuple) else (value,))]
    if not flat:
        return 0
    values = torch.tensor(flat, dtype=torch.float64, device=device)
    dist.broadcast(values, _global(group, src), group=group)
    received = iter(values.tolist())
    for holder, key, old in numbers:
        if isinstance(old, tuple):
            holder[key] = tuple(type(o)(next(received)) for o in old)
        else:
            holder[key] = type(old)(next(received))
    return 8 * len(flat)


def _state_numbers(optimizers: Sequence[Any]) -> list[tuple[dict[str, Any], str, Any]]:
    return [(s, k, v) for s, k, v in _states(optimizers)
            if isinstance(v, (int, float)) and not isinstance(v, bool)]
