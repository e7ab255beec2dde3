"""``ddpkit.data_loader``: the loader for a dataset, chosen by its kind: a map-style dataset gets a
:class:`~ddpkit.data.loader.ShardedDataLoader` over this rank's shard, a stream (``IterableDataset``) a
:mod:`~ddpkit.data.streams` loader; both sized for the mode, with the launching tool's hooks.

Example::

    loader = ddpkit.data_loader(train_set, batch_size=32)              # 32 per process in DDP
    test_loader = ddpkit.data_loader(test_set, 256, train=False)       # exact: no padded duplicates
    for epoch in range(10):
        for x, y in loader:                                            # each pass: the next epoch's order
            ...

The global order of an epoch is one seeded permutation of the whole dataset, the same for every world
size; rank r takes every world_size-th index of it from position r. So one process with batch ``B * N``
sees the same global batches as N processes with batch ``B`` each.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.core import process
from ddpkit.core.environment import usable_cores
from ddpkit.core.options import Uneven, check
from ddpkit.core.process import State
from ddpkit.data import same, streams, unprepared
from ddpkit.data.global_batch import GlobalBatchSampler
from ddpkit.data.loader import ShardedDataLoader
from ddpkit.data.samplers import SamplerShard, ShardSampler, too_few, user_sampler
from ddpkit.data.settings import cores_per_process, loader_defaults
from ddpkit.data.steps import GlobalBatchLoader
from ddpkit.data.weighted import BatchWeights
from ddpkit.data.workerseed import RankedWorkerInit
from ddpkit.runtime import group as runtime
from ddpkit.runtime import phases

__all__ = ["data_loader"]


def data_loader(dataset: Any, batch_size: int | None = None, *, global_batch_size: int | None = None,
                micro_batch_size: int | None = None, accumulation_steps: int | None = None,
                train: bool = True, shuffle: bool | None = None, uneven: Uneven | None = None, seed: int = 0,
                shuffle_buffer: int = 1000, count: Callable[[Any], Any] | None = None,
                batch_count: Callable[[Any], Any] | None = None, loader_class: type | None = None,
                **loader_kwargs: Any) -> Any:
    """Build a loader over this rank's shard of ``dataset``.

    ``batch_size`` is **per process** in DDP (global batch = batch_size x world size) and **global** in
    DP and single mode (DataParallel splits each batch across the GPUs). Or give ``global_batch_size``: it
    must divide by the world size, and each process takes its share. The global batch is printed once.

    ``train=True``: shuffled (seed ``seed`` + epoch) and ``uneven`` decides the tail: ``pad`` (default;
    repeats a few samples so every rank takes the same steps), ``drop`` (the default with ``drop_last=True``: a
    global batch of G over n samples then takes n // G steps, as one process did), or ``join`` (no repeats, unequal
    steps; wrap the loop in :func:`join`). ``train=False`` (evaluation): dataset order, no padding, so
    metrics reduced with :func:`ddpkit.reduce` / :func:`ddpkit.gather` count every sample exactly once. In
    fsdp mode (every forward gathers parameters from all ranks) a rank with fewer samples ends its pass with
    empty batches (0 samples) so all ranks run the same forwards: sum per batch, not mean.

    Each rank's DataLoader workers get their own reproducible seeds (from ``seed`` and the rank). Other
    keyword arguments (``num_workers``, ``collate_fn``, ``drop_last``, ...) go to ``DataLoader``, but for
    ``sampler=``: a sampler of your own (weighted, with replacement) gives the order instead of the shuffle;
    its stream, seeded ``seed`` + epoch, is split across ranks by position (:class:`ddpkit.data.samplers.SamplerShard`,
    docs/samplers.md). ``batch_sampler=`` is refused.

    A ``torch.utils.data.IterableDataset`` (a stream) is split across ranks and loader workers so each sample
    is read by exactly one of them (:mod:`ddpkit.data.streams`); ``uneven`` is then ``drop`` (the default: every
    rank stops when the first runs dry, agreed each step) or ``join``, ``shuffle`` is a seeded shard order
    plus a buffer of ``shuffle_buffer`` samples, reseeded per epoch; ``train=False`` reads every sample once.
    A Hugging Face ``datasets`` stream is split by rank with its own ``split_dataset_by_node``.

    ``global_batch_size=G`` with ``micro_batch_size=M`` (the most one process takes at once) or
    ``accumulation_steps=k``: a loader of optimizer *steps* of the same G samples at any world size, each
    yielding this rank's micro-batches (:mod:`ddpkit.data.steps`, docs/global-batch.md); G need not divide
    by the world size.

    ``count=fn`` (with ``global_batch_size``): the loss is a mean over items that differ in number from sample
    to sample (tokens whose label is not ``-100``, valid pixels): ``fn(micro_batch)`` counts them, and each
    step weighs its micro-batches by their share of the step's count over all ranks, so a step equals one
    process's step over the same samples at any world size (docs/global-batch.md, "Token-weighted losses").
    ``batch_count=fn``: the same for a plain loop (``for batch in loader: loss.backward()``), in ddp: each rank's
    gradient is weighed by its share of the batch's count over all ranks (:mod:`ddpkit.data.weighted`).

    ``loader_class=cls``: a DataLoader subclass that brings only its own collate (PyG's
    ``torch_geometric.loader.DataLoader``): ``cls(dataset, **kwargs)`` is made once and its ``collate_fn`` batches
    this loader's samples; the arguments only ``cls`` takes (``follow_batch=``) go to it alone.
    """
    state, tools = runtime.ensure_init(), runtime.tools()
    if train:  # sharded training batches need a prepared model by the first optimizer step
        unprepared.watch()
    if train and not isinstance(dataset, IterableDataset):  # shards of different datasets train on neither
        same.check(dataset, state.device)
        dataset = tools.dataset(dataset)  # (verify: each sample's augmentation alike in both runs)
    if loader_class is not None:
        loader_kwargs = _adopted(loader_class, dataset, loader_kwargs)
    weights = None if batch_count is None else _weights(batch_count, state, train, uneven, dataset, count,
                                                        micro_batch_size, accumulation_steps)
    if micro_batch_size is not None or accumulation_steps is not None or count is not None:
        if batch_size is not None:
            global_batch_size = None  # refused below: the per-process batch is ddpkit's to choose here
        return _step_loader(dataset, global_batch_size, micro_batch_size, accumulation_steps, state, tools,
                            train, shuffle, uneven, seed, loader_kwargs, count)
    batch_size = _per_process_batch(batch_size, global_batch_size, state,
                                    steps=train and not isinstance(dataset, IterableDataset))
    if uneven is not None:
        check("uneven", uneven, Uneven)
    if isinstance(dataset, IterableDataset):
        return _stream_loader(dataset, batch_size, state, tools, train, shuffle, uneven or "drop", seed,
                              shuffle_buffer, loader_kwargs, given_globally=global_batch_size is not None)
    # drop_last=True: the script drops its last partial batch; padded shards would add a step it never took (175
    # samples, a global batch of 16: 10 steps, but 88 + 88 padded samples make 11 of 8): the shards drop instead
    uneven = uneven or ("drop" if train and loader_kwargs.get("drop_last") else "pad")
    own = user_sampler(loader_kwargs.pop("sampler", None), loader_kwargs, shuffle)
    if own is not None and len(own) < state.world_size:  # type: ignore[arg-type]  # what the ranks share
        raise ValueError(too_few(own, len(own), state.world_size))  # type: ignore[arg-type]
    _check_samples(len(dataset), state.world_size)
    shuffle = train if shuffle is None else shuffle
    sampler_uneven = "join"  # evaluation: no sample repeated or left out
    if train:
        batch_size = tools.train_batch(batch_size, global_batch_size is not None)  # verify: the global batch
        process.current().train_batch = batch_size  # (an RNN whose time axis is this size: strategies.unbatched)
        sampler_uneven = tools.uneven(uneven)
    multiple = tools.multiple()  # verify: both runs keep a multiple of N samples (with "drop": training)
    sampler = ShardSampler(len(dataset), state.rank, state.world_size, shuffle, seed, sampler_uneven,
                           multiple=multiple) if own is None else \
        SamplerShard(own, state.rank, state.world_size, seed, sampler_uneven, multiple=multiple)
    loader_kwargs = _with_defaults(dataset, state, seed, loader_kwargs)
    # a mode whose forward is collective (fsdp gathers parameters) needs every rank to take every eval step
    equal = None
    if not train and state.strategy.collective_forward:
        first = len(range(0, sampler.size, state.world_size))  # rank 0 has the most samples, so the most batches
        equal = first // batch_size if loader_kwargs.get("drop_last") else -(-first // batch_size)
    loader = ShardedDataLoader(dataset, batch_size=batch_size, sampler=sampler, join=train and uneven == "join",
                               equal_steps=equal, train=train, weights=weights, **loader_kwargs)
    if train:
        mode = state.strategy
        _announce(loader, state, tools, batch_size * mode.batch_share(state),
                  mode.describe_batch(state, batch_size, len(loader)))
    return loader


def _step_loader(dataset: Any, global_batch: int | None, micro: int | None, accumulation: int | None,
                 state: State, tools: Any, train: bool, shuffle: bool | None, uneven: str | None, seed: int,
                 loader_kwargs: dict[str, Any], count: Callable[[Any], Any] | None) -> GlobalBatchLoader:
    """``global_batch_size`` with ``micro_batch_size`` / ``accumulation_steps`` / ``count``: a loader of optimizer
    steps."""
    given = (("micro_batch_size", micro), ("accumulation_steps", accumulation))
    asked = ", ".join([f"{name}={value}" for name, value in given if value is not None]
                      + (["count=..."] if count is not None else []))
    if count is not None and not callable(count):
        raise ValueError(f"count={count!r}: expected a function of a micro-batch that returns how many items its "
                         "mean loss averages, e.g. count=lambda batch: (batch['labels'] != -100).sum()")
    if global_batch is None:
        raise ValueError(f"{asked} split a global batch into micro-steps: pass global_batch_size=G (the samples "
                         "of one optimizer step, at any world size) and no batch_size= (ddpkit picks the "
                         "per-process micro-batch)")
    if count is not None and isinstance(dataset, IterableDataset):
        raise ValueError(f"{asked} on a stream (IterableDataset): a step is read ahead to be counted, which a stream "
                         "loader does not do yet; give the samples as a map-style dataset (a list, or a Dataset "
                         "with __getitem__), or weigh the loss yourself: loss_sum / ddpkit.reduce(count) * "
                         "world_size, with loss_sum the summed (reduction='sum') token loss of the batch")
    if isinstance(dataset, IterableDataset) or not train or uneven is not None:
        what = ("a stream (IterableDataset)" if isinstance(dataset, IterableDataset) else
                "train=False (evaluation needs no accumulation)" if not train else f"uneven={uneven!r}")
        raise ValueError(f"{asked} works on a map-style training loader, got {what}; use batch_size= there "
                         "(a step's last micro-batches take whatever the global batch leaves: no uneven= needed)")
    share = state.strategy.batch_share(state)
    _check_samples(len(dataset), share)
    own = user_sampler(loader_kwargs.pop("sampler", None), loader_kwargs, shuffle)
    order = ShardSampler(len(dataset), 0, 1, train if shuffle is None else shuffle, seed, "join") \
        if own is None else SamplerShard(own, 0, 1, seed, "join")
    sampler = GlobalBatchSampler(order, state.rank if share > 1 else 0, share, global_batch, micro, accumulation,
                                 drop_last=bool(loader_kwargs.pop("drop_last", False)))
    loader = GlobalBatchLoader(dataset, sampler, count, **_with_defaults(dataset, state, seed, loader_kwargs))
    largest = max(max(shape.mine(sampler.rank)) for shape in sampler.shapes(0)) if len(loader) else 0
    process.current().train_batch = largest or None  # (strategies.unbatched: a micro-batch read as time)
    processes = f"{share} process{'es' if share != 1 else ''}"
    _announce(loader, state, tools, global_batch, f"global batch {global_batch} over {processes} in "
              f"{loader.micro_steps} micro-step{'s' if loader.micro_steps != 1 else ''} of <= {largest} per "
              f"process (gradients synced once per step), {len(loader)} steps/epoch")
    return loader


def _adopted(cls: Any, dataset: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader arguments with ``cls``'s collate: one ``cls`` made over ``dataset`` with the script's
    arguments gives it. A class with an iteration of its own would order the batches itself: refused."""
    if not (isinstance(cls, type) and issubclass(cls, DataLoader)):
        raise ValueError(f"loader_class={cls!r}: expected a subclass of torch.utils.data.DataLoader "
                         "(torch_geometric.loader.DataLoader); pass the class itself, not a loader")
    if cls.__iter__ is not DataLoader.__iter__ or cls.__len__ is not DataLoader.__len__:
        raise ValueError(f"loader_class={cls.__name__}: it iterates in its own way, which ddpkit cannot shard; "
                         "build a ddpkit.data_loader(dataset, ..., collate_fn=...) with its collate instead")
    accepted = inspect.signature(DataLoader.__init__).parameters
    made = cls(dataset, **kwargs)
    return {**{k: v for k, v in kwargs.items() if k in accepted}, "collate_fn": made.collate_fn}


