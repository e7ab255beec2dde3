"""Checkpoints that lose nothing: written once, atomically, checksummed, and resumed bitwise-exactly.

Example::

    ckpt = ddpkit.Checkpointer("runs/exp", keep=3)
    step = ckpt.restore(model=model, optimizer=optimizer, loader=loader)   # 0 on a fresh start
    for epoch in range(loader.epoch, epochs):
        for x, y in loader:
            ...
            step += 1
            if step % 100 == 0:
                ckpt.save(step, model=model, optimizer=optimizer, loader=loader)

Each checkpoint is a directory ``ckpt-<step>`` holding ``state.pt`` and ``manifest.json`` (sha256 and size
of every file). Rank 0 writes it into a temporary directory, fsyncs the files and the directory, renames it
into place and fsyncs the parent, so a crash leaves either the whole checkpoint or none; a step saved again
replaces the old copy as atomically (:mod:`ddpkit.checkpoint.disk`). A save that fails on any rank fails on
every rank, with the same error naming that rank, and leaves nothing of itself. Every rank's RNG
states (python, numpy, torch, CUDA, the loaders' worker-seed generators) are gathered into it as tensors, and
loading uses ``torch.load(weights_only=True)``: nothing arbitrary is unpickled. A checkpoint whose checksum
does not match is skipped, with a warning, for the previous one.

In a sharding mode (fsdp) the models and optimizers go into ``shards/`` instead, each rank writing its own
shard (:mod:`ddpkit.checkpoint.dcp`); the rest of the promises hold the same way, and such a checkpoint resumes at
any world size, in any mode.

``async_save=True``: ``save`` returns once the state is copied to CPU memory, and a background thread writes and
commits it with the same promises (:mod:`ddpkit.checkpoint.background`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddpkit.checkpoint import agree, disk, planned
from ddpkit.checkpoint import dcp as shards
from ddpkit.checkpoint import lock as locks
from ddpkit.checkpoint import rng as rngstate
from ddpkit.checkpoint.background import IN_FLIGHT, BackgroundWrite, say, stage
from ddpkit.checkpoint.disk import by_commit as by_commit  # the order and checks tools use, kept here too
from ddpkit.checkpoint.disk import newest_valid as newest_valid
from ddpkit.checkpoint.disk import run_id, validate
from ddpkit.checkpoint.load import load_into
from ddpkit.checkpoint.outcome import Channel
from ddpkit.checkpoint.reasons import PeerWriteError, failure
from ddpkit.core import contract, process
from ddpkit.data.loader import ShardedDataLoader
from ddpkit.data.streams import StreamLoader
from ddpkit.runtime import group as runtime
from ddpkit.runtime.control import broadcast, gather_object

T = TypeVar("T")


def _collective(obj: Any) -> bool:
    """ddpkit's loaders: a stream's ``state_dict()`` gathers every rank's position (a collective), so it must
    run on every rank before any object whose ``state_dict()`` may fail on one rank alone."""
    return isinstance(obj, (StreamLoader, ShardedDataLoader))


class Checkpointer:
    """Saves and restores training state in ``directory``; keeps the newest ``keep`` checkpoints.

    ``resume``: restore the newest valid checkpoint. By default on when ``DDPKIT_RESUME=1``
    (``ddpkit launch --resume``) or when torchrun restarted the group after a failure.

    A directory that already holds checkpoints belongs to the run that wrote them: a run that neither resumes
    nor restores one of them gets a one-line FileExistsError at its first ``restore()`` or ``save()``, before
    anything is written. ``resume=False`` (said explicitly) starts over there instead: the new saves are the
    newer commits, so retention and resume follow them and the old checkpoints go as ``keep`` new ones exist.

    ``async_save=True``: each save is written in the background once its state is staged; see :meth:`wait`.
    """

    def __init__(self, directory: str, *, keep: int = 3, resume: bool | None = None, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory, self.keep = directory, keep
        restarted = (contract.RESTART_COUNT.number(os.environ) or 0) > 0
        asked = bool(contract.RESUME.flag(os.environ)) if resume is None else resume  # --resume, or resume=
        self.resume = asked or restarted
        # a restart (--max-restarts) continues this job's own checkpoints only; --resume takes any run's
        self._own_only = restarted and not asked
        self.state = runtime.ensure_init()
        self._claimed = asked or resume is False  # resuming, or starting over here on purpose
        self._settled = False
        self.async_save = bool(async_save)
        self._pending: BackgroundWrite | None = None
        self._writer_group: Any = None  # sharded writes in the background talk on a group of their own
        self._staged: Any = None  # the last save's staged state (async_save, unsharded)
        self._lock = locks.DirectoryLock(directory)  # rank 0's, from the first restore or save: one job per directory
        self._started = False  # the lock checked on every rank (at the first restore)
        weakref.finalize(self, self._lock.release)
        if self.state.is_main:  # another live job's leftovers may be its saves in flight: not ours to remove
            disk.prepare(self.directory, IN_FLIGHT, clean=locks.blocking(directory) is None)

    def _settle(self, restored: bool) -> None:
        """Once, at the first restore or save, on every rank: refuse to write beside another run's checkpoints
        unless this run resumed or restored one of this directory's. Rank 0 looks (the others may not see the
        directory) and every rank raises the same line."""
        if self._settled:
            return
        self._settled = True
        if restored or self._claimed:  # the same on every rank: no collective needed
            return
        old = [p for p in self.checkpoints() if disk.run_of(p) != run_id()] if self.state.is_main else []
        problem = broadcast(None if not old else (
            f"{self.directory} holds checkpoints of an earlier run (newest {os.path.basename(old[0])}) and this run "
            "resumed none of them; saving would mix the runs and delete those: resume it (ddpkit launch --resume or "
            "Checkpointer(..., resume=True)), pick another directory, or pass resume=False to start over there"))
        if problem:  # refused: the lock this run took at its start goes back, and the directory is as it was
            self._lock.release()
            self._started = False
            raise FileExistsError(problem)

    def checkpoints(self) -> list[str]:
        """Committed checkpoint directories, newest commit first (not yet checked); a background write of this
        rank is finished first (its commit may remove older ones)."""
        self._join_local()
        return by_commit(self.directory)

    def _join_local(self) -> None:
        """This rank's background write finished, nothing asked of the peers (a failure is raised on every rank
        by the next save, wait() or restore): what a rank alone may call, as latest() or checkpoints()."""
        if self._pending is not None:
            self._pending.join()

    def save(self, step: int, *, extra: dict[str, Any] | None = None, **objects: Any) -> str | None:
        """Save ``objects`` (anything with ``state_dict()``: model, optimizer, scheduler, scaler, loader).

        Call it on every rank (RNG states are gathered). ``extra``: JSON-able values kept in the manifest.
        Returns the checkpoint's path on rank 0. When any rank fails, every rank raises the same error naming
        that rank and its error, and nothing of this save is left: an OSError for an I/O error (a full disk, a
        write refused), else a RuntimeError (an object's ``state_dict()`` raising KeyError, say).

        With ``async_save`` it returns once the state is staged, with the path the checkpoint will have; the
        write goes on in the background, and a failure of it is raised here at the next save (see :meth:`wait`).
        """
        # before anything, on every rank alike: a step that names a checkpoint, the same on every rank, and a
        # directory no other live job saves into (rank 0 takes its lock)
        step = agree.steps_agreed(step, self.directory, self._lock if self.state.is_main else None,
                                  then=lambda: self._settle(restored=False))
        self._wait(skipped=step)  # one write at a time: the previous one is finished, and its failure raised, first
        if self.async_save:  # as it is now: written later, a dict the script keeps updating would say later values
            extra = self._together(step, "collecting the state", lambda: json.loads(json.dumps(extra or {})))
        loaders = {k: v for k, v in objects.items() if isinstance(v, ShardedDataLoader)}
        mode = self.state.strategy
        # the collectives first, in the same order on every rank: the RNG gather and the loaders' state (a
        # stream's gathers); only then the objects' own state dicts, which may fail on one rank alone
        rng, gathered = self._together(step, "collecting the loaders' state", lambda: (
            rngstate.gather(rngstate.local(loaders, mode), self.state),
            {name: obj.state_dict() for name, obj in objects.items() if _collective(obj)}))
        if mode.shards:
            return self._save_sharded(step, rng, objects, gathered, extra or {})
        local = self._together(step, "collecting the state", lambda: {
            name: mode.state_dict(obj) if isinstance(obj, torch.nn.Module) else obj.state_dict()
            for name, obj in objects.items() if name not in gathered})
        states = {name: gathered[name] if name in gathered else local[name] for name in objects}
        payload = {"step": step, "world_size": self.state.world_size, "rng": rng, "objects": states}
        tmp = os.path.join(self.directory, f"ckpt-{step:010d}.tmp-{os.getpid()}")
        if self.async_save:  # staged here, on the training thread: the next step must not change what is written
            staged = self._together(step, "staging", lambda: stage(payload, self._staged) if self.state.is_main
                                    else None)
            self._staged = staged  # its buffers are written into again at the next save, once this write ended
            channel = self._channel()
            return self._in_background(step, tmp, lambda: self._commit_and_tell(step, staged, extra or {}, tmp,
                                                                                channel), channel)
        # every rank returns once the checkpoint exists, or raises with rank 0
        return self._together(step, "writing", lambda: self._commit(step, payload, extra or {}, tmp)
                              if self.state.is_main else None, tmp)

    def _channel(self) -> Channel | None:
        return Channel.of_job()

    def _in_background(self, step: int, tmp: str, write: Callable[[], Any], channel: Channel | None) -> str | None:
        process.on_shutdown(self._at_exit)  # at each save: a shutdown() in between (a notebook) ran the last one

        def blamed() -> Any:  # a broken collective names the rank that broke it (a peer that died), not this one
            try:
                return write()
            except PeerWriteError:
                raise
            except BaseException as exc:
                if channel is None:
                    raise
                raise PeerWriteError(*channel.blame(exc, self.state.rank)) from exc

        def announce(exc: BaseException) -> None:  # at once, on the rank it failed on; every rank raises it later
            rank, reason, _ = failure(exc, self.state.rank)
            say(f"ddpkit: checkpoint step {step}: its background write failed on rank {rank} ({reason}); every "
                "rank raises it at the next save, wait() or restore")

        self._pending = BackgroundWrite(step, tmp, blamed, announce=announce)
        return os.path.join(self.directory, f"ckpt-{step:010d}") if self.state.is_main else None

    def wait(self) -> str | None:
        """Wait for the background write of the last save (``async_save``), on every rank; returns its path on
        rank 0 (None when none was pending). A write that failed on any rank is raised on every rank as a
        synchronous save's failure is (nothing of it left, the newest checkpoint named). ``save`` and
        ``restore`` call it; at exit the write is joined on each rank alone (``_at_exit``)."""
        return self._wait()

    def _wait(self, skipped: int | None = None) -> str | None:
        """``skipped``: the step of the save that waits, which does not go on when this raises (said so)."""
        pending, self._pending = self._pending, None
        if pending is None:  # the same on every rank: saves are collective
            return None
        return self._together(pending.step, "writing in the background", pending.result, pending.tmp, skipped)

    def _at_exit(self) -> None:
        """At ``ddpkit.shutdown()`` (at exit): the last write finishes on this rank. No peer is asked (one may have
        left already, or still be training: a collective here would hang or mismatch); every rank's thread ends
        after rank 0's commit and knows its outcome. A failed write is said, and fails the process as a synchronous
        save's failure would have: ``shutdown()`` raises it, and at exit the process exits 1."""
        pending, self._pending = self._pending, None
        error = pending.join() if pending is not None else None
        if pending is None or error is None:
            return
        if self.state.is_main:  # its directory: nothing of a failed save is left
            shutil.rmtree(pending.tmp, ignore_errors=True)
        rank, reason, _ = failure(error, self.state.rank)
        line = (f"checkpoint step {pending.step} was not saved: its background write failed on rank {rank} "
                f"({reason}) after the script's last save; the newest checkpoint is still "
                f"{next(iter(by_commit(self.directory)), 'none')}")
        say(f"ddpkit: {line}")
        process.current().exit_failure = line

    def _together(self, step: int, stage: str, action: Callable[[], T], tmp: str | None = None,
                  skipped: int | None = None) -> T:
        """``action()`` on this rank, then every rank learns whether it failed on any: all return, or all raise
        the first failing rank's error, once rank 0 removed ``tmp``. A rank raising alone would leave the
        others waiting in the next collective, and a script catching it would mismatch every one after.

        What every rank raises when rank 1's disk is full: ``OSError: checkpoint step 6 was not saved: writing the
        shards failed on rank 1 (OSError: [Errno 28] ...); every rank raised this, nothing of it was left and the
        newest checkpoint is still runs/exp/ckpt-0000000003; ...``; any other error as a RuntimeError.
        """
        try:
            result, mine, cause = action(), None, None
        except Exception as exc:  # whatever it is, the other ranks must hear of it
            result, mine, cause = None, failure(exc, self.state.rank), exc
        failed = next((f for f in gather_object(mine) if f), None)
        if failed is None:
            return result  # type: ignore[return-value]  # None only on a rank that raised, which raises here
        if self.state.is_main and tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        # rank 0's view (the others may not see the directory); they return once it removed the partial one
        kept = broadcast(next(iter(self.checkpoints()), None) if self.state.is_main else None)
        previous = f"the newest checkpoint is still {kept}" if kept else "there is no earlier checkpoint"
        said = (f"checkpoint step {step} was not saved: {stage} failed on rank {failed[0]} ({failed[1]}); every "
                f"rank raised this, nothing of it was left and {previous}")
        if skipped is not None:  # a sync save raising means its own step was not saved: so does this one
            said += f"; step {skipped} was not saved either (its save() raised this before collecting anything)"
        if not failed[2]:  # a programming error is no disk problem: `except OSError` must not swallow it
            raise RuntimeError(f"{said}; fix the error on rank {failed[0]}, then save again (every rank) or stop") \
                from cause
        advice = "fix what it could not read" if stage.startswith("collecting") else \
            "free space or pick another directory"
        raise OSError(f"{said}; {advice}, then save again (every rank) or stop") from cause

    def _save_sharded(self, step: int, rng: dict[str, torch.Tensor] | None, objects: dict[str, Any],
                      gathered: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """Every rank writes its shard of the models and optimizers into the temporary directory, then
        rank 0 adds state.pt and the manifest and renames it into place, as :meth:`_commit` does."""
        # collective (DCP state dicts of DTensors), then the local state dicts, which may fail on one rank
        tensors, local = self._together(step, "collecting the state", lambda: shards.split(
            {name: obj for name, obj in objects.items() if name not in gathered}))
        rest = {name: gathered[name] if name in gathered else local[name]
                for name in objects if name in gathered or name in local}
        tmp = os.path.join(self.directory, f"ckpt-{step:010d}.tmp-sharded")

        def prepare() -> None:
            if self.state.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)

        def write() -> dict[str, Any]:  # shards.save fails on every rank, naming the rank, when any write failed
            shards.save(tensors, os.path.join(tmp, shards.SHARDS))
            # each rank hashes the files it wrote (DCP fsynced them); the others are hashed at the commit
            mine = [os.path.join(shards.SHARDS, n) for n in os.listdir(os.path.join(tmp, shards.SHARDS))
                    if n.startswith(f"__{self.state.rank}_")]
            return disk.hashes(tmp, mine)

        self._together(step, "making its directory", prepare, tmp)
        if self.async_save:
            return self._sharded_in_background(step, tensors, tmp, {
                "step": step, "world_size": self.state.world_size, "rng": rng, "objects": rest,
                "sharded": sorted(tensors)}, extra)
        own = self._together(step, "writing the shards", write, tmp)
        hashed = {k: v for part in gather_object(own) for k, v in part.items()}  # JSON between ranks, never pickle
        # a node-local directory: rank 0 would commit without the other nodes' shards
        agree.parts_agreed(self.directory, tmp, step, hashed, self.state.is_main,
                           lambda: next(iter(self.checkpoints()), None))
        payload = {"step": step, "world_size": self.state.world_size, "rng": rng, "objects": rest,
                   "sharded": sorted(tensors)}
        return self._together(step, "writing", lambda: self._commit(step, payload, extra, tmp, hashed)
                              if self.state.is_main else None, tmp)

    def _sharded_in_background(self, step: int, tensors: dict[str, Any], tmp: str, payload: dict[str, Any],
                               extra: dict[str, Any]) -> str | None:
        """This rank's shards are staged to CPU memory and the save planned with every rank, here (over a gloo
        group of the writers'); a thread then writes them and no group is needed any more (a script may destroy
        its groups meanwhile: :mod:`ddpkit.checkpoint.planned`); rank 0 commits once every rank's shard is
        written, hashing every file itself."""
        group, channel = self._writers(step), self._channel()
        job = self._together(step, "staging", lambda: planned.plan(tensors, os.path.join(tmp, shards.SHARDS), group))
        staged = stage(payload) if self.state.is_main else None

        def write() -> str | None:
            try:
                planned.write(job, channel)  # rank 0: once every rank's shard is written, .metadata
            except PeerWriteError as exc:  # this rank's own failure, or (rank 0) a peer's: rank 0 tells the rest
                return self._commit_and_tell(step, staged, extra, tmp, channel, exc)
            return self._commit_and_tell(step, staged, extra, tmp, channel)

        return self._in_background(step, tmp, write, channel)

    def _writers(self, step: int) -> Any:
        """The background writers' gloo group (made at the first save, on every rank); None in one process."""
        if self._writer_group is None and self.state.world_size > 1 and dist.is_initialized():
            self._writer_group = self._together(step, "making the writers' group",
                                                lambda: dist.new_group(backend="gloo"))
        return self._writer_group

    def _commit_and_tell(self, step: int, staged: Any, extra: dict[str, Any], tmp: str,
                         channel: Channel | None, failed: Exception | None = None) -> str | None:
        """Rank 0 commits; then every rank's writer learns how it went (over the store: a script's
        destroy_process_group() may have ended every group), so each rank's write ends only once the checkpoint is
        in place (its latest() names it) and knows when it is not. ``failed``: this rank's part failed (rank 0
        tells it; another rank raises it, recorded for rank 0 already)."""
        error, path = failed, None
        if error is not None and not self.state.is_main:
            raise error
        if self.state.is_main and error is None:
            try:
                path = self._commit(step, staged, extra, tmp)
            except Exception as exc:
                error = exc
        told = channel.tell(None if error is None else failure(error, self.state.rank)) if channel else None
        if error is not None:
            raise error
        if told is not None:
            raise PeerWriteError(*told)
        return path

    def _commit(self, step: int, payload: dict, extra: dict[str, Any], tmp: str,
                hashed: dict[str, dict[str, Any]] | None = None) -> str:
        """Rank 0: state.pt and the manifest into ``tmp``, then the commit (:func:`disk.commit`)."""
        if hashed is None and payload.get("sharded"):  # in the background: no per-rank list was gathered
            agree.shards_present(self.directory, tmp, step)
        return disk.commit(self.directory, tmp, step, self.keep, payload["world_size"], extra,
                           lambda f: torch.save(payload, f), hashed)

    def validate(self, path: str) -> str | None:
        """None when ``path`` is a complete checkpoint whose files match the manifest, else the reason.
        In a sharded mode (fsdp: one file per rank and more) each rank hashes its part of the files and the
        ranks agree, so call it, :meth:`latest` and :meth:`restore` on every rank there, as saving is."""
        self._join_local()  # a path still being written in the background is whole once its write ended
        if self.state.world_size == 1 or not self.state.strategy.shards or not dist.is_initialized():
            return validate(path)
        reasons = gather_object(validate(path, (self.state.rank, self.state.world_size)))
        return next((reason for reason in reasons if reason), None)

    def latest(self) -> str | None:
        """The newest valid checkpoint (after a restart: of this job); invalid ones are skipped with a warning."""
        for path in self.checkpoints():
            if self._own_only and disk.run_of(path) != run_id():
                continue
            reason = self.validate(path)
            if reason is None:
                return path
            if self.state.is_main:
                warnings.warn(f"ddpkit: skipping checkpoint {path}: {reason}", stacklevel=3)
        return None

    def restore(self, path: str | None = None, **objects: Any) -> int:
        """Load the newest valid checkpoint (or ``path``) into ``objects``; returns its step, 0 if none.

        Without ``path`` nothing is loaded unless ``resume`` is on. A given ``path`` must exist and be valid.
        """
        self.wait()  # a save still being written in the background is the newest checkpoint
        if not self._started:  # a second job on this directory stops at its start, before it loads anything
            agree.lock_agreed(self._lock if self.state.is_main else None)
            self._started = True
        if path is not None:
            if os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.directory):
                self._settle(restored=False)  # fine-tuning from another directory's checkpoint claims none here
            reason = agree.path_agreed(self.directory, path, self.validate(path))
            if reason:
                raise FileNotFoundError(f"cannot resume from {path}: {reason}; pass a ckpt-* directory "
                                        f"from {self.directory} or drop the path to start fresh")
        elif not self.resume or (path := agree.latest_agreed(self)) is None:
            self._settle(restored=False)
            return 0
        payload = load_into(path, objects, self.state)
        if self.state.is_main:
            print(f"ddpkit: resumed from {path} (step {payload['step']})", file=sys.stderr, flush=True)
        self._settle(restored=True)
        return int(payload["step"])
