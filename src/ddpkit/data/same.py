"""Every rank shards the same training dataset: checked once, where the training loader is built.

A sampler gives each rank its part of one dataset; when the ranks hold different datasets, their parts are parts
of different data and the job trains on neither, with no error ever. Scripts do this without a word: a dataset
drawn from random numbers with no seed, a ``random_split`` unseeded (or seeded after ``ddpkit.init(seed=...)``,
whose streams differ per rank), per-rank files. So each rank computes a fingerprint of its dataset (its length;
for tensors it holds, a weighted sum over up to :data:`ROWS` rows; a ``Subset``'s indices; for a Dataset of its
own, what its attributes hold: a list of texts or of (path, label) pairs shuffled with no seed, a DataFrame) and
the ranks compare them in one all-gather. What a fingerprint cannot see (a Dataset that reads files in
``__getitem__``) only its length is compared: a sample is never drawn here (random augmentation would differ by
design, and a sample drawn in the main process could open a file the loader's workers would then share).

Example::

    >>> from torch.utils.data import TensorDataset, Subset
    >>> a = fingerprint(Subset(TensorDataset(torch.arange(10.0)), [3, 1]))
    >>> a.tolist()[0], bool((a == fingerprint(Subset(TensorDataset(torch.arange(10.0)), [1, 3]))).all())
    (2.0, False)
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import math
import os
import re
import sys
import textwrap
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

ROWS = 64  # rows of a tensor that enter its sum: spread over the whole tensor, first and last included
DEPTH = 4  # Subsets of Subsets, ConcatDatasets: how deep the fingerprint looks


def fingerprint(dataset: Any) -> torch.Tensor:
    """``[len, sums...]`` in float64 (CPU): the same on every rank that holds the same data, in a fixed length."""
    return torch.tensor([float(len(dataset)), *_sums(dataset, DEPTH)], dtype=torch.float64)


def _sums(dataset: Any, depth: int) -> list[float]:
    """Three numbers: the weighted sums of the tensors the dataset holds, of its subset indices, and of its
    parts' lengths; 0 where it holds none."""
    tensors, indices, parts = 0.0, 0.0, 0.0
    if depth > 0 and isinstance(dataset, TensorDataset):
        tensors = sum(_rows(t) for t in dataset.tensors)
    elif depth > 0 and isinstance(dataset, Subset):
        given = dataset.indices
        indices = _weighted(given.detach().to(torch.float64).reshape(-1) if isinstance(given, torch.Tensor)
                            else torch.as_tensor(list(given), dtype=torch.float64))
        inner = _sums(dataset.dataset, depth - 1)
        tensors, parts = inner[0] + inner[1], inner[2]
    elif depth > 0 and isinstance(dataset, ConcatDataset):
        parts = _weighted(torch.tensor(dataset.cumulative_sizes, dtype=torch.float64))
        for part in dataset.datasets:
            inner = _sums(part, depth - 1)
            tensors, indices = tensors + inner[0], indices + inner[1]
    elif depth > 0:  # a Dataset of its own: what its attributes hold (torchvision's .data / .targets, a list
        # of texts, of (path, label) pairs, a DataFrame)
        served = _served(type(dataset))
        for name in sorted(getattr(dataset, "__dict__", {})):
            value = dataset.__dict__[name]
            if served is not None and name not in served:  # (only its length read: a shuffled id list, ECNU's)
                continue
            if isinstance(value, Dataset):
                inner = _sums(value, depth - 1)
                tensors, indices, parts = tensors + inner[0], indices + inner[1], parts + inner[2]
            else:
                tensors += _held(name, value, len(dataset))
    return [tensors, indices, parts]


def _served(cls: type) -> set[str] | None:
    """The attributes a Dataset class's methods read other than ``__init__`` and ``__len__`` (``self.labels`` of
    ``__getitem__``, or of a helper it calls): what its samples can come from; None when a method's source cannot
    be read (every attribute then counts)."""
    found: set[str] = set()
    own = [k for k in cls.__mro__ if k.__module__ not in ("builtins", "typing") and
           not k.__module__.startswith("torch.")]
    if not any("__getitem__" in vars(k) for k in own):
        return None  # (no map-style sampling of its own to read: every attribute counts)
    for klass in own:
        for name, member in vars(klass).items():
            function = _function(member)
            if name in ("__init__", "__len__") or function is None:
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                return None
            # (attributes read by name, or ``self`` handed to another function: any may be served)
            if re.search(r"getattr\(\s*self\s*,|self\.__dict__|vars\(\s*self\s*\)", source) or _hands_self(source):
                return None
            read = set(re.findall(r"\bself\.(\w+)", source))
            found |= read | {f"_{klass.__name__.lstrip('_')}{n}" for n in read if n.startswith("__")}  # (mangled)
    return found


