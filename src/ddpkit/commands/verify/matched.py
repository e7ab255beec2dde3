"""The step's random draws matched between one process and N: ``ddpkit verify``'s re-run for a script that draws
noise in its training steps (a GAN's ``z``, a VAE's ``randn_like``, functional dropout).

One process draws ``torch.randn(B, 100)`` for its batch of B; each of N processes draws ``randn(B / N, 100)`` for
its share, from its own generator: the numbers differ by design, so the weights cannot match exactly. In this
re-run (both sides), from the first training batch on, each such draw is made from a generator of its own, seeded
by the optimizer step and the draw's place in that step, the same in both runs: a draw whose first dimension is
the process's batch is made for the global batch (B rows) and the process keeps its rows, the ones ddpkit's
sampler gives it (``r, r + N, ...``: row i of one process's batch is rank ``i % N``'s row ``i // N``); any other
draw (a fixed-size noise, a scalar) is the same in every process. A correct script then computes, at N
processes, what one process computes; a defect still differs. Draws from Python's ``random`` or numpy, and
``randperm`` (a permutation of the batch cannot be shared), are left as they are.

Example (one process with the global batch of 4, and rank 1 of 2 with its share of 2)::

    >>> one, two = MatchedDraws(batch=4, rank=0, world=1), MatchedDraws(batch=2, rank=1, world=2)
    >>> with one:
    ...     a = torch.randn(4, 3)
    >>> with two:
    ...     b = torch.randn(2, 3)
    >>> torch.equal(a[1::2], b)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode

from ddpkit.runtime import rankgen

SEED = 0x5EED  # any constant: the same in both runs, whatever the script's seed (init(seed=) adds the rank)


class MatchedDraws(TorchFunctionMode):
    """Torch's draws made per step and place (see the module's docstring). ``batch``: this process's batch;
    ``rank`` / ``world``: this process among the N (0 / 1 for the one-process run)."""

    def __init__(self, batch: int, rank: int, world: int):
        super().__init__()
        self.batch, self.rank, self.world = batch, rank, world
        self.step, self.count = 0, 0
        self.matched = 0  # draws made so far: the re-run's line says whether any was
        self.unmatched = 0  # draws in a form the handlers could not match: made as the script wrote them
        self.fetching = False  # a ddpkit loader is fetching a batch: its draws are the samples' (see fetch)

    def fetch(self, asking: bool | None) -> None:
        """A ddpkit loader's fetch watcher: while it fetches a batch (``asking``), draws pass through as drawn.
        A dataset's draws (an augmentation's ``torch.rand(1)``, torchvision's FakeData) are each sample's own,
        seeded per sample in both runs (samples.py); made per step and place here, each rank's 16 samples
        would have taken the same draws as each other rank's, and the one process's 32 others."""
        self.fetching = asking is True

    def next_step(self) -> None:
        """An optimizer stepped: the next draws are the next step's."""
        self.step, self.count = self.step + 1, 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.fetching:
            return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if rankgen.is_rank_generator(kwargs.get("generator")):  # ddpkit.rank_generator's: matched as torch's own
            kwargs.pop("generator")
        if handler is not None and kwargs.get("generator") is not None:  # a script's own generator: its choice,
            self.unmatched += 1  # and a draw this re-run did not match (review 40: a FAIL it could not decide)
            return func(*args, **kwargs)
        if handler is None:
            return func(*args, **kwargs)
        try:
            return handler(self, func, list(args), dict(kwargs))
        except (TypeError, ValueError, RuntimeError, IndexError):  # a form not matched (``bernoulli_(p_tensor)``):
            self.unmatched += 1  # drawn as the script wrote it; the runs may then differ, and the other tests decide
            return func(*args, **kwargs)

    def draw(self, shape: Sequence[int], make: Callable[[tuple[int, ...], torch.Generator], torch.Tensor],
             device: Any) -> torch.Tensor:
        """``make(shape, generator)`` for this step's next draw: the global batch's rows and this process's of
        them when ``shape[0]`` is the process's batch, the same tensor in every process otherwise."""
        shape = tuple(int(s) for s in shape)
        generator = torch.Generator(device=torch.device(device) if device is not None else "cpu")
        generator.manual_seed(SEED + 1_000_003 * self.step + self.count)
        self.count, self.matched = self.count + 1, self.matched + 1
        if not shape or shape[0] != self.batch or self.world == 1:
            return make(shape, generator)
        full = make((self.batch * self.world, *shape[1:]), generator)
        mine = full[self.rank::self.world].detach().contiguous()  # a leaf, as the draw it stands for
        return mine.requires_grad_(full.requires_grad)


