"""Rounding that decides a step, told from a defect: the one-process re-runs from perturbed initial weights.

Some networks compute a value that is exactly 0 in exact arithmetic and branch on its sign: a zero padding after a
BatchNorm (MobileNetV2's ``F.pad`` before a depthwise conv, a DeepLabV3+ backbone) makes a border whose BatchNorm
output is ``-mean x invstd`` of a channel whose mean is exactly 0, so the ReLU after it passes or blocks the whole
border on the sign of a rounding error (1e-17 in float64). One process summing the global batch and N processes
merging their shares round differently, the border's gradient goes one way or the other, and the runs part from
step 1 by a real amount, in float64 as in float32: the float64 re-run (:mod:`.rounding`) cannot excuse it.

So when the float64 runs still differ and no cause was found, the one-process run goes again :data:`RERUNS` times
from the same initial weights each multiplied by ``1 + eps x N(0, 1)`` (eps: float32's, 1.2e-7, what rounding the
float32 training makes could move; a seed per re-run): the same training, rounded otherwise (a structural 0 stays
0: BatchNorm subtracts its mean whatever the weights). First it goes once unperturbed, and must end bit for bit
where it did: draws verify cannot see (an unseeded ``np.random.default_rng()``) would make the floor theirs.
Per tensor, the farthest apart of the first run and the perturbed ones is how far rounding alone moves this
training (its floor); a tensor of the N-process run that differs beyond the tolerance must be within
:func:`ddpkit.commands.verify.draws.factor` times that (L2; no tolerance added: review). Measured on a
BatchNorm-pad-conv-BatchNorm-ReLU network (5 steps, float64): the perturbed re-runs parted from the first by up
to 0.011 (a BatchNorm bias), the correct 2-process run by 0.0046 at most, within it everywhere; per-rank
BatchNorm statistics (a defect) parted the conv weights 34x-60x beyond their floor under SGD, 18x-24x under Adam.
Without the pad the floor is what 1e-7 grows to in the steps taken: a defect stands out.

Example::

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Linear(2, 2, dtype=torch.float64)
    >>> before = net.weight.detach().clone()
    >>> perturb(net, 1)
    >>> bool((net.weight != before).any()), float((net.weight / before - 1).abs().max()) < 1e-5
    (True, True)
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.commands.verify import draws
from ddpkit.commands.verify.causes import lr_differs

RERUNS = 2  # the floor is the farthest apart of the first run and these, every pair (as draws' is)
# float32's rounding, in the float64 re-runs: what rounding the float32 training makes could move; float64's own
# (2.2e-16) left a tie unflipped at a larger batch (review: 1.5e-17 floors, a correct run FAILed 3e14x beyond)
EPS = float(torch.finfo(torch.float32).eps)
SEED = 104729  # each re-run K draws its perturbation from SEED + K: not the script's own generator


def perturb(model: nn.Module, k: int) -> None:
    """Each floating parameter times ``1 + eps x N(0, 1)``, drawn from a generator of its own (seed ``SEED + k``):
    the script's generator is not touched, so the training draws what the first run drew."""
    generator = torch.Generator().manual_seed(SEED + k)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                factor = 1 + EPS * noise
                param.mul_(factor.to(device=param.device, dtype=param.dtype))


def worth_measuring(result: dict, matched: bool = False) -> bool:
    """A float64 FAIL of finite weights with no cause found (not a constant factor between the step-1 gradients,
    not learning rates that differ), whose steps drew nothing, or only from torch's generator in ``matched`` runs
    (the same numbers at 1 process and N; a loader's workers' draws count once the re-runs with other draws found
    they move nothing): draws of their own would move the floor. What rounding alone makes there decides.

    >>> worth_measuring({"passed": False, "non_finite": False, "max_abs_diff": 0.01})
    True
    >>> worth_measuring({"passed": False, "non_finite": False, "max_abs_diff": 0.01, "gradient_factor": 2.0})
    False
    >>> fail = {"passed": False, "non_finite": False, "max_abs_diff": 0.01, "random_draws": True}
    >>> torch_only, with_random = {**fail, "draw_sources": ["torch"]}, {**fail, "draw_sources": ["random"]}
    >>> worth_measuring(torch_only, True), worth_measuring(with_random, True), worth_measuring(torch_only)
    (True, False, False)
    """
    if result.get("passed") or result.get("non_finite") or result.get("max_abs_diff") is None or \
            result.get("autocast"):
        return False
    if result.get("random_draws") and not (matched and result.get("matchable", True) and
                                           set(result.get("draw_sources") or ()) <= {"torch"}):
        return False
    return result.get("gradient_factor") is None and lr_differs(result.get("lrs") or []) is None


