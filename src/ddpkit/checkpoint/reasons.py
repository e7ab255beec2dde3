"""What a checkpoint operation says when it fails: the failing rank's reason (the OSError a torch error hides),
and the keys and shapes by which a saved state dict does not fit a model.

Example::

    >>> failure(OSError(28, "No space left on device"), rank=1)
    [1, 'OSError: [Errno 28] No space left on device', True]
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.checkpoint.bounds import optimizer_problem
from ddpkit.checkpoint.confine import UnsafeCheckpoint
from ddpkit.core.errors import first_line


class PeerWriteError(OSError):
    """Rank ``failed_rank``'s part of a checkpoint write failed: what the ranks that learnt of it raise.

    >>> failure(PeerWriteError(0, "OSError: [Errno 28] No space left on device", True), rank=1)
    [0, 'OSError: [Errno 28] No space left on device', True]
    """

    def __init__(self, rank: int, reason: str, io: bool = True):
        super().__init__(f"rank {rank}: {reason}")
        self.failed_rank, self.failure, self.io = rank, reason, io


def check_fits(model: torch.nn.Module, saved: dict[str, torch.Tensor], path: str) -> None:
    """Name the keys and shapes that differ, instead of torch's multi-line load_state_dict error; a value that is no
    tensor (a crafted list, which load_state_dict would try to copy) is refused first."""
    if not isinstance(saved, dict):
        raise UnsafeCheckpoint(f"checkpoint {path} refused: its model state is a {type(saved).__name__}, expected a "
                               "dict of tensors by name; it was not written by ddpkit: restore another checkpoint")
    wrong = next((k for k, v in saved.items() if not isinstance(v, torch.Tensor)
                  and not str(k).endswith("_extra_state")), None)  # get_extra_state() may return anything
    if wrong is not None:
        raise UnsafeCheckpoint(f"checkpoint {path} refused: its model's {wrong!r:.80} is a "
                               f"{type(saved[wrong]).__name__}, expected a tensor; it was not written by ddpkit: "
                               "restore another checkpoint")
    own = model.state_dict()
    missing = sorted(set(own) - set(saved))
    unexpected = sorted(set(saved) - set(own))
    shapes = [f"{k} {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in saved and saved[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"missing {missing[:5]}" if missing else "", f"unexpected {unexpected[:5]}" if unexpected else "",
                 f"shapes {shapes[:5]}" if shapes else ""]
        raise ValueError(f"checkpoint {path} does not fit this model: " + "; ".join(p for p in parts if p)
                         + " (was it saved from another model or configuration?)")


def check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, where: str) -> None:
    """One line when ``saved`` is no state of ``optimizer`` (:func:`ddpkit.checkpoint.bounds.optimizer_problem`)."""
    problem = optimizer_problem(saved, optimizer)
    if problem:
        raise UnsafeCheckpoint(f"checkpoint {where} refused: {problem}; it was not written by ddpkit for this "
                               "optimizer: restore another checkpoint, or a new optimizer")


def failure(exc: BaseException, rank: int) -> list[Any]:
    """[rank, "Type: first line", is it an I/O error] of a failed save step; a sharded write names the rank
    whose write failed.

    torch.save reports a failed write as RuntimeError("... unexpected pos 832 vs 726"); the OSError it hides
    (``[Errno 28] No space left on device``) is the one that tells the user what to do, so it is named instead.
    """
    inner: BaseException | None = exc
    while inner is not None and not (isinstance(inner, OSError) and inner.errno):
        inner = inner.__cause__ or inner.__context__
    shown = inner if inner is not None else exc
    reason = getattr(exc, "failure", None) or f"{type(shown).__name__}: {first_line(shown)}"
    io = getattr(exc, "io", isinstance(shown, OSError))  # a shard write says what its rank's error was
    return [getattr(exc, "failed_rank", rank), reason, bool(io)]