def _weights(fn: Any, state: State, train: bool, uneven: str | None, dataset: Any, *steps: Any) -> BatchWeights:
    """``batch_count=fn``'s weights, or a one-line error for what it cannot weigh."""
    said = f"batch_count={fn!r}"[:80]
    if not callable(fn):
        raise ValueError(f"{said}: expected a function of a batch that returns how many items its mean loss "
                         "averages, e.g. batch_count=lambda batch: (batch['labels'] != -100).sum()")
    if any(given is not None for given in steps):
        raise ValueError(f"{said} with count=, micro_batch_size= or accumulation_steps=: batch_count= weighs a plain "
                         "loop's batches; for a loop of steps (step.backward) pass count= alone")
    if isinstance(dataset, IterableDataset):
        raise ValueError(f"{said} on a stream (IterableDataset): its ranks may end a pass apart; use a map-style "
                         "dataset, or count= with global_batch_size=G and step.backward(loss)")
    if not train or uneven == "join":
        raise ValueError(f"{said} with {'train=False' if not train else 'uneven=join'}: expected a training loader "
                         "whose ranks hand out their batches together (uneven='pad' or 'drop'); drop batch_count=")
    if state.world_size > 1 and state.strategy.name != "ddp":
        raise ValueError(f"{said} in mode {state.strategy.name}: it weighs DDP's gradients; in a mode that shards "
                         "use global_batch_size=G, count=fn and step.backward(loss) (docs/global-batch.md)")
    return BatchWeights(fn, state.world_size, state.device)


