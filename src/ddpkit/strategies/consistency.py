"""Catch ranks that silently stop computing the same thing.

- :class:`FirstBackwardCheck` names, at the end of the first backward, every parameter that received no
  gradient. Without it DDP (``find_unused_parameters=False``) lets the first optimizer step run on
  gradients that were never all-reduced and only fails at the second forward with "Expected to have
  finished reduction in the prior iteration".
- :func:`check_in_sync` compares per-parameter checksums across ranks and names the first that differs, or
  the first that is NaN / inf on every rank (the run diverged: the ranks agree, the loss blew up). DDP runs it
  before the first training step of every run: ranks that start with different weights (an init applied after
  the wrap under a per-rank seed) would otherwise train a different model each, with no error ever.

Example::

    check_in_sync(model)          # raises RuntimeError("... '2.weight' differs between ranks ...")
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.syncbn import SyncBatchNorm


class FirstBackwardCheck:
    """Hooks every trainable parameter for the first backward only, then removes the hooks."""

    def __init__(self, module: nn.Module):
        self.names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        self.seen: set[nn.Parameter] = set()
        self.queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.names]

    def _on_grad(self, param: nn.Parameter) -> None:
        self.seen.add(param)
        if not self.queued:
            # runs once the whole backward pass is done, still inside loss.backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.queued = True

    def _finish(self) -> None:
        for handle in self.handles:
            handle.remove()
        unused = [name for p, name in self.names.items() if p not in self.seen]
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise RuntimeError(
                f"{len(unused)} parameter(s) got no gradient in the first backward: {shown}. DDP cannot "
                "all-reduce them; pass prepare_model(model, find_unused_parameters=True) if some layers are "
                "skipped on purpose (comm=ddpkit.CommConfig(static_graph=True) when always the same ones), or "
                "freeze them with requires_grad_(False)")


REDUCTION = "Expected to have finished reduction in the prior iteration"


def unused_later(module: nn.Module, ignore: frozenset[str] | set[str], message: str) -> str | None:
    """DDP's "Expected to have finished reduction" at a forward (a step after the first skipped parameters the
    first backward had: a discriminator's extra head used only in its own step, not in the generator's), said
    with the parameters' names and what to do; None for any other error. DDP gives only their indices in its
    reducer's order (trainable parameters, module by module, each once, those ignored left out).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> unused_later(net, set(), REDUCTION + " ... did not receive grad for rank 1: 2 3\\n")[:62]
    '2 parameter(s) got no gradient in the step before this forward'
    """
    if REDUCTION not in message:
        return None
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
    order: dict[int, str] = {}  # (a parameter shared by two modules: once, where first met)
    for prefix, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if p.requires_grad and full not in ignore:
                order.setdefault(id(p), full)
    names = list(order.values())
    unused = [names[int(i)] for i in (found.group(1).split() if found else ()) if int(i) < len(names)]
    shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "") if unused else \
        "some parameters (DDP named none)"
    return (f"{len(unused) or 'some'} parameter(s) got no gradient in the step before this forward: {shown} (a "
            "branch of forward that step skipped, or an output left out of its loss, though the first backward had "
            "them all): DDP all-reduces every parameter each step; pass prepare_model(model, "
            "find_unused_parameters=True) if some steps skip them on purpose (then call the model once per "
            "backward: a GAN's discriminator on torch.cat([real, fake]), not twice), or freeze them with "
            "requires_grad_(False) where they are not trained")


def local_buffers(module: nn.Module) -> set[str]:
    """Buffers each rank updates from its own data: the running statistics of BatchNorm that is not synced
    (``sync_batchnorm=False``). They differ between ranks by design until DDP broadcasts rank 0's at the next
    forward, so comparing them would report a desync that is not one.

    >>> sorted(local_buffers(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
    ['1.num_batches_tracked', '1.running_mean', '1.running_var']
    """
    synced = (nn.SyncBatchNorm, SyncBatchNorm)
    return {f"{prefix}.{name}" if prefix else name
            for prefix, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, synced)
            for name, _ in m.named_buffers(recurse=False)}


def _checksums(module: nn.Module, buffers: bool = True, ignore=frozenset()) -> tuple[list[str], torch.Tensor]:
    names, sums = [], []
    skip = local_buffers(module) | set(ignore)
    for name, tensor in list(module.named_parameters()) + (list(module.named_buffers()) if buffers else []):
        if tensor.is_floating_point() and name not in skip:
            names.append(name)
            sums.append(_sums(tensor.detach()))
    return names, torch.stack(sums) if sums else torch.zeros(0, 4, dtype=torch.float64)


_CHUNK = 1 << 24  # elements made float64 at a time: an embedding of 500M would otherwise need 4 GB more at once
_BITS = {1: torch.int8, 2: torch.int16}  # element size -> the integer type its bits are read as (else int32)


def _sums(tensor: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, bits high, bits low] in float64, a chunk at a time.

    The float sums say NaN / inf and show in messages; ranks are compared on the bits: the wrapping int64 sum
    of the elements' bit patterns, which no thread count or reduction order changes (a float sum does: ranks
    on nodes with different core counts run different OMP_NUM_THREADS), split in halves a float64 holds exactly.

    >>> _sums(torch.tensor([1.0, 2.0, 3.0]))[:2].tolist()
    [6.0, 14.0]
    """
    total = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    bits = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for chunk in tensor.reshape(-1).split(_CHUNK):
        part = chunk.double()
        total += torch.stack([part.sum(), (part * part).sum()])
        bits += chunk.contiguous().view(_BITS.get(chunk.element_size(), torch.int32)).to(torch.int64).sum()
    return torch.cat([total, torch.stack([bits >> 32, bits & 0xFFFFFFFF]).double()])


# Called from DDP's untraced forward, whose callees dynamo would compile: a .item() there broke the graph and
# recompiled (torch.compile of a prepared model must meet nothing of ddpkit's)
@torch.compiler.disable
def check_in_sync(module: nn.Module, group=None, *, first_step: bool = False, buffers: bool = True,
                  ignore=frozenset()) -> None:
    """Raise on every rank, naming the first parameter or buffer whose checksum differs between ranks, or
    that holds NaN / inf on every rank (a divergence, not a desync: see :func:`sync_problem`).

    ``first_step``: the check before the first training step, whose error names what makes ranks start
    different; ``buffers=False`` leaves buffers out (DDP broadcasts rank 0's at every forward); ``ignore``:
    names left out (DDP's ``parameters_to_ignore``: per-rank by design).
    A no-op without a process group. Costs one all_gather of four float64 numbers per tensor.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    names, local = _checksums(module, buffers, ignore)
    device = next(module.parameters()).device if any(True for _ in module.parameters()) else local.device
    local = local.to(device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    problem = sync_problem(names, torch.stack(everyone).cpu(), first_step)
    if problem:
        raise RuntimeError(problem)


def diverged_line(name: str) -> str:
    """The line for a tensor that holds NaN or inf on every rank: the loss blew up, the ranks agree.

    >>> diverged_line("w")[:40]
    "training diverged: 'w' holds NaN or inf "
    """
    return (f"training diverged: {name!r} holds NaN or inf on every rank (the loss blew up; not a desync): check "
            "the learning rate, the loss scaling (fp16 needs a GradScaler) and the input data for NaN / inf")


def sync_problem(names: list[str], sums: torch.Tensor, first_step: bool = False) -> str | None:
    """The error for the first tensor whose checksums (``sums[rank, tensor] = [sum, sum of squares]``, then
    optionally the two halves of its bits' sum, on which ranks are compared: see :func:`_sums`) are non-finite
    on every rank (the run diverged; not at the ``first_step``) or differ between ranks (a desync); None when
    all agree.

    NaN never equals NaN, so without the first rule a loss that blew up on every rank read as "ranks out of
    sync" and sent people hunting for a rank-dependent branch. NaN on some ranks only stays a desync.

    >>> nan = float("nan")
    >>> sync_problem(["w"], torch.tensor([[[nan, nan]], [[nan, nan]]]))[:50]
    "training diverged: 'w' holds NaN or inf on every r"
    >>> sync_problem(["w"], torch.tensor([[[1.0, 1.0]], [[1.0, 1.0]]])) is None
    True
    >>> sync_problem(["w"], torch.tensor([[[1.0, 1.0]], [[2.0, 4.0]]]), first_step=True)[:60]
    "ranks start different: 'w' differs between rank 0 and rank 1"
    """
    floats, exact = sums[..., :2], sums[..., 2:] if sums.shape[-1] > 2 else sums  # (ranks, tensors, 2)
    diverged = (~torch.isfinite(floats).all(dim=2)).all(dim=0)  # per tensor: NaN or inf on every rank
    same = ((exact == exact[:1]) | (exact.isnan() & exact[:1].isnan())).all(dim=2)  # (ranks, tensors)
    # at the first step nothing has trained: a tensor that holds -inf by design (a causal mask) is no divergence
    wrong = ~same.all(dim=0) | (diverged & (not first_step))
    if not bool(wrong.any()):  # one test for every tensor and rank; what follows only names the first culprit
        return None
    i = int(wrong.nonzero()[0])
    name = names[i]
    if bool(diverged[i]) and not first_step:
        return diverged_line(name)
    rank = int((~same[:, i]).nonzero()[0])
    shown = f"sum {floats[0, i, 0].item():.17g} vs {floats[rank, i, 0].item():.17g}"
    if first_step:
        return (f"ranks start different: {name!r} differs between rank 0 and rank {rank} at the first training "
                f"step ({shown}). prepare_model gave every rank rank 0's weights, so something changed them after "
                "it on some ranks: weights initialised after prepare_model (model.apply(init) under a per-rank "
                "seed) or a checkpoint loaded on one rank only; initialise and load before prepare_model, or the "
                "same way on every rank")
    return (f"ranks out of sync: {name!r} differs between rank 0 and rank {rank} ({shown}); something "
            "rank-dependent changed the weights (an update outside backward, a rank-dependent branch, an unsynced "
            "buffer)")