def _creator(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.randn`` / ``rand`` / ``randint``: made with the step's generator (the size passed by keyword, the
    bounds of ``randint`` as the script gave them)."""
    if kwargs.get("out") is not None:
        return func(*args, **kwargs)
    if "size" in kwargs:
        size = kwargs.pop("size")
    elif func is torch.randint:  # randint(high, size) / randint(low, high, size): the size is the sequence
        size = args.pop()
    else:  # randn(2, 3) or randn((2, 3))
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else list(args)
        args = []
    shape = tuple(int(s) for s in size)
    return mode.draw(shape, lambda s, g: func(*args, size=s, generator=g, **kwargs), kwargs.get("device"))


def _like(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``randn_like(x)`` / ``rand_like`` / ``randint_like``: the creator's draw at ``x``'s shape, dtype and device."""
    source = args[0] if args else kwargs.pop("input")
    creators: dict[Any, Any] = {torch.randn_like: torch.randn, torch.rand_like: torch.rand,
                                torch.randint_like: torch.randint}
    creator = creators[func]
    bounds = args[1:]
    layout = kwargs.pop("memory_format", torch.preserve_format)
    kwargs.setdefault("dtype", source.dtype)
    kwargs.setdefault("device", source.device)
    if creator is torch.randint and "high" in kwargs:  # randint_like(x, high=...) / (x, low=, high=)
        bounds = [kwargs.pop("low", 0), kwargs.pop("high")]
    out = mode.draw(source.shape, lambda shape, g: creator(*bounds, size=shape, generator=g, **kwargs),
                    kwargs["device"])
    last = source.dim() == 4 and not source.is_contiguous() and source.is_contiguous(memory_format=torch.channels_last)
    if layout == torch.channels_last or layout == torch.preserve_format and last:  # the source's layout kept
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def _normal(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.normal(mean, std[, size])``: mean + std x a matched standard normal draw."""
    mean = args[0] if args else kwargs.pop("mean", 0.0)
    std = args[1] if len(args) > 1 else kwargs.pop("std", 1.0)
    size = args[2] if len(args) > 2 else kwargs.pop("size", None)
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if kwargs.get("out") is not None or (size is None and not tensors):
        return func(*args, **kwargs)
    shape = tuple(size) if size is not None else torch.broadcast_shapes(*(t.shape for t in tensors))
    dtype = kwargs.get("dtype") or (tensors[0].dtype if tensors else torch.get_default_dtype())
    device = kwargs.get("device") or (tensors[0].device if tensors else None)
    eps = mode.draw(shape, lambda s, g: torch.randn(s, generator=g, dtype=dtype, device=device), device)
    with torch.no_grad():  # torch.normal passes no gradient to its mean and std
        return mean + std * eps


def _bernoulli(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``torch.bernoulli(p)``: 1 where a matched uniform draw falls below ``p``."""
    p = args[0] if args else kwargs.get("input")
    if len(args) > 1 or set(kwargs) - {"input"} or not isinstance(p, torch.Tensor):
        return func(*args, **kwargs)
    u = mode.draw(p.shape, lambda s, g: torch.rand(s, generator=g, dtype=p.dtype, device=p.device), p.device)
    return (u < p).to(p.dtype)


def _in_place(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``t.normal_(mean, std)`` / ``t.uniform_(a, b)`` / ``t.bernoulli_(p)``: ``t`` filled from a matched draw."""
    target = args[0]
    if not isinstance(target, torch.Tensor):
        return func(*args, **kwargs)
    if func.__name__ == "bernoulli_":  # ``t.bernoulli_(p)``, p a number or a tensor of t's shape: u < p
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        u = mode.draw(target.shape, lambda s, g: torch.rand(s, generator=g, device=target.device), target.device)
        return target.copy_((u < p).to(target.dtype))
    method = getattr(torch.Tensor, func.__name__)

    def make(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        return method(torch.empty(shape, dtype=target.dtype, device=target.device), *args[1:], generator=g, **kwargs)

    return target.copy_(mode.draw(target.shape, make, target.device))


def _dropout(mode: MatchedDraws, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``F.dropout(x, p, training)`` / ``torch.dropout(x, p, train)``: a matched keep-mask, scaled as dropout
    scales."""
    x = args[0] if args else kwargs["input"]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    if not training or p == 0 or p == 1 or not isinstance(x, torch.Tensor):
        return func(*args, **kwargs)
    keep = mode.draw(x.shape, lambda s, g: torch.rand(s, generator=g, dtype=x.dtype, device=x.device), x.device) >= p
    scaled = keep.to(x.dtype) / (1 - p)
    return x.mul_(scaled) if inplace else x * scaled


_HANDLERS: dict[Any, Callable[[MatchedDraws, Any, list[Any], dict[str, Any]], Any]] = {
    torch.randn: _creator, torch.rand: _creator, torch.randint: _creator,
    torch.randn_like: _like, torch.rand_like: _like, torch.randint_like: _like,
    torch.normal: _normal, torch.bernoulli: _bernoulli, functional.dropout: _dropout, torch.dropout: _dropout,
    torch.Tensor.normal_: _in_place, torch.Tensor.uniform_: _in_place, torch.Tensor.bernoulli_: _in_place,
}


def worth_rerun(result: dict) -> bool:
    """A finite FAIL whose steps drew from torch's generator (the draws this re-run can match).

    >>> worth_rerun({"passed": False, "non_finite": False, "random_draws": True, "draw_sources": ["torch"]})
    True
    >>> worth_rerun({"passed": False, "non_finite": False, "random_draws": True, "draw_sources": ["numpy"]})
    False

    A step loader (``micro_batch_size=``) has no batch of the script's to match by: no re-run (``matchable``).
    """
    return not result.get("passed") and not result.get("non_finite") and bool(result.get("random_draws")) and \
        "torch" in (result.get("draw_sources") or ()) and result.get("matchable", True)


def counts(facts: list[dict]) -> dict:
    """The draws both runs matched, and those in a form they could not (each run's facts, ``recorder.py``).

    >>> counts([{"matched_draws": 3, "unmatched_draws": 0}, {"matched_draws": 6, "unmatched_draws": 1}])
    {'matched_draws': 9, 'unmatched_draws': 1}
    """
    return {key: sum(int(f.get(key) or 0) for f in facts) for key in ("matched_draws", "unmatched_draws")}


def defect(again: dict) -> str | None:
    """The line of a FAIL that the draws' spread would hide: with every draw of the steps matched (from torch's
    generator only, none in a form left unmatched, no loader worker's) the runs still end apart in float64 too,
    beyond rounding, or their step-1 gradients a constant factor apart (its cause); None when that re-run cannot
    tell (it passed, a draw went unmatched, float64 did not run).

    A correct script at N processes computes with matched draws what one process computes (the module's
    docstring); a defect within what other draws make (a KL weight of ``x.size(0) / len(data)``, halved per
    rank: 3.85e5 x the rounding floor, within 3 x the draws' own spread) is told this way only.

    >>> again = {"passed": False, "matched_draws": 8, "unmatched_draws": 0, "draw_sources": [],
    ...          "float64_apart": {"name": "enc.weight", "diff": 0.047}}
    >>> defect(again)[:61]
    "'enc.weight' differs by 0.047 (max abs diff) with the steps' "
    >>> defect({**again, "unmatched_draws": 1}) is None, defect({**again, "draw_sources": ["torch"]}) is None
    (True, True)
    >>> defect({**again, "float64_apart": None, "gradient_factor": 2.0, "cause": "a factor of 2"})
    "a factor of 2 (decided by a re-run with the steps' random draws matched)"
    >>> defect({**again, "float64_apart": None, "gradient_gap": 1.7, "first_diverging": "enc.weight"})[:60]
    "'enc.weight' differs with the steps' random draws matched, a"
    >>> defect({**again, "float64_apart": None, "gradient_gap": 0.2, "first_diverging": "enc.weight"}) is None
    True
    """
    apart = again.get("float64_apart")
    # (a draw left to a global generator in the matched re-run, ``torch.dropout`` before it was matched, a loader's
    # iter() at an epoch's end: the runs may differ by it)
    if again.get("passed") or again.get("unmatched_draws") or not again.get("matched_draws") or \
            again.get("draw_sources") or again.get("loader_workers") or again.get("unrepeatable"):
        return None
    if again.get("gradient_factor") is not None and again.get("cause"):  # (a VAE's KL summed over the batch: its
        # step-1 gradients 2x apart at 2 processes with the noise matched; set 28: "cannot compare" hid it)
        return f"{again['cause']} (decided by a re-run with the steps' random draws matched)"
    gap = again.get("gradient_gap")
    if (not apart or apart.get("diff") is None) and gap is not None and gap >= 1.0 and again.get("first_diverging"):
        # (set 29: a KL term weighted N times beside a summed reconstruction: the step-1 gradients further apart
        # than their own size, which no rounding makes; the float64 pair is not run then)
        return (f"{again['first_diverging']!r} differs with the steps' random draws matched, and the step-1 gradients "
                f"are {gap:.3g} apart (relative), beyond what float rounding makes: rank-dependent code (a loss or "
                "scale that depends on the per-process batch or the number of processes, a branch on the rank, "
                "per-rank statistics); decided by a re-run with the draws matched")
    if not apart or apart.get("diff") is None:
        return None
    return (f"{apart['name']!r} differs by {apart['diff']:.3g} (max abs diff) with the steps' random draws matched, "
            f"in float64 too: not the draws, not float rounding; decided by a re-run with the draws matched: "
            f"rank-dependent code (a loss or scale that depends on the per-process batch, such as x.size(0) / "
            f"len(data), a branch on the rank, per-rank statistics)")


def decided(first: dict, again: dict) -> dict:
    """The matched re-run's PASS, said as decided by it (its FAIL leaves the first result to the other tests)."""
    note = ("decided by a re-run with the steps' random draws matched (each draw of the batch's size made once for "
            "the global batch, each process taking its rows; other draws the same in every process); with draws of "
            f"their own the runs ended {first.get('first_diverging')!r} "
            f"{first.get('first_max_abs_diff', first.get('max_abs_diff')):.3g} apart, by design")
    return {**again, "decided_by": "matched draws", "rounding_note": " ".join(
        filter(None, [note, again.get("rounding_note")]))}
