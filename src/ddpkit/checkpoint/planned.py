"""A sharded checkpoint written in the background that needs no process group once ``save()`` has returned.

torch's DCP ``async_save`` plans, writes and finishes on a thread, over a group. A script's usual
``dist.destroy_process_group()`` at its end tore that group down under the thread and the checkpoint was lost. So
DCP's two collective phases are split apart here:

- the plan is made together, on the training thread inside ``save()`` (DCP's own planner and exchange, over the
  writers' gloo group: a few small objects per rank);
- the thread then writes this rank's files alone (DCP's ``FileSystemWriter``), and each rank posts what it wrote
  to the job's store as JSON (:class:`~ddpkit.checkpoint.outcome.Channel`); rank 0 reads every post, bounded and
  checked, and writes ``.metadata`` with DCP's writer, as DCP's last collective would have.

Example::

    job = plan(tensors, "runs/exp/ckpt-0000000002.tmp-sharded/shards", group)   # every rank, collective
    write(job, channel)                  # on the writer thread: this rank's files; rank 0 adds .metadata
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.dcp import write_error
from ddpkit.checkpoint.reasons import PeerWriteError, failure

LIMIT_POST = 64 << 20  # bytes of one rank's post: ~150 bytes a tensor shard written
_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's shard file names, as FileSystemWriter makes them


@dataclasses.dataclass
class Planned:
    """One rank's part of a planned save: DCP's writer and planner, the rank's final plan, and (rank 0) the
    checkpoint's metadata, which ``.metadata`` holds once every rank's writes are in it."""

    writer: Any
    planner: Any
    plan: Any
    metadata: Any
    rank: int
    plans: list[Any]  # rank 0: every rank's final plan (what each must post); another rank: its own


def plan(tensors: dict[str, Any], directory: str, group: Any) -> Planned:
    """Stage this rank's ``tensors`` to CPU memory of their own and plan the save into ``directory`` with every
    rank (collective over ``group``); a failure on any rank raises :class:`~ddpkit.checkpoint.dcp.ShardWriteError`
    on every rank."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.utils import _DistWrapper

    stager = DefaultStager(StagingOptions(False, False, False, False))  # synchronous, plain CPU copies
    try:
        staged: Any = stager.stage(tensors)  # the state dict itself: no asynchronous staging was asked for
    finally:
        stager.close()
    writer, planner = FileSystemWriter(directory, sync_files=True), DefaultSavePlanner()
    exchange = _DistWrapper(group, dist.is_available() and dist.is_initialized(), 0)
    made: dict[str, Any] = {}

    def local() -> Any:
        planner.set_up_planner(state_dict=staged, storage_meta=writer.storage_meta(),
                               is_coordinator=exchange.is_coordinator)
        writer.set_up_storage_writer(exchange.is_coordinator, rank=exchange.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def central(plans: list[Any]) -> list[Any]:
        plans, made["metadata"] = planner.create_global_plan(plans)
        made["plans"] = writer.prepare_global_plan(plans)  # each rank's items and file prefix: its post is held to it
        return made["plans"]

    try:
        mine = exchange.reduce_scatter("plan", local, central)
    except CheckpointException as exc:  # a BaseException
        raise write_error(exc) from None
    return Planned(writer, planner, planner.finish_plan(mine), made.get("metadata"), exchange.rank,
                   made.get("plans", [mine]))


def write(job: Planned, channel: Any) -> None:
    """This rank's files of ``job`` (written and fsynced), posted to ``channel``; rank 0 then waits for every
    rank's post and writes ``.metadata``. Raises :class:`PeerWriteError` naming the rank whose write failed
    (this one's own failure is posted first, for rank 0)."""
    try:
        with channel.pulsing() if channel is not None else contextlib.nullcontext():
            done = job.writer.write_data(job.plan, job.planner)
            done.wait()
            mine = [_as_json(result) for result in done.value()]
        if channel is None:
            job.writer.finish(metadata=job.metadata, results=[_results(json.dumps(mine).encode(), 0, job.plans[0])])
            return
        channel.post_writes(json.dumps(mine))
        if job.rank == 0:  # every rank's post, in rank order (a rank that failed or died raises), checked
            posts = channel.writes(LIMIT_POST)
            results = [_results(post, rank, job.plans[rank]) for rank, post in enumerate(posts)]
            job.writer.finish(metadata=job.metadata, results=results)
    except PeerWriteError:  # a peer's failure (rank 0), said as the peer said it
        raise
    except Exception as exc:  # this rank's own: its write, or (rank 0) the .metadata
        said = failure(exc, job.rank)
        if channel is not None:
            channel.record(said)
        raise PeerWriteError(*said) from exc


def _as_json(result: Any) -> list[Any]:
    index, info = result.index, result.storage_data
    if info.transform_descriptors:  # ddpkit's writer has no stream transforms, and its reader refuses them
        raise ValueError(f"{index.fqn} was written with stream transforms {info.transform_descriptors}")
    offset = None if index.offset is None else [int(x) for x in index.offset]
    return [index.fqn, offset, index.index, int(result.size_in_bytes), info.relative_path, int(info.offset),
            int(info.length)]


def _results(post: bytes, rank: int, plan: Any) -> list[Any]:
    """Rank ``rank``'s post as DCP's WriteResults: each field of the type DCP writes, the items its ``plan`` gave
    it, each once, in files of its own prefix (``__<rank>_``, DCP's names: ``.metadata`` names the files a reader
    opens); one line naming the rank otherwise. (Where in its own files a peer says an item lies is taken as it
    says: the same peer writes those bytes.)"""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    def whole(x: Any) -> bool:
        return type(x) is int and 0 <= x < 2**63

    prefix = plan.storage_data.prefix
    try:
        rows = json.loads(post)
        out = []
        for fqn, offset, index, size, path, start, length in rows:
            ok = isinstance(fqn, str) and (offset is None or isinstance(offset, list) and all(map(whole, offset)))
            ok = ok and (index is None or whole(index)) and all(map(whole, (size, start, length)))
            if not ok or not isinstance(path, str) or not _FILE.fullmatch(path) or not path.startswith(prefix):
                raise ValueError(f"a row of another shape: {str([fqn, offset, index, size, path])[:120]}")
            out.append(WriteResult(index=MetadataIndex(fqn, None if offset is None else torch.Size(offset), index),
                                   size_in_bytes=size, storage_data=_StorageInfo(path, start, length)))
        planned = sorted((item.index.fqn, tuple(item.index.offset or ())) for item in plan.items)
        if sorted((r.index.fqn, tuple(r.index.offset or ())) for r in out) != planned:
            raise ValueError(f"it names {len(out)} items, its plan {len(planned)} others")
    except (ValueError, TypeError) as exc:
        raise PeerWriteError(rank, f"its record of what it wrote was refused ({str(exc)[:160]})", False) from None
    return out
