"""Float rounding or a defect: ``ddpkit verify``'s float64 re-run.

A weight whose exact gradient is zero (a conv or linear bias right before a BatchNorm, which subtracts the batch
mean: the bias cancels) gets float32 rounding noise, and the noise of one process summing the global batch differs
from that of N processes averaging their shares. SGD moves such a weight by lr x noise: nothing. Adam and its kin
divide each gradient by its own running size, so noise of 1e-9 moves the weight by up to about lr, and the two
correct runs part by ~lr. :mod:`ddpkit.commands.verify.noise` excuses that when an element's gradient is noise next
to its own tensor's largest, which cannot see a tensor that is noise throughout (every element of that bias).

Rounding also grows under plain SGD: a deep BatchNorm network (a CIFAR ResNet-20, lr 0.1, momentum 0.9) starts
with step-1 gradients 7.5e-4 apart, relative (one BatchNorm summing the global batch in float32, the synchronised
one merging the ranks' statistics in float64), and ends 4e-3 apart after 5 steps; in float64, 1.5e-14. And how
far apart rounding puts the step-1 gradients depends on the network's conditioning: a BatchNorm over inputs near
3000 parted them by 0.13, more than per-rank statistics (a defect) did in the ResNet (0.064).

So when a run FAILs with no cause found yet (not a constant factor between the step-1 gradients, not learning
rates that differ), and without autocast or random draws, verify runs both sides again with the prepared model
in float64 (:func:`to_float64`: parameters and buffers, float inputs cast up at its forward, float outputs cast
back, so the script's loss code sees what it always did; torch's default dtype float64 during its forward, for
tensors made there, while the script's own outside it stay float32). Rounding noise falls ~1e-9 times lower, below
Adam's ``eps``, and the runs then agree;
a real defect (unsynced statistics, rank-dependent code, an update outside backward) changes real gradients and
still differs. The PASS or FAIL line says which test decided. A defect's FAIL costs the re-run's time (about
2.5x the float32 runs on a CPU).

Example::

    >>> worth_rerun({"passed": False, "non_finite": False, "optimizers": ["AdamW"]})
    True
    >>> worth_rerun({"passed": False, "non_finite": False, "lrs": [0.1, 0.2]})
    False
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ddpkit.commands.verify import perturbed
from ddpkit.commands.verify.causes import lr_differs

# optimizers that scale each element's step by its own gradient history: float noise becomes an lr-sized step
ADAPTIVE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor",
            "FusedAdam", "Lion", "Muon", "Rprop", "Lamb", "LAMB", "Adam8bit", "AdamW8bit", "PagedAdamW"}


def worth_rerun(result: dict) -> bool:
    """A finite FAIL without autocast (whose bf16/fp16 rounding a float64 model would not remove), without random
    draws in the step (which differ by design) and with no cause already found (step-1 gradients a constant factor
    apart, learning rates that differ). How far apart the step-1 gradients are decides nothing: rounding
    cancelled in a badly conditioned BatchNorm (inputs near 3000) parted them by 0.13, per-rank statistics by 0.06.

    >>> worth_rerun({"passed": False, "non_finite": False, "optimizers": ["SGD"], "gradient_gap": 7.5e-4})
    True
    >>> worth_rerun({"passed": False, "non_finite": False, "gradient_factor": 2.0})
    False
    """
    if result.get("passed") or result.get("non_finite") or result.get("autocast") or result.get("random_draws"):
        return False
    return result.get("gradient_factor") is None and lr_differs(result.get("lrs") or []) is None


def why_rerun(result: dict) -> str:
    """Why :func:`worth_rerun` holds, as verify says it before the re-run.

    >>> why_rerun({"optimizers": ["SGD"], "gradient_gap": 7.5e-4})
    'the step-1 gradients are 0.00075 apart (relative), which float rounding can make'
    """
    if ADAPTIVE & set(result.get("optimizers") or ()):
        return "an adaptive optimizer stepped"
    gap = result.get("gradient_gap")
    return "no cause was found" if gap is None else \
        f"the step-1 gradients are {gap:.2g} apart (relative), which float rounding can make"


def to_float64(model: nn.Module) -> None:
    """``model`` in float64 in place, before it is wrapped: float inputs are cast up at its forward and its float
    outputs back to float32, so a loss computed next to float32 targets runs unchanged. The hooks are functions of
    this module: a script's ``torch.save(model)`` pickles them."""
    model.double()
    model.register_forward_pre_hook(_inputs_up, with_kwargs=True)
    model.register_forward_hook(_outputs_back)
    for inner in list(model.modules())[1:]:  # ``model.forward(x)`` skips the model's hooks: its layers' cast too
        if not isinstance(inner, torch.jit.ScriptModule):  # (which take no hooks)
            inner.register_forward_pre_hook(_layer_inputs_up, with_kwargs=True)


