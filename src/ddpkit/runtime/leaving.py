r"""How the ranks leave together: the final barrier at exit, and the peers it must not wait for.

At exit every rank meets the others in one barrier before the group is destroyed (:func:`ddpkit.shutdown` says
why). A rank must not wait there for a peer that will never come:

- a peer **inside a collective this rank never joins** (this rank left its loop: ``sys.exit(3)``, an early
  ``return``, ``raise SystemExit``; nothing at exit says with which code Python leaves): the peer waits for this
  rank, so the ranks at exit leave at once, and torch's agent stops the job once a process is gone.
  A peer is there when its group's collective count is past the count of the first rank at exit: every
  collective of the default group counts on every rank alike (DDP's all-reduces in the backward too).
- a peer **still at work** (rank 0 writing a last checkpoint alone): waited for at most :data:`EXIT_WAIT_S`,
  then the ranks at exit leave without the barrier, quietly.

Nothing runs per step. Each rank has a :class:`Listener`, a thread blocked on the store (its own connection,
so the main thread's store calls never queue behind it) until the first rank at exit writes its count; from
then on it compares its own rank's count with it every :data:`POLL_S` for a few seconds. The decision is one
store key, ``go``, written once (``compare_set``): ``all`` by the last rank to arrive (the barrier runs),
``ahead`` by a listener whose rank is past the count (every rank at exit leaves), ``late`` by a rank whose wait
ran out (every rank at exit leaves). So a rank that arrives as another gives up never enters a barrier alone.

Example (the decision each rank at exit reads; ``leave`` on a rank that waited in vain)::

    >>> [decided(raw) for raw in (b"all", b"ahead", b"late", b"")]
    ['barrier', 'ahead', 'late', 'ahead']
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.core import contract, process
from ddpkit.runtime import desync

# How long a rank at exit waits for every other rank to reach its exit. A peer that is still working (rank 0
# writing a last checkpoint) looks like one stuck where this rank cannot see it (in the script's own wait), so
# the wait is bounded: after it the ranks at exit leave without the barrier, quietly (a slow final save on rank 0
# is the common case), their exit codes tell the launcher the rest, and a peer blocked on them fails at once (its
# connection closed) instead of at the collective timeout.
EXIT_WAIT_S = 5.0
POLL_S = 0.02  # how often a listener compares its rank's collective count, once a rank is at its exit
HOLD = 3  # looks in a row that find this rank waiting past the count: 0.06 s (a collective that completes moves on)
GONE = "gone"  # the first count of a rank that leaves without one: the listeners stop
_FOREVER = datetime.timedelta(days=365)  # a listener's wait: until a rank reaches its exit (or the store goes)
_PREFIX = "ddpkit/exit/"


def key(name: str) -> str:
    """A store key of this attempt and of this process's group: a restarted group meets the same store, and a
    script that starts a group again after :func:`ddpkit.shutdown` meets the keys of the one before."""
    attempt = contract.RESTART_COUNT.number(os.environ) or 0
    return f"{_PREFIX}{attempt}.{process.current().groups}/{name}"


def decided(raw: bytes) -> str:
    """What the ``go`` key's value tells a rank at exit: ``barrier``, ``late`` (a peer still at work: an orderly
    exit without the barrier) or ``ahead`` (a peer waits for a rank at exit; anything else reads so too)."""
    return {b"all": "barrier", b"late": "late"}.get(raw, "ahead")


def collectives(group: Any) -> int | None:
    """How many collectives this rank has started on ``group`` (None: the backend does not count them)."""
    try:
        return int(group._get_sequence_number_for_group())
    except (RuntimeError, AttributeError, ValueError):
        return None


class Listener(threading.Thread):
    """One rank's watch for a peer at exit while this rank is in a collective it never joins (a daemon)."""

    def __init__(self, store: Any, group: Any):
        super().__init__(name="ddpkit-exit-listener", daemon=True)
        self.store, self.group, self.go, self.first = store, group, key("go"), key("first")
        self.main = threading.main_thread().ident
        # gloo counts a send / recv on its two ranks only, so its counts part between ranks whose point-to-point
        # traffic is uneven (monitored_barrier's too): there a count past the first one's is said only of a rank
        # whose main thread waits in a collective; NCCL counts collectives alone
        self.counts_p2p = dist.get_backend(group) != "nccl"
        self.stopped = threading.Event()  # this rank is at its exit: nothing left to compare

    def run(self) -> None:
        try:
            own = self.store.clone()  # a wait on the shared connection would hold the main thread's store calls
            own.wait([self.first], _FOREVER)
            self._compare(own, int(own.get(self.first)[:32]))
        except (RuntimeError, ValueError, AttributeError):  # the store is gone (the job ends), no count (a rank
            # left with its group gone: GONE), or a store that cannot open a second connection (the ranks at exit
            # then wait EXIT_WAIT_S)
            pass
        finally:
            self.store = self.group = None  # a store served by rank 0's process closes with the process's last

    def _compare(self, own: Any, first: int) -> None:
        """Every POLL_S: this rank is past the first rank's count and (where p2p counts) waits in a collective,
        the same for HOLD looks in a row: it waits for the ranks at exit, which must not wait for it."""
        deadline, seen, held = time.monotonic() + 2 * EXIT_WAIT_S, None, 0
        while not self.stopped.is_set() and time.monotonic() < deadline:
            count = collectives(self.group)
            if count is None:
                return
            frame = sys._current_frames().get(self.main) if self.main is not None else None
            op = desync.where(frame)["op"] if self.counts_p2p else "counted"
            now = (count, op)
            held = held + 1 if now == seen and count > first and op is not None else 0
            seen = now
            if held >= HOLD:
                own.compare_set(self.go, "", "ahead")
                return
            self.stopped.wait(POLL_S)