def _check_samples(samples: int, processes: int) -> None:
    if samples < processes:
        raise ValueError(f"dataset has {samples} samples but the job has {processes} processes: each rank "
                         "needs at least one sample; use fewer processes or a larger dataset")


def _with_defaults(dataset: Any, state: State, seed: int, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader's arguments with the machine's defaults (workers, pinning) and this rank's generator
    under the script's own."""
    cores = cores_per_process(usable_cores(), os.cpu_count() or 1, state.local_world_size)
    kwargs = {**loader_defaults(dataset, state.device.type, cores, loader_kwargs.get("num_workers")), **loader_kwargs}
    # Worker seeds derive from this generator: distinct per rank, identical across reruns.
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed * 1_000_003 + state.rank))
    if kwargs.get("worker_init_fn") is not None and state.world_size > 1:  # the script's seeds: alike on every rank
        kwargs["worker_init_fn"] = RankedWorkerInit(kwargs["worker_init_fn"], state.rank)
        if state.is_main:
            print("ddpkit: worker_init_fn seeds the workers alike on every rank: ranks other than 0 reseed them by "
                  "rank after it (random, numpy, torch), so that no two ranks draw the same", file=sys.stderr,
                  flush=True)
    return kwargs


def _announce(loader: Any, state: State, tools: Any, global_batch: int, line: str) -> None:
    """A training loader: hook the tools in, and say ``line`` (the global batch) once."""
    tools.on_loader(loader, state.rank, lambda: {"global_batch": global_batch, "mode": state.mode,
                                                 "device": str(state.device)}, process.on_shutdown)
    phases.watch_loader(loader)  # under ddpkit launch: its fetches are the phase report's data time
    if state.is_main:
        workers = f", {loader.num_workers} loader workers per process" if loader.num_workers else ""
        print(f"ddpkit: {line}{workers}", file=sys.stderr, flush=True)