def _hands_self(source: str) -> bool:
    """A call in the method's source passes ``self`` itself (``row(self, i)``): that function may read anything."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return True
    if any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == "self"
           for n in ast.walk(tree)):
        return True  # (``ds = self``: read under another name)
    # (not a builtin that only measures or names it: ``len(self)``, ``isinstance(self, ...)``)
    return any(isinstance(a, ast.Name) and a.id == "self" for node in ast.walk(tree) if isinstance(node, ast.Call)
               and not (isinstance(node.func, ast.Name) and node.func.id in _MEASURES)
               for arg in [*node.args, *(k.value for k in node.keywords)] for a in ast.walk(arg))


_MEASURES = ("len", "isinstance", "type", "id", "hash", "repr", "str", "print", "super")


def _function(member: Any) -> Any:
    """The function a class member runs: a method, a property's getter, a static or class method's, through
    decorators that keep ``__wrapped__`` (``functools.lru_cache``); None for anything else."""
    if isinstance(member, property):
        member = member.fget
    elif isinstance(member, functools.cached_property):
        member = member.func
    elif isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    member = inspect.unwrap(member) if callable(member) else member
    return member if inspect.isfunction(member) else None


# the attributes whose tensors and numeric arrays are the samples (torchvision's): a tensor under another name
# may be a buffer, a stored generator state or a random jitter each process draws on purpose
SAMPLES = ("data", "targets")
CACHES = ("cache", "memo", "seen", "buffer")  # a list one per sample under such a name is filled as samples are read


def _held(name: str, value: Any, length: int) -> float:
    """A number for what the attribute ``name`` of a Dataset (of ``length`` samples) holds: the tensors and numeric
    arrays of :data:`SAMPLES`, or of one row per sample (``self.x = torch.randn(n, 6)``), by :func:`_rows`; a
    list, tuple or array of plain values (texts, numbers, (path, label) pairs) by up to :data:`ROWS` of them; a
    pandas table by its columns of plain values; 0 for anything else (a transform, a generator, a number such as
    a rank or an epoch, a cache filled as samples are read). Never raises: what it cannot read counts as
    nothing."""
    try:
        if isinstance(value, torch.Tensor) or _numbers(value):  # (a tensor of one row per sample: samples too)
            rows = value.shape[0] if getattr(value, "ndim", 0) > 0 else None
            return _rows(value) if name in SAMPLES or rows == length else 0.0
        if type(value).__name__ in ("DataFrame", "Series") and hasattr(value, "iloc"):
            return _table(value)
        if isinstance(value, (list, tuple)) or _array(value) and value.ndim == 1:
            # (tensors in a list: the samples only, one per sample, and no cache each rank fills as it reads)
            samples = name in SAMPLES or len(value) == length and not any(w in name.lower() for w in CACHES)
            return _plain([value[i] for i in _picks(len(value)).tolist()], tensors=samples)
    except Exception:  # noqa: BLE001  (a sparse, meta or quantized tensor, an odd array: not compared)
        return 0.0
    return 0.0


def _table(frame: Any) -> float:
    """A pandas DataFrame (or Series) by up to :data:`ROWS` rows of each column of plain values."""
    picked = frame.iloc[_picks(len(frame)).tolist()]
    columns = [picked[c] for c in picked.columns] if hasattr(picked, "columns") else [picked]
    return sum((k + 1) * _plain(list(column)) for k, column in enumerate(columns))


def _plain(items: list[Any], tensors: bool = False) -> float:
    """An order-sensitive number for a list of plain values, or (``tensors``: the list holds the samples) of
    tensors or numeric arrays, each by :func:`_rows` (LSTM_pytorch's ``self.x = [torch.randn(d) ...]`` drawn
    unseeded in ``__init__``); 0 for anything else (a cache each rank fills with what it reads)."""
    if tensors and items and all(isinstance(item, torch.Tensor) or _numbers(item) for item in items):
        return _weighted(torch.tensor([_rows(item) + 1.0 for item in items], dtype=torch.float64))
    if tensors and items and all(isinstance(item, tuple) and item for item in items):  # (array, label) pairs
        pairs = [_pair(item) for item in items]  # (set 29: a toy dataset's list drawn with ``random``, unseeded)
        if all(p is not None for p in pairs):
            return _weighted(torch.tensor(pairs, dtype=torch.float64))
    found = [_item(item) for item in items]
    if not found or any(f is None for f in found):
        return 0.0
    return _weighted(torch.tensor(found, dtype=torch.float64))


def _pair(item: tuple) -> float | None:
    """A sample held as a tuple of tensors, numeric arrays and plain values (``(features, label)``): each by
    :func:`_rows` or :func:`_item`, in order; None when a part is neither."""
    parts = [_rows(v) + 1.0 if isinstance(v, torch.Tensor) or _numbers(v) else _item(v) for v in item]
    return None if any(p is None for p in parts) else _weighted(torch.tensor(parts, dtype=torch.float64))


def _item(item: Any) -> float | None:
    """A number as it is (a numpy one too), a text (or a tuple of plain values) by a stable hash of its text,
    a path by its file name (the same files under each process's own folder); None for anything else."""
    if isinstance(item, (bool, int, float)) or type(item).__module__ == "numpy" and hasattr(item, "dtype") and \
            getattr(item.dtype, "kind", "") in tuple("biuf"):
        try:
            number = float(item)
        except OverflowError:  # an int beyond float64: by its text
            return _text(repr(int(item)))
        return number if math.isfinite(number) else 0.5772
    if isinstance(item, (str, bytes)):
        return _text(item)
    spelled = _spelled(item, 2) if isinstance(item, tuple) and item else None
    return _text(spelled) if spelled is not None else None


def _spelled(value: Any, depth: int) -> str | None:
    """A stable text for a plain value or a tuple of them, nested ``depth`` deep (dlwpt's candidates
    ``(is_nodule, diameter, uid, (x, y, z))``); None for anything else."""
    if isinstance(value, (str, bytes)):
        return repr(_text(value))
    if isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, tuple) and depth > 0:
        parts = [_spelled(v, depth - 1) for v in value]
        return None if any(p is None for p in parts) else "(" + "\x1f".join(parts) + ")"  # type: ignore[arg-type]
    return None