def release(store: Any) -> None:
    """Wake every listener still waiting for a first count (this rank leaves with none to give: it failed, or
    its group is gone): they stop, nothing is compared."""
    try:
        store.compare_set(key("first"), "", GONE)
    except RuntimeError:  # the store's host is gone: so are the listeners' waits
        pass


def listen(world_size: int) -> Listener | None:
    """This rank's listener, started (None with one process: no peer to wait for)."""
    if world_size < 2 or not dist.is_initialized():
        return None
    listener = Listener(process.current().store, dist.distributed_c10d._get_default_group())
    listener.start()
    return listener


def arrive(store: Any, rank: int, world: int, live: str, count: int | None, prints: Callable[[], str], *,
           post: bool = False, wait_s: float = EXIT_WAIT_S) -> str:
    """This rank is at its exit: what the ranks at exit do (:func:`decided`): ``barrier`` once every rank is
    there; without it, ``ahead`` (a peer is in a collective none of them joins) or ``late`` (a peer still at work
    after ``wait_s``).

    ``live`` (what this rank still holds) is kept under the rank's key for :func:`posted`; ``count``: this rank's
    collectives (None: not counted). ``prints()`` (the replicas' fingerprints) is posted for :func:`prints_of`
    before a ``late`` is written or read, or at once with ``post=True`` (no group left to compare them in): each
    rank posts before it reads the others', so the last to post finds every post."""
    store.set(key(f"at/{rank}"), live)
    posted = post and _post(store, rank, prints)
    if count is not None:
        store.compare_set(key("first"), "", str(count))  # the first rank's count; the listeners wake on it
    if store.add(key("arrived"), 1) >= world:
        store.compare_set(key("go"), "", "all")
    try:
        store.wait([key("go")], datetime.timedelta(seconds=wait_s))
    except dist.DistStoreError:  # the wait ran out; an unreachable store is a DistNetworkError, raised on
        posted = posted or _post(store, rank, prints)
        store.compare_set(key("go"), "", "late")
    decision = decided(store.get(key("go")))
    if decision == "late" and not posted:
        _post(store, rank, prints)
    return decision


def _post(store: Any, rank: int, prints: Callable[[], str]) -> bool:
    store.set(key(f"prints/{rank}"), prints())
    return True


def prints_of(store: Any, world: int) -> list[bytes | None]:
    """Every rank's posted fingerprints, by rank; all None until every rank posted."""
    keys = [key(f"prints/{peer}") for peer in range(world)]
    return list(store.multi_get(keys)) if store.check(keys) else [None] * world


def posted(store: Any, world: int) -> list[bytes]:
    """What every rank at exit posted with :func:`arrive`, by rank."""
    return list(store.multi_get([key(f"at/{peer}") for peer in range(world)]))