_DEFAULTS: list[torch.dtype] = []  # the default dtypes the forwards in progress replaced (a model in a model)


def _inputs_up(module: nn.Module, args: Any, kwargs: Any) -> Any:
    # tensors the model makes in its forward (an LSTM's h0 = torch.zeros(...)) are float64 too; outside it the
    # script's own (a DCGAN's labels, torch.full(...)) stay float32, as the outputs cast back are
    _DEFAULTS.append(torch.get_default_dtype())
    torch.set_default_dtype(torch.float64)
    _PROMOTING.append(_Promote())  # during this forward only: outside it the script's float32 stays as it is
    _PROMOTING[-1].__enter__()
    return _cast(args, torch.float64), _cast(kwargs, torch.float64)


_PROMOTING: list[TorchFunctionMode] = []  # the modes of the float64 forwards in progress (a model in a model)


class _Promote(TorchFunctionMode):
    """In a float64 model's forward, an op that mixes float32 and float64 tensors gets them all in float64: R-BERT's
    ``torch.bmm(e1_mask.float(), hidden)`` made a float32 mask meet the float64 hidden states (``expected scalar type
    Double but found Float``). An in-place op keeps its tensor's dtype: the others are cast to it instead.

    >>> with _Promote():
    ...     torch.bmm(torch.ones(1, 1, 2), torch.ones(1, 2, 1, dtype=torch.float64)).dtype
    torch.float64
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        floats = {t.dtype for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64)}
        if len(floats) < 2:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.endswith("__") or name == "__setitem__" or \
            name.startswith("__i") and name[3:-2] in ("add", "sub", "mul", "truediv", "floordiv", "pow")
        if in_place and args and isinstance(args[0], torch.Tensor):  # (``out[:, i] = h``: written into out)
            return func(args[0], *_cast(tuple(args[1:]), args[0].dtype), **_cast(kwargs, args[0].dtype))
        return func(*_cast(tuple(args), torch.float64), **_cast(kwargs, torch.float64))



def _layer_inputs_up(module: nn.Module, args: Any, kwargs: Any) -> Any:
    return _cast(args, torch.float64), _cast(kwargs, torch.float64)


def _outputs_back(module: nn.Module, args: Any, output: Any) -> Any:
    if _DEFAULTS:
        torch.set_default_dtype(_DEFAULTS.pop())
    if _PROMOTING:
        _PROMOTING.pop().__exit__(None, None, None)
    return _cast(output, torch.float32)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Every float tensor in ``value`` as ``dtype``, the containers' own types kept (a namedtuple, a dict subclass
    such as Hugging Face's ``ModelOutput``, a dataclass).

    >>> import collections; Out = collections.namedtuple("Out", "loss ids")
    >>> got = _cast(Out(torch.ones(1), torch.arange(2)), torch.float64)
    >>> type(got).__name__, got.loss.dtype, got.ids.dtype
    ('Out', torch.float64, torch.int64)
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex():  # a spectrum: its complex kin (complex64 beside float32)
            return value.to(torch.complex128 if dtype == torch.float64 else torch.complex64)
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_cast(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: _cast(v, dtype) for k, v in value.items()}
        copy = copy_module.copy(value)  # a dict subclass (ModelOutput): its type and attributes kept
        for k, v in value.items():
            copy[k] = _cast(v, dtype)
        return copy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _cast(getattr(value, f.name), dtype)
                                             for f in dataclasses.fields(value) if f.init})
    return value


# How much closer the float64 runs must end than the float32 ones for the difference to be rounding: float64
# rounds 1e-9 times finer; a training that amplifies it saturates the float32 gap (Stand-Alone-Self-Attention at
# lr 0.1: 0.903 in float32, 9.2e-05 in float64); a defect differs about as much in both (rank-dependent code, a
# skipped all-reduce: the same ratio ~1).
SHRINK = 1e-3


# float64 step-1 gradients this close (relative, the whole model) differ by rounding alone: a defect that acts
# from the first step (per-rank statistics, rank-dependent code, a skipped all-reduce) parts them by its own size
STEP1_ROUNDING = 1e-9


def amplified(float32: dict, float64: dict) -> bool:
    """Rounding the training amplifies: the float64 runs' step-1 gradients agree to float64 rounding
    (:data:`STEP1_ROUNDING`), and they end at least 1/:data:`SHRINK` times closer than the float32 ones, over every
    tensor: what still parts them is at most 1/1000 of what float32 rounding alone does to this training.

    >>> f32 = {"max_abs_diff": 0.903}
    >>> amplified(f32, {"max_abs_diff": 9.2e-05, "gradient_gap": 3e-15})
    True
    >>> amplified(f32, {"max_abs_diff": 9.2e-05, "gradient_gap": 0.01}), amplified(f32, {"max_abs_diff": 0.04})
    (False, False)
    """
    diff32, diff64 = _largest(float32), _largest(float64)
    gap = float64.get("gradient_gap")
    return diff32 is not None and diff64 is not None and diff32 > 0 and diff64 <= SHRINK * diff32 and \
        gap is not None and gap <= STEP1_ROUNDING


def _largest(result: dict) -> float | None:
    """The largest difference a result saw, over every tensor."""
    found = [result[k] for k in ("max_abs_diff", "first_max_abs_diff") if result.get(k) is not None]
    return max(found) if found else None


def decided(float32: dict, float64: dict | None, error: str | None = None) -> dict:
    """The result verify reports: the float64 runs' when they pass (rounding was all) or end :func:`amplified`
    closer (rounding grown by the training), else the float32 FAIL with what the re-run found. ``error``: why the
    float64 runs could not run."""
    diff = float32.get("first_max_abs_diff", float32.get("max_abs_diff"))
    where = f"{float32.get('first_diverging')!r} {diff:.3g} apart" if diff is not None else "apart"
    if float64 is not None and float64.get("passed"):
        if ADAPTIVE & set(float32.get("optimizers") or ()):
            grown = ("float rounding that an adaptive optimizer magnified (a weight whose exact gradient is 0, e.g. a "
                     "bias right before BatchNorm)")
        else:
            gap = float32.get("gradient_gap")
            grown = ("float rounding grown over the steps (the step-1 gradients "
                     f"{'equal' if not gap else format(gap, '.2g') + ' apart, relative'}: sums in another order and "
                     "precision, e.g. BatchNorm's statistics over the global batch)")
        note = (f"decided by a float64 re-run: in float32 the runs ended {where}, {grown}; in float64 they match "
                f"(max abs diff {float64['max_abs_diff']:.3g})")
        return {**float64, "decided_by": "float64", "rounding_note": note}
    if float64 is not None:
        f64 = float64.get("first_max_abs_diff", float64.get("max_abs_diff"))
        if amplified(float32, float64):
            d32, d64 = _largest(float32) or 0.0, _largest(float64) or 0.0
            note = (f"decided by a float64 re-run: in float32 the runs ended {d32:.3g} apart, in float64 {d64:.3g}, "
                    f"{d32 / max(d64, 1e-300):.2g} times closer, their step-1 gradients "
                    f"{float64['gradient_gap']:.2g} apart: float rounding that this training amplifies step by step "
                    "(a defect parts the float64 runs from the first step, and as far as the float32 ones); the "
                    "comparison is weak here: verify at a lower lr, or fewer --steps, for a stronger one")
            return {**float64, "passed": True, "decided_by": "float64", "rounding_note": note}
        floor = perturbed.decided(float64)
        if floor is not None:  # rounding decides a step here (a ReLU at an exact 0), in float64 as in float32
            return floor
        note = (f"the float64 re-run differs too ({float64.get('first_diverging')!r}, max abs diff "
                f"{f64 if f64 is None else format(f64, '.3g')}): not float rounding{perturbed.beyond(float64)}")
    else:
        note = (f"the float64 re-run could not run: the model does not run in float64 ({error}; a line that runs "
                "in float32), so float rounding is not ruled out")
    floor = {"floor": float64["floor"]} if float64 is not None and float64.get("floor") else {}
    # (what matched.defect weighs: apart in float64 too, not rounding that a step decides)
    apart = {"float64_apart": {"name": float64.get("first_diverging"), "diff": float64.get(
        "first_max_abs_diff", float64.get("max_abs_diff"))}} if float64 is not None else {}
    return {**float32, **floor, **apart, "decided_by": "float32", "rounding_note": note}
