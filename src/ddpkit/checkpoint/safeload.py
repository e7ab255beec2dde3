"""Reading a sharded checkpoint that someone else may have written, without running any of its code.

A DCP checkpoint has two places where torch itself would unpickle freely: ``.metadata`` (``pickle.load``)
and its *bytes entries* (non-tensor values, which torch's load planner reads with
``torch.load(weights_only=False)``). Whoever can write the directory can write both, and the manifest's
sha256 values do not help (the same person writes the manifest). So every reader in ddpkit goes through
this module:

- ``.metadata`` is unpickled by :class:`MetadataUnpickler`, which resolves exactly the (module, name) pairs
  in :data:`ALLOWED` (DCP's metadata dataclasses, ``torch.Size``, dtypes, paths) and nothing else: no
  dotted names (pickle protocol 4 resolves ``os.system`` through any module that imports ``os``), no
  module-wide wildcards.
- the metadata is then checked for shape: only tensor and bytes entries, shard files that are plain names
  inside the directory, no stream transforms (ddpkit never writes them).
- bytes entries are read with ``torch.load(weights_only=True)`` (torch's own allow-list of plain
  containers and numbers) by :func:`planner`, bounded by :func:`ddpkit.checkpoint.bounds.load`, and refused where
  the object restored holds a tensor.
- every file (``.metadata``, the shards) is a regular file inside the directory (:mod:`ddpkit.checkpoint.confine`),
  and the planner data's list indices are bounded (torch's loader fills a list up to an index with ``None``).

Example::

    >>> import io, pickle
    >>> evil = b"\\x80\\x04\\x8c%torch.distributed.checkpoint.metadata\\x94\\x8c\\tos.system\\x94\\x93."
    >>> MetadataUnpickler(io.BytesIO(evil)).load()
    Traceback (most recent call last):
    ...
    _pickle.UnpicklingError: checkpoint metadata names torch.distributed.checkpoint.metadata.os.system, ...
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint import bounds, confine
from ddpkit.checkpoint.confine import UnsafeCheckpoint as UnsafeCheckpoint  # where readers have caught it
from ddpkit.core.errors import first_line

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
# Every global a .metadata written by torch's DCP (FileSystemWriter) names, found by unpickling real ones.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {(_DCP, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                               "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                               "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
       ("torch", "Size"), ("collections", "OrderedDict"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # what FileSystemWriter names its files (fullmatch)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` resolving only the exact pairs in :data:`ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(
                f"checkpoint metadata names {module}.{name}, which ddpkit does not load (only "
                "torch.distributed.checkpoint's metadata classes); the file was not written by torch's DCP")
        return super().find_class(module, name)


def read_metadata(directory: str) -> Any:
    """The checked ``Metadata`` of the DCP directory ``directory``; :class:`UnsafeCheckpoint` otherwise."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(directory, METADATA)
    with confine.open_inside(directory, METADATA) as f:  # a FIFO or /dev/zero there is refused, never read
        data = f.read(LIMIT_METADATA + 1)
    try:
        _check_opcodes(data)
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # anything a crafted pickle makes an allowed class raise (KeyError, ...)
        first = first_line(exc)
        raise UnsafeCheckpoint(f"{path} refused: {type(exc).__name__}: {first}") from None
    if not isinstance(metadata, Metadata):
        problem: str | None = f"it holds a {type(metadata).__name__}, not torch's DCP Metadata"
    else:
        problem = _shape_problem(metadata, directory)
    if problem:
        raise UnsafeCheckpoint(f"{path} refused: {problem}; ddpkit does not write that")
    return metadata


LIMIT_METADATA = 64 << 20  # bytes: DCP's .metadata is ~200 bytes a tensor


def _check_opcodes(data: bytes) -> None:
    """Walk the pickle's opcodes (pickletools runs nothing) before the C unpickler sees it: its memo is an array
    sized by the largest index a PUT names, so one crafted BINPUT of 2**31 in a 2 kB file took ~60 s and
    gigabytes zeroing it (the fuzz test's case). An index is below the opcodes' count in a pickle pickle wrote."""
    if len(data) > LIMIT_METADATA:
        raise ValueError(f"it is over {LIMIT_METADATA >> 20} MB")
    for count, (opcode, arg, _) in enumerate(pickletools.genops(data), 1):
        if opcode.name in _MEMO_OPS and (not isinstance(arg, int) or not 0 <= arg < count):
            raise ValueError(f"its memo index {arg!r:.20} at opcode {count} is past the {count} opcodes read")


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})