def _text(value: str | bytes) -> float:
    """A stable hash of a text (a path: of its file name, so that a copy under another folder is the same)."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if "/" in text or os.sep in text:
        text = text.replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1]
    return float(int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).digest(), "big"))


def _numbers(value: Any) -> bool:
    """A numpy array of numbers (a memmap too; not one of texts or objects)."""
    return _array(value) and getattr(value.dtype, "kind", "") in tuple("biufc")


def _array(value: Any) -> bool:
    return "numpy" in sys.modules and isinstance(value, sys.modules["numpy"].ndarray)


def _picks(length: int) -> torch.Tensor:
    """Up to :data:`ROWS` places spread over ``length``, the first and the last included."""
    if length == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(0, length - 1, min(ROWS, length)).round().long()


def _rows(value: Any) -> float:
    """A weighted sum over up to :data:`ROWS` rows of a tensor (or a numeric numpy array) spread along its first
    dim; 0 for what has no numbers to sum (an array of file paths, of objects: its length is still compared)."""
    if not isinstance(value, torch.Tensor) and not _numbers(value):
        return 0.0
    try:
        with warnings.catch_warnings():  # (a read-only array: torch warns it may not be written; nothing writes it)
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):  # a big-endian or strided array torch does not take
        return 0.0
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return float(tensor.double().sum()) if tensor.numel() else 0.0
    rows = tensor[_picks(tensor.shape[0]).to(tensor.device)].detach().cpu()
    if rows.is_complex():
        rows = torch.view_as_real(rows)
    values = rows.double().reshape(-1)
    # NaN and the infinities each count apart from the numbers (a NaN that summed as 0.5 matched a 0.5)
    odd = [_weighted(mask.double()) * k for mask, k in ((values.isnan(), 0.5772), (values == float("inf"), 2.7183),
                                                          (values == float("-inf"), 1.4142))]
    return _weighted(torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)) + sum(odd)


def _weighted(values: torch.Tensor) -> float:
    """An order-sensitive sum: a permutation of the same values sums to another number. The weights do not
    repeat (``1 + frac(i x golden ratio)``; they repeated every 97 places, so swapping two values 97 apart went
    unseen).

    >>> a = torch.zeros(200); b = a.clone(); a[0], b[97] = 1.0, 1.0
    >>> _weighted(a) != _weighted(b)
    True
    """
    weights = torch.arange(1, values.numel() + 1, dtype=torch.float64).mul(0.6180339887498949).remainder(1.0).add(1)
    return float((values * weights).sum())


def check(dataset: Any, device: torch.device) -> None:
    """Raise ValueError on every rank when the ranks' training datasets differ (one line, the same everywhere);
    a no-op without a process group of two or more."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    mine = fingerprint(dataset).to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    other = next((r for r, theirs in enumerate(every) if not torch.equal(theirs, every[0])), None)
    if other is None:
        return
    first, then = every[0].tolist(), every[other].tolist()
    what = f"{int(first[0])} samples vs {int(then[0])}" if first[0] != then[0] else \
        "its split's indices" if first[2] != then[2] else "the samples it holds"
    raise ValueError(f"ddpkit.data_loader: the training dataset differs between ranks (rank {other}'s from rank "
                     f"0's: {what}), so the ranks would train on parts of different data; it was likely drawn from "
                     "random numbers or split at random with no seed, or with ddpkit.init(seed=...)'s streams, "
                     "which differ per rank, or ordered by a set or a hash of strings, whose order differs per "
                     "process unless PYTHONHASHSEED is one value (ddpkit launch sets it; torchrun does not), or "
                     "read from per-rank files: build it the same on every rank (seed it first: "
                     "torch.manual_seed(0), numpy.random.seed(0), random.seed(0); pass random_split a generator="
                     "torch.Generator().manual_seed(0); sorted(set(...)) for a set)")