def _stream_loader(dataset: IterableDataset, batch_size: int, state: State, tools: Any, train: bool,
                   shuffle: bool | None, uneven: str, seed: int, shuffle_buffer: int,
                   loader_kwargs: dict[str, Any], given_globally: bool = False) -> Any:
    """An IterableDataset: :mod:`ddpkit.data.streams` splits it across ranks and workers."""
    if loader_kwargs.get("persistent_workers"):
        raise ValueError("persistent_workers=True would keep last epoch's stream position in the workers; "
                         "drop it for a stream")
    if state.device.type == "cuda":
        loader_kwargs.setdefault("pin_memory", True)
    if train:
        batch_size = tools.train_batch(batch_size, given_globally)
        process.current().train_batch = batch_size
    loader = streams.stream_loader(dataset, batch_size, state, train=train, uneven=uneven,
                                   shuffle=train if shuffle is None else shuffle, seed=seed,
                                   shuffle_buffer=shuffle_buffer,
                                   collective_forward=state.strategy.collective_forward, **loader_kwargs)
    if train:
        mode = state.strategy
        _announce(loader, state, tools, batch_size * mode.batch_share(state),
                  mode.describe_batch(state, batch_size, None))
    return loader


def _per_process_batch(batch_size: int | None, global_batch_size: int | None, state: State, steps: bool) -> int:
    """The batch each process takes. ``steps``: a map-style training loader, which the step loader could build
    instead (its advice is given only where it would be accepted)."""
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError("give exactly one of batch_size (per process) and global_batch_size, "
                         f"got {batch_size} and {global_batch_size}")
    if batch_size is not None:
        return batch_size
    assert global_batch_size is not None
    shares = state.strategy.batch_share(state)
    if global_batch_size % shares:
        steps_too = (", or micro_batch_size=M too: steps of any global batch, split by ddpkit "
                     "(docs/global-batch.md)") if steps else ""
        raise ValueError(f"global_batch_size={global_batch_size} does not divide by {shares} processes; pass a "
                         f"multiple of {shares} (e.g. {global_batch_size // shares * shares or shares}){steps_too}")
    return global_batch_size // shares
