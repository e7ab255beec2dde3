"""Decisions every rank must share: barrier, broadcast, gather of values, rank-0-first, early stop.

Each helper is a collective: call it on every rank. With one process each is the identity (or a no-op), so a
script keeps no ``if distributed:`` branch. Plain values travel as JSON (str, numbers, bool, None, and lists or
dicts of them), never pickle: nothing a peer sends is unpickled. A value that is not JSON-safe is refused with
one error naming its type, raised on *every* rank (the sender tells the others before raising), so no rank
waits for a value that never comes and none carries on alone.

Example::

    run_name = ddpkit.broadcast(f"run-{time.time():.0f}")          # rank 0's value on every rank
    with ddpkit.main_process_first():                             # rank 0 downloads, then the others read
        dataset = load_or_download(root)
    for epoch in range(epochs):
        ...
        if ddpkit.any_rank(val_loss > best + patience_margin):    # one rank's decision, every rank's answer
            break
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.runtime import group as runtime
from ddpkit.runtime import phases


def _json_problem(value: Any, where: str = "value") -> str | None:
    """Why ``value`` cannot travel as JSON without changing, or None."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _json_problem(v, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        bad_key = next((k for k in value if not isinstance(k, str)), None)
        if bad_key is not None:
            return f"{where} has a key of type {type(bad_key).__name__} ({bad_key!r}); JSON keys are str"
        return next((p for k, v in value.items() if (p := _json_problem(v, f"{where}[{k!r}]"))), None)
    hint = "; pass a list" if isinstance(value, tuple) else ""
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}, not JSON (str, numbers, bool, " \
           f"None, lists and dicts of them){hint}"


def _send_bytes(data: bytes | None, src: int, device: torch.device) -> bytes:
    """Broadcast bytes from ``src`` (length first, then the bytes as uint8)."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if data is not None:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src)
    return bytes(buffer.cpu().tolist())


@phases.waits
def barrier() -> None:
    """Wait until every rank gets here (a no-op with one process)."""
    if runtime.ensure_init().world_size > 1:
        dist.barrier()


@phases.waits
def broadcast(value: Any, src: int = 0) -> Any:
    """``src``'s ``value`` on every rank: a tensor (any shape and dtype; other ranks may pass None) or a JSON-safe
    value. Returns tensors on this process's device.

    >>> broadcast({"lr": 0.1, "tags": ["a", "b"]})      # one process: the value itself
    {'lr': 0.1, 'tags': ['a', 'b']}
    """
    state = runtime.ensure_init()
    header: dict[str, Any] | None = None
    if state.rank == src:
        if isinstance(value, torch.Tensor):
            header = {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        else:
            problem = _json_problem(value)
            header = {"error": f"broadcast from rank {src}: {problem}"} if problem else {"json": value}
    if state.world_size == 1:
        assert header is not None
        if "error" in header:
            raise TypeError(header["error"])
        return value
    received = json.loads(_send_bytes(json.dumps(header).encode() if header else None, src, state.device))
    if "error" in received:
        raise TypeError(received["error"])
    if "json" in received:
        return received["json"]
    tensor = value.detach().to(state.device).contiguous() if state.rank == src else \
        torch.empty(received["tensor"], dtype=getattr(torch, received["dtype"]), device=state.device)
    dist.broadcast(tensor, src)
    return tensor


@phases.waits
def gather_object(value: Any) -> list[Any]:
    """Every rank's JSON-safe ``value``, in rank order, on every rank. One rank's bad value raises on all.

    >>> gather_object({"loss": 0.5})
    [{'loss': 0.5}]
    """
    state = runtime.ensure_init()
    problem = _json_problem(value)
    mine = {"error": f"gather_object on rank {state.rank}: {problem}"} if problem else {"json": value}
    if state.world_size == 1:
        everyone = [mine]
    else:
        data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8).to(state.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=state.device) for _ in range(state.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=state.device))
        longest = max(int(s.item()) for s in sizes)
        parts = [torch.empty(longest, dtype=torch.uint8, device=state.device) for _ in sizes]
        dist.all_gather(parts, torch.cat([data, data.new_zeros(longest - data.numel())]))
        everyone = [json.loads(bytes(p[: int(s.item())].cpu().tolist())) for p, s in zip(parts, sizes)]
    errors = [e["error"] for e in everyone if "error" in e]
    if errors:
        raise TypeError("; ".join(errors))
    return [e["json"] for e in everyone]


@phases.waits
def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on at least one (early stop, skip a bad batch).

    >>> any_rank(True), any_rank(False)
    (True, False)
    """
    return bool(agree(int(bool(flag)), "max").result())


@phases.waits
def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on all of them.

    >>> all_ranks(True)
    True
    """
    return bool(agree(int(bool(flag)), "min").result())


class Agreement:
    """Counts every rank agreed on, possibly still in flight: :meth:`result` / :meth:`values` wait for them."""

    def __init__(self, work: Any, tensor: torch.Tensor | None, values: list[int], signs: list[int]):
        self._work, self._tensor, self._values, self._signs = work, tensor, values, signs

    def values(self) -> list[int]:
        if self._tensor is not None:
            self._work.wait()
            self._values = [s * int(v) for s, v in zip(self._signs, self._tensor.tolist())]
            self._tensor = None
        return self._values

    def result(self) -> int:
        return self.values()[0]


def agree(value: int | Sequence[int], op: str | Sequence[str]) -> Agreement:
    """Start agreeing on ``value`` across ranks: its ``"min"`` or ``"max"`` over every rank (a collective).

    The one helper behind :func:`any_rank`, :func:`all_ranks` and the stream loader's count of batches every rank
    holds: the tensor goes on ``state.device`` (an NCCL group takes no CPU tensor), and the all-reduce runs
    asynchronously until :meth:`Agreement.result` is asked for. Several values, each with its own op, travel in
    one all-reduce (a min is the negated max of the negated values); :meth:`Agreement.values` returns them all.

    >>> agree(3, "min").result(), agree([3, 5], ["max", "min"]).values()      # one process: the values
    (3, [3, 5])
    """
    values = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    ops = [op] * len(values) if isinstance(op, str) else list(op)
    if len(ops) != len(values) or not set(ops) <= {"min", "max"}:
        raise ValueError(f"agree: got values {values} with ops {ops}; expected one op, 'min' or 'max', per value")
    signs = [1 if o == ops[0] else -1 for o in ops]
    state = runtime.ensure_init()
    if state.world_size == 1:
        return Agreement(None, None, values, signs)
    tensor = torch.tensor([s * v for s, v in zip(signs, values)], dtype=torch.int64, device=state.device)
    reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[ops[0]]
    return Agreement(dist.all_reduce(tensor, op=reduce_op, async_op=True), tensor, values, signs)


@contextlib.contextmanager
def main_process_first(local: bool = False) -> Iterator[None]:
    """Rank 0 (``local=True``: each node's local rank 0) runs the block first, then the others.

    For work that one process should do before the rest read its result: downloading or preprocessing data,
    building a cache. If the first rank raises inside the block, it exits without releasing the others; they
    then fail in the barrier as their peer is gone, and the launcher names the first rank's exception as the
    root cause: nobody hangs.

    Example::

        with ddpkit.main_process_first():
            train_set = datasets.MNIST(root, download=True)   # downloaded once, read by everyone
    """
    state = runtime.ensure_init()
    first = (state.local_rank if local else state.rank) == 0
    if not first:
        barrier()  # released when the first rank(s) finished the block
    yield  # an exception in the first rank's block propagates without the barrier below
    if first:
        barrier()
