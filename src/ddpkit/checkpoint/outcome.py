"""What the ranks' background checkpoint writers tell each other, over the job's store rather than a process group.

A script's ``dist.destroy_process_group()`` tears down every group, the writers' own too, while a write may still be
running; the store (torchrun's agent holds it, or rank 0's TCPStore, kept alive here by reference) outlives it. So
rank 0's commit outcome reaches the other ranks through it (ddp needs no group at all to finish a write), and a
writer whose collective broke (DCP's, in fsdp) learns there which rank broke it: the rank that recorded its own
failure, else the rank that never said it was still there (its process died).

Example::

    channel = Channel.of_job()                  # at save(), on every rank; None in one process
    outcome = channel.tell(None)               # rank 0's commit outcome, on every rank (None: committed)
    failed = channel.blame(exc, rank)          # [rank, reason, io] naming the rank that failed, not this one
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import time
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.reasons import failure
from ddpkit.core import contract

_SAVES = itertools.count()  # this process's background saves, every Checkpointer's
PEER_WAIT_S = 5.0  # how long a writer whose collective broke waits for its peers to say why (or that they are there)
DESTROYED = ("dist.destroy_process_group() ran while the write still needed the group; call ckpt.wait() before "
             "destroy_process_group()")
# what a collective raises when a peer's process is gone or the group was torn down under it
_LOST = ("Connection closed by peer", "Connection reset by peer", "is not registered", "has not been initialized",
         "Broken pipe", "ProcessGroup shutdown", "Socket Timeout")


class Channel:
    """One save's keys in the job's store: ``<prefix>/outcome`` (rank 0's), ``<prefix>/failed/<r>`` (a rank's own
    failure) and ``<prefix>/here/<r>`` (a rank whose collective broke, still alive)."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str, timeout_s: float):
        self.store, self.rank, self.world, self.prefix, self.timeout_s = store, rank, world, prefix, timeout_s

    @classmethod
    def of_job(cls) -> Channel | None:
        """The channel of this process's next background save (the n-th on every rank: saves are collective,
        in the same order everywhere; not the directory's name, which the ranks of a node-local layout see
        differently); None in one process. Keys of this attempt only: a restarted group meets the same store."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        attempt = contract.RESTART_COUNT.number(os.environ) or 0
        store = dist.distributed_c10d._get_default_store()  # a reference: it lives on after the group is destroyed
        return cls(store, dist.get_rank(), dist.get_world_size(), f"ddpkit/ckpt/{attempt}/{next(_SAVES)}",
                   getattr(store, "timeout", datetime.timedelta(minutes=30)).total_seconds())  # init()'s timeout_s

    def tell(self, outcome: list[Any] | None) -> list[Any] | None:
        """Rank 0's ``outcome`` (None: its commit went through; else [rank, reason, io]) on every rank, as JSON."""
        key = f"{self.prefix}/outcome"
        if self.rank == 0:
            self.store.set(key, json.dumps(outcome))
            return outcome
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError:  # DistStoreError: rank 0 never told (it died before its commit ended)
            return [0, f"rank 0 did not tell its commit's outcome within {self.timeout_s:g} s (its process gone?)",
                    False]
        told = json.loads(self.store.get(key))
        return told if isinstance(told, list) and len(told) == 3 else None

    def blame(self, exc: BaseException, rank: int) -> list[Any]:
        """[rank, reason, io] of a failed write: this rank's own error, recorded for the peers; or, when it only
        lost a peer (a collective broke), the peer's own record, else the first rank that never said it was there."""
        mine = failure(exc, rank)
        if not lost(exc) and mine[0] == rank:
            self._record(mine)
            return mine
        if not dist.is_initialized():  # the script tore the group down on this rank: this rank is the one
            mine = [rank, DESTROYED, False]
            self._record(mine)
            return mine
        self.store.set(f"{self.prefix}/here/{self.rank}", "1")
        deadline = time.monotonic() + PEER_WAIT_S
        while True:
            for peer in range(self.world):
                key = f"{self.prefix}/failed/{peer}"
                if peer != self.rank and self.store.check([key]):
                    return list(json.loads(self.store.get(key)))
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        silent = [p for p in range(self.world) if p != self.rank and not self.store.check([f"{self.prefix}/here/{p}"])]
        if not silent:
            return mine
        seen = mine[1].split("] ", 1)[-1].split(". ")[0][:100]  # gloo's "[file:line] Connection closed ..."
        return [silent[0], f"its process ended during the write; rank {rank} saw: {seen}", False]

    def _record(self, said: list[Any]) -> None:
        try:
            self.store.set(f"{self.prefix}/failed/{self.rank}", json.dumps(said))
        except RuntimeError:  # the store's host is gone too: the peers name this rank as silent instead
            pass


def lost(exc: BaseException) -> bool:
    """The error is a collective that lost a peer or its group (not this rank's own write failing).

    >>> lost(RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:2989")), lost(OSError(28, "x"))
    (True, False)
    """
    seen: BaseException | None = exc
    while seen is not None:
        failures = getattr(seen, "failures", None)  # DCP's CheckpointException: this rank's own entry
        inner = next(iter(failures.values()), None) if failures else None
        inner = inner[0] if isinstance(inner, tuple) else inner
        text = str(inner if isinstance(inner, BaseException) else seen)
        if any(mark in text for mark in _LOST):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
