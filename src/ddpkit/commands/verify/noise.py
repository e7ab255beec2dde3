"""Which weights ``ddpkit verify`` may not hold to its tolerance: those whose gradients were only float noise.

Some gradients are exactly zero in exact arithmetic: softmax ignores a constant added to every key, so the key
part of an attention's ``in_proj_bias`` gets none. In floats it gets rounding noise (~1e-9 where the tensor's
largest gradient is ~1e-2), and the noise of one process summing the global batch differs from that of N
processes averaging their halves. SGD turns that noise into an update of lr x 1e-9: invisible. Adam / AdamW
normalise each element's gradient by its own running size, so their first steps move even a noise element by
up to about lr: the two runs, both correct, end up to ~lr apart there.

An element is excused when, in BOTH runs, its largest gradient over the steps compared is at float-noise level
(at most :data:`NOISE_ULPS` float epsilons times the largest gradient of its tensor in that run) AND the runs'
weights there are no further apart than the optimizers could move a weight in those steps (:func:`step_bound`).
An element with a real gradient in either run is compared as before: a real defect (a summed loss, unsynced
statistics, rank-dependent code) changes real gradients, so it still FAILs.

Example::

    >>> w = {"b": torch.tensor([1.0, 2.0])}
    >>> peak = {"b": torch.tensor([0.5, 1e-10])}  # element 1: float noise next to a real gradient of 0.5
    >>> noise_mask(w, {"b": torch.tensor([1.0, 2.004])}, peak, peak, bound=step_bound(3, 1e-3))["b"].tolist()
    [False, True]
"""

from __future__ import annotations

import torch

# A gradient within this many float epsilons of its tensor's largest is rounding noise: a sum of a few hundred
# terms cancelling exactly is off by about sqrt(terms) ulps of its largest term, and float32's eps is 1.2e-7,
# so the threshold sits at ~8e-6 of the largest gradient, far below any gradient a weight learns from.
NOISE_ULPS = 64

# Adam's step is lr * m / (sqrt(v) + eps) with |m| / sqrt(v) <= 1 for a steady gradient; a gradient that swings
# in size can push it above 1 for a step, so each run is allowed twice lr per step, in either direction.
STEP_FACTOR = 2.0


def step_bound(steps: int, lr: float) -> float:
    """How far apart two runs may end on an element whose gradients are noise: each moves at most
    :data:`STEP_FACTOR` x lr per step, in opposite directions at worst.

    >>> step_bound(5, 1e-3)
    0.02
    """
    return 2 * STEP_FACTOR * steps * lr


def is_noise(peak: torch.Tensor) -> torch.Tensor:
    """Elements whose largest |gradient| is at float-noise level next to the largest of the tensor.

    >>> is_noise(torch.tensor([0.5, 1e-10, 0.0])).tolist()
    [False, True, True]
    """
    dtype = peak.dtype if peak.is_floating_point() else torch.float32
    top = peak.abs().max() if peak.numel() else torch.tensor(0.0)
    return peak.abs() <= NOISE_ULPS * torch.finfo(dtype).eps * top


def noise_mask(one: dict[str, torch.Tensor], many: dict[str, torch.Tensor], peak_one: dict[str, torch.Tensor],
               peak_many: dict[str, torch.Tensor], bound: float) -> dict[str, torch.Tensor]:
    """Per tensor, the elements verify excuses (see the module docstring); only tensors with any.

    ``one`` / ``many``: the runs' final weights; ``peak_*``: each run's largest |gradient| per element over
    the steps (:mod:`ddpkit.commands.verify.recorder`); ``bound``: :func:`step_bound` (0: excuse nothing).
    """
    masks = {}
    for name, a in one.items():
        b, pa, pb = many.get(name), peak_one.get(name), peak_many.get(name)
        if bound <= 0 or b is None or pa is None or pb is None or not (a.shape == b.shape == pa.shape == pb.shape):
            continue
        if a.is_complex() or not a.is_floating_point():
            continue
        close = (a.double() - b.double()).abs() <= bound
        mask = is_noise(pa) & is_noise(pb) & close
        if bool(mask.any()):
            masks[name] = mask
    return masks


def excused_line(count: int, names: list[str], lr: float) -> str:
    """The PASS line's note on what was excluded, and why.

    >>> excused_line(16, ["block.self_attn.in_proj_bias"], 5e-3)[:60]
    '16 elements with ~0 gradients excluded (block.self_attn.in_p'
    """
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{count} elements with ~0 gradients excluded ({shown}): their float noise differs between the runs "
            f"and an adaptive optimizer (Adam, AdamW) moves a weight by up to about lr ({lr:g}) per step whatever "
            "its gradient's size; both runs are correct")