def measure(one: dict, many: dict, runs: list[dict], tol: tuple[float, float]) -> dict:
    """The N-process run against the floor: ``runs[0]`` the one-process run again unperturbed (it must end bit
    for bit where the first did: draws verify cannot see, an unseeded ``default_rng()``, would make the floor
    theirs), ``runs[1:]`` perturbed. Per tensor, within the tolerance element by element, or no farther (L2) than
    :func:`draws.factor` times the farthest apart of the one-process runs; the worst beyond, else None."""
    control, others = runs[0], runs[1:]
    if control.keys() != one.keys() or not all(torch.equal(control[k], one[k]) for k in one):
        # (how far apart the two unchanged runs ended, against how far the N-process run is: review 43)
        moved = max((float((control[k].double() - one[k].double()).abs().max()) for k in one
                     if k in control and one[k].is_floating_point() and control[k].shape == one[k].shape),
                    default=float("inf"))
        return {"worst": None, "floor": 0.0, "reached": False, "unrepeatable": True, "control_diff": moved}
    atol, rtol = tol
    worst, floor = None, 0.0
    for name, ref in one.items():
        if name not in many or not ref.is_floating_point() or any(name not in o for o in others):
            continue
        other = many[name].to(ref.dtype)
        if torch.allclose(other, ref, atol=atol, rtol=rtol):
            continue
        gap = float((other.double() - ref.double()).norm())
        spread = max(float((a[name].double() - b[name].double()).norm())
                     for i, a in enumerate([one, *others]) for b in [one, *others][i + 1:])
        floor = max(floor, spread)
        allowed = draws.factor(ref.numel()) * spread
        if gap > allowed and (worst is None or gap - allowed > worst[3]):
            worst = (name, gap, spread, gap - allowed)
    return {"worst": None if worst is None else list(worst[:3]), "floor": floor, "reached": floor > 0}


def decided(float64: dict) -> dict | None:
    """A PASS decided by the floor when every tensor of the float64 N-process run is within what rounding alone
    makes; None when the floor was not measured or a tensor is beyond it (the FAIL stands: :func:`beyond`)."""
    floor = float64.get("floor")
    if not floor or floor["worst"] is not None or not floor["reached"]:
        return None
    diff = float64.get("max_abs_diff")
    note = (f"decided by {RERUNS} one-process float64 re-runs from initial weights perturbed by float32 rounding "
            f"(x (1 + {EPS:.2g} x N(0,1))): they moved a tensor by up to {floor['floor']:.3g} (L2), and every tensor "
            f"of the {float64['nproc']}-process run that differs beyond the tolerance is within {draws.FACTOR:g}x of "
            f"what they make in it (more for a tensor of under {draws.SMALL} elements; its largest difference "
            f"{'n/a' if diff is None else format(diff, '.3g')}): this training turns rounding into differences of "
            "that size (a ReLU on a value that is exactly 0 in exact arithmetic, e.g. zero padding after "
            "BatchNorm); a defect smaller than that is not seen here")
    return {**float64, "passed": True, "decided_by": "rounding floor", "rounding_note": note, "cause": None}


def beyond(float64: dict) -> str:
    """What the floor says of a FAIL it leaves standing ('' when none was measured)."""
    floor = float64.get("floor")
    if floor and floor.get("unrepeatable"):
        return ("; the one-process run ran again unchanged did not end where it did (draws verify cannot see, such "
                "as an unseeded np.random.default_rng()), so no floor of rounding could be measured")
    if not floor or floor["worst"] is None:
        return ""
    name, gap, spread = floor["worst"]
    times = f"{gap / spread:.3g}x" if spread else "while"
    return (f"; {name!r} differs by {gap:.3g} (L2), {times} what one-process re-runs from rounding-perturbed "
            f"initial weights make there ({spread:.3g})")
