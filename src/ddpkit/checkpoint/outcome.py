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

import contextlib
import datetime
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.reasons import PeerWriteError, failure
from ddpkit.core import contract

_SAVES = itertools.count()  # this process's background saves, every Checkpointer's
PART = 4 << 20  # bytes of one part of a rank's post of its writes (the store refuses values over 8 MB)
PULSE_S = 0.5  # how often a rank writing its shards says it is still there
SILENT_S = 10.0  # a writing rank whose pulse stood still this long is gone (a slow disk still pulses)
SCAN_S = 0.5  # how often rank 0, waiting for the posts, looks at each missing peer (pulse, own record of failure)
PEER_WAIT_S = 5.0  # how long a writer whose collective broke waits for its peers to say why (or that they are there)
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
            self.record(mine)
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

    def record(self, said: list[Any]) -> None:
        """This rank's own failure ([rank, reason, io]), for the peers (rank 0 waiting for its writes)."""
        try:
            self.store.set(f"{self.prefix}/failed/{self.rank}", json.dumps(said))
            self.store.add(f"{self.prefix}/failures", 1)  # one key rank 0 polls, whatever the world's size
        except RuntimeError:  # the store's host is gone too: the peers name this rank as silent instead
            pass

    @contextlib.contextmanager
    def pulsing(self) -> Iterator[None]:
        """While the block runs (this rank's files being written), a count in the store goes up every PULSE_S:
        rank 0, waiting for this rank's :meth:`post_writes`, tells a slow disk from a process that is gone."""
        stop = threading.Event()

        def beat() -> None:
            for n in itertools.count():
                try:
                    self.store.set(f"{self.prefix}/pulse/{self.rank}", str(n))
                except RuntimeError:
                    return
                if stop.wait(PULSE_S):
                    return

        thread = threading.Thread(target=beat, name="ddpkit-checkpoint-pulse", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def post_writes(self, text: str) -> None:
        """What this rank wrote (JSON), for rank 0's ``.metadata``: in parts of at most :data:`PART` bytes (the
        store refuses a value over 8 MB), then their count, which rank 0 waits for."""
        data = text.encode()
        parts = [data[i:i + PART] for i in range(0, len(data), PART)] or [b""]
        for i, part in enumerate(parts):
            self.store.set(f"{self.prefix}/writes/{self.rank}/{i}", part)
        self.store.set(f"{self.prefix}/writes/{self.rank}", str(len(parts)))

    def writes(self, limit: int) -> list[bytes]:
        """Every rank's :meth:`post_writes`, by rank (rank 0, once each rank posted), its keys then removed. A
        rank that recorded its own failure, whose post is over ``limit`` bytes, or whose pulse stood still for
        SILENT_S (its process gone), raises :class:`PeerWriteError` naming it."""
        keys = [f"{self.prefix}/writes/{r}" for r in range(self.world)]
        pulses: dict[int, tuple[bytes | None, float]] = {}
        missing, scanned = list(range(self.world)), 0.0
        # every 50 ms two store calls whatever the world's size (all posted? any failure recorded?); each missing
        # peer's pulse every SCAN_S only (thousands of ranks polled one by one would flood the store)
        while missing and not self.store.check([keys[p] for p in missing]):
            failing = self.store.check([f"{self.prefix}/failures"])
            if failing or time.monotonic() - scanned > SCAN_S:
                missing = self._scan(missing, keys, pulses)
                scanned = time.monotonic()
            time.sleep(0.05)
        posts = []
        for peer, count in enumerate(self.store.multi_get(keys)):
            parts = int(count) if count.isdigit() and len(count) < 10 else -1
            if not 0 < parts <= max(1, limit // PART):
                raise PeerWriteError(peer, f"its record of what it wrote comes in {count[:20]!r} parts, expected "
                                           f"1 to {max(1, limit // PART)}", False)
            names = [f"{keys[peer]}/{i}" for i in range(parts)]
            post = b"".join(self.store.get(name) for name in names)
            if len(post) > limit:
                raise PeerWriteError(peer, f"its record of what it wrote has {len(post)} bytes, over {limit}",
                                     False)
            posts.append(post)
            for name in [*names, keys[peer], f"{self.prefix}/pulse/{peer}"]:  # read: the store need not hold it
                self.store.delete_key(name)
        return posts


    def _scan(self, missing: list[int], keys: list[str], pulses: dict[int, tuple[bytes | None, float]]) -> list[int]:
        """The peers of ``missing`` that have not posted yet; :class:`PeerWriteError` for one that recorded its own
        failure or whose pulse stood still for SILENT_S."""
        still = []
        for peer in missing:
            if self.store.check([keys[peer]]):
                continue
            failed = f"{self.prefix}/failed/{peer}"
            if self.store.check([failed]):
                raise PeerWriteError(*_said(self.store.get(failed), peer))
            pulse = f"{self.prefix}/pulse/{peer}"
            now, seen = time.monotonic(), self.store.get(pulse) if self.store.check([pulse]) else None
            if pulses.get(peer, (None, 0.0))[0] != seen or peer not in pulses:
                pulses[peer] = (seen, now)
            elif now - pulses[peer][1] > SILENT_S:
                raise PeerWriteError(peer, f"its process ended during the write (no sign of it for {SILENT_S:g} s)",
                                     False)
            still.append(peer)
        return still


def _said(raw: bytes, peer: int) -> list[Any]:
    """A peer's recorded failure, [rank, reason, io], as it said it when that is its shape."""
    try:
        said = json.loads(raw)
    except ValueError:
        said = None
    if isinstance(said, list) and len(said) == 3 and type(said[0]) is int and isinstance(said[1], str):
        return [said[0], said[1][:300], bool(said[2])]
    return [peer, "its write failed (its record of why was refused)", False]


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