def _shape_problem(metadata: Any, directory: str) -> str | None:
    """What is wrong with an unpickled Metadata's shape, or None: plain containers, tensor and bytes entries,
    shard files of its own without transforms, chunks that cover each tensor, and no more tensor bytes than
    the shard files hold (a crafted size would make the reader allocate terabytes)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its entries or storage index are not dicts"
    if not isinstance(metadata.planner_data, (dict, type(None))) or any(
            not isinstance(v, tuple) or not all(isinstance(x, (str, int)) for x in v)
            for v in (metadata.planner_data or {}).values()):
        return "its planner data are not tuples of names"
    problem = _index_problem(metadata.planner_data or {}, len(entries))
    if problem:
        return problem
    files: set[str] = set()
    for info in storage.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not _SHARD_FILE.fullmatch(info.relative_path):
            return f"it points at {getattr(info, 'relative_path', info)!r}, not a shard file of its own"
        if info.transform_descriptors:
            return f"it asks for stream transforms {list(info.transform_descriptors)[:3]}"
        files.add(info.relative_path)
    on_disk = sum(os.path.getsize(confine.inside(directory, f)) for f in sorted(files))
    declared = 0
    for name, entry in entries.items():
        if not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"entry {name!r} is neither a tensor nor a bytes entry"
        if isinstance(entry, TensorStorageMetadata):  # its chunks must tile it, inside its bounds
            problem, nbytes = _chunk_problem(name, entry)
            if problem:
                return problem
            declared += nbytes
    if declared > on_disk:
        return f"its tensors declare {declared} bytes but its shard files hold {on_disk}"
    return None


def _index_problem(paths: dict[Any, tuple[Any, ...]], entries: int) -> str | None:
    """A list index in the planner data past what the entries can fill, or None. torch's loader extends a list
    with None up to each index (an index of 10**10 grew ~60 MB/s until the OOM killer); a list DCP walks has an
    entry per element, so its indices stay below the entry count (slack for elements that are empty dicts)."""
    slots: dict[tuple[Any, ...], int] = {}
    for path in paths.values():
        for at, key in enumerate(path):
            if type(key) is int:  # a str path element is a dict key; an int one a list index
                slots[path[:at]] = max(slots.get(path[:at], -1), key)
                if key < 0:
                    return f"its planner data hold the list index {key}, expected indices >= 0"
    total = sum(n + 1 for n in slots.values())
    if total > 2 * entries + 1024:
        return (f"its planner data's largest list index {max(slots.values())} makes {total} list slots for "
                f"{entries} entries, expected about one slot per entry")
    return None


def _chunk_problem(name: str, entry: Any) -> tuple[str | None, int]:
    size = tuple(entry.size)
    if not isinstance(entry.chunks, list) or not all(isinstance(n, int) and n >= 0 for n in size):
        return f"entry {name!r} has no list of chunks or a bad size {size}", 0
    covered = 0
    for chunk in entry.chunks:
        offsets, lengths = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(lengths) != len(size) or any(
                not isinstance(o, int) or not isinstance(n, int) or o < 0 or n < 0 or o + n > full
                for o, n, full in zip(offsets, lengths, size)):
            return f"entry {name!r} has a chunk outside its size {size}", 0
        covered += math.prod(lengths)
    if covered != math.prod(size):
        return f"entry {name!r}'s chunks cover {covered} of its {math.prod(size)} values", 0
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return f"entry {name!r} has no dtype", 0
    return None, math.prod(size) * torch.empty((), dtype=dtype).element_size()


def reader(directory: str, checked: Any = None, verify: Callable[[list[str]], str | None] | None = None) -> Any:
    """torch's ``FileSystemReader`` for ``directory`` whose ``.metadata`` goes through :func:`read_metadata`;
    ``checked``: the Metadata :func:`read_metadata` already returned (the file is not read twice). ``verify``
    (the shard files this rank reads, by name in ``directory``: the reason they are not the manifest's, or None)
    runs before any of them is read: a node's own copy of a file is checked by the rank that reads it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = checked if checked is not None else read_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            problem = verify(names) if verify is not None else None
            if problem:
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                raise UnsafeCheckpoint(f"{problem}, in the files rank {rank} reads; copy the checkpoint again "
                                       "(or share one directory between the nodes)")
            return super().read_data(plan, planner)

    return SafeReader(directory)


def _load_bytes(value: io.BytesIO, fqn: str, current: Any) -> Any:
    """The value of the bytes entry ``fqn``, bounded (:func:`bounds.load`), refused where the object restored
    holds a tensor (``current``): a list there would be copied as a tree by the optimizer's load_state_dict."""
    loaded = bounds.load(value, f"the bytes entry {fqn!r}")
    if isinstance(current, torch.Tensor) and not isinstance(loaded, torch.Tensor):
        raise UnsafeCheckpoint(f"the bytes entry {fqn!r} refused: it is a {type(loaded).__name__}, expected a "
                               f"tensor as the object restored holds there; {confine.ADVICE}")
    return loaded


def planner(empty: bool = False) -> Any:
    """A DCP load planner whose bytes entries load with ``weights_only=True``; ``empty``: the one that rebuilds
    the whole state dict from the metadata (for ``ddpkit consolidate``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    base: type[DefaultLoadPlanner] = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafePlanner(base):  # type: ignore[valid-type,misc]
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = _load_bytes(value, fqn, self.state_dict.get(fqn))
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner()
