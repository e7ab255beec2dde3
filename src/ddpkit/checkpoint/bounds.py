"""What a pickled value read from a checkpoint may be, checked before anything uses it.

``torch.load(weights_only=True)`` runs no code, but it still builds whatever the pickle describes, and a pickle
describes shared references for free: 30 levels of ``x = [x, x]`` are 3 kB on disk and 2**30 values to anything
that walks them as a tree (an optimizer's ``load_state_dict`` copies its state that way: restore ran for ever, at
2.7 GB after 40 s). So every pickled value ddpkit reads (``state.pt``, a sharded checkpoint's bytes entries) goes
through :func:`load`: a zip as torch.save writes it (members stored, not compressed: a deflated pickle is a zip
bomb; the pickle at most :data:`LIMIT_PICKLE` bytes), then the value walked as a tree without recursion, stopping
at more values than its pickle has bytes (a value of its own costs at least a byte of pickle; only shared
references expand past that) or deeper than :data:`DEPTH`. Then the types and shapes the restoring objects
expect: :func:`state_problem` for ``state.pt``'s frame, :func:`optimizer_problem` for an optimizer's state.

Example::

    with confine.open_inside(ckpt, "state.pt") as f:
        payload = load(f, f"{ckpt}/state.pt")       # UnsafeCheckpoint, one line, for a crafted file
"""

from __future__ import annotations

import operator
import os
import zipfile
from typing import Any, BinaryIO

import torch

from ddpkit.checkpoint import confine
from ddpkit.checkpoint.confine import UnsafeCheckpoint

LIMIT_PICKLE = 64 << 20  # a tensor is ~150 bytes of pickle: 400,000 tensors, and at most ~10x that in memory
DEPTH = 64  # a state dict nests ~6 deep (optimizer, state, parameter, key, tensor)
_SLACK = 1 << 16
MAX_STEP = 10**10  # a checkpoint's name has 10 digits for its step
MAX_WORLD = 1 << 20  # ranks a checkpoint was saved by: far past any job, and its RNG rows then stay bounded
_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)
# torch.optim's optimizers whose state is elementwise: each tensor has its parameter's shape, or is a scalar
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop",
                "ASGD", "SparseAdam", "Muon"}


def load_state(checkpoint: str) -> dict[str, Any]:
    """The ``state.pt`` of ``checkpoint``, read inside it (:mod:`ddpkit.checkpoint.confine`), bounded (:func:`load`)
    and of the frame ddpkit's save writes (:func:`state_problem`); :class:`UnsafeCheckpoint` otherwise."""
    where = os.path.join(checkpoint, "state.pt")
    with confine.open_inside(checkpoint, "state.pt") as f:
        payload = load(f, where)
    problem = state_problem(payload)
    if problem:
        raise UnsafeCheckpoint(f"{where} refused: {problem}; {confine.ADVICE}")
    return payload  # a dict: state_problem checked it


def load(source: BinaryIO, where: str) -> Any:
    """``torch.load(weights_only=True)`` of ``source`` (a file torch.save wrote) once its zip is bounded, and its
    value bounded (:func:`tree_problem`); :class:`UnsafeCheckpoint` with one line otherwise."""
    size = _pickle_size(source, where)
    try:
        value = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only's UnpicklingError names the global, on many lines; torch's own checks
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        # torch's: "Weights only load failed. ... \n...Unsupported global: GLOBAL print was not an allowed ..."
        named = next((line for line in lines[1:] if "unsupported" in line.lower()), "")
        first = f"{lines[0].split('. ')[0][:120]}{': ' if named else ''}{named.split('. ')[0][:160]}"
        raise UnsafeCheckpoint(f"{where} refused: {type(exc).__name__}: {first}; expected tensors and plain "
                               f"values as torch.save writes them; {confine.ADVICE}") from None
    problem = tree_problem(value, size + _SLACK)
    if problem:
        raise UnsafeCheckpoint(f"{where} refused: {problem}; {confine.ADVICE}")
    return value


def _pickle_size(source: BinaryIO, where: str) -> int:
    """The size of the pickle in the zip ``source`` (rewound after), once every member is stored uncompressed
    and the pickle is at most :data:`LIMIT_PICKLE` bytes."""
    start = source.tell()
    try:
        with zipfile.ZipFile(source) as archive:
            members = archive.infolist()
    except Exception as exc:  # noqa: BLE001 - zipfile raises many classes (NotImplementedError for a version)
        said = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise UnsafeCheckpoint(f"{where} refused: it is no zip file ({said}); expected a file torch.save wrote; "
                               f"{confine.ADVICE}") from None
    finally:
        source.seek(start)
    packed = next((m for m in members if m.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise UnsafeCheckpoint(f"{where} refused: its member {packed.filename!r} is compressed, expected members "
                               f"stored as torch.save writes them; {confine.ADVICE}")
    pickles = [m.file_size for m in members if m.filename.endswith("data.pkl")]
    if not pickles or max(pickles) > LIMIT_PICKLE:
        raise UnsafeCheckpoint(f"{where} refused: its pickle is {max(pickles, default=0)} bytes, expected one "
                               f"of 1 to {LIMIT_PICKLE}; {confine.ADVICE}")
    return max(pickles)


def tree_problem(value: Any, budget: int, depth: int = DEPTH) -> str | None:
    """None when ``value``, walked as a tree (a shared reference counted each time it is reached), has at most
    ``budget`` values and ``depth`` levels; else what it has. No recursion: a deep value cannot overflow it."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    count = 1
    while stack:
        item, level = stack.pop()
        if isinstance(item, _LEAVES):
            continue
        if level >= depth:
            return f"it nests deeper than {depth} levels, expected a state dict"
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else \
            list(item) if isinstance(item, (list, tuple, set, frozenset)) else []
        count += len(children)
        if count > budget:
            return (f"its values, shared references counted each time, are more than {budget} (a pickle of that "
                    "size holds fewer of its own), expected a state dict")
        stack.extend((child, level + 1) for child in children)
    return None


def step_number(step: Any) -> int:
    """``step`` as an int once it can name its checkpoint with 10 digits (``ckpt-0000000005``): one of 10**10 or
    more, or below 0, would be written under a name no listing matches, never resumed nor deleted by ``keep``."""
    try:
        number = None if isinstance(step, bool) else operator.index(step)  # numpy and 0-d int tensors too
    except TypeError:
        number = None
    if number is None:
        raise ValueError(f"checkpoint step {step!r:.40} is a {type(step).__name__}, expected a whole number from 0 "
                         f"to {MAX_STEP - 1}; pass the training step as an int")
    if not 0 <= number < MAX_STEP:
        raise ValueError(f"checkpoint step {number} is outside 0..{MAX_STEP - 1} (a checkpoint's name holds "
                         "10 digits: it would be written and never listed); pass the training step as an int in range")
    return number


def state_problem(payload: Any) -> str | None:
    """What is wrong with the frame of a ``state.pt`` (None when nothing): the keys ddpkit's save writes, each of
    its type, a step that names a checkpoint, RNG states as one row per rank."""
    if not isinstance(payload, dict):
        return f"it holds a {type(payload).__name__}, expected the dict ddpkit's save writes"
    step, world, rng = payload.get("step"), payload.get("world_size"), payload.get("rng")
    if type(step) is not int or not 0 <= step < MAX_STEP:
        return f"its step is {step!r:.40}, expected a whole number from 0 to {MAX_STEP - 1}"
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        return f"its world_size is {world!r:.40}, expected a whole number from 1 to {MAX_WORLD}"
    if not isinstance(payload.get("objects"), dict) or not all(isinstance(k, str) for k in payload["objects"]):
        return "its objects are no dict of names, expected one entry per object saved"
    sharded = payload.get("sharded", [])
    if not isinstance(sharded, (list, tuple)) or not all(isinstance(k, str) for k in sharded):
        return f"its sharded names are {type(sharded).__name__}, expected a list of names"
    if not isinstance(rng, dict) or not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and len(v) == world
                                            for v in rng.values()):
        return f"its RNG states are no tensors of one row per rank ({world}), expected what ddpkit's save gathers"
    # a view whose rows share their storage (a stride of 0) holds N rows in the bytes of one: checking it would
    # make them all (400,000 rows of a 20 kB file took 15 s and 724 MB)
    if any(v.untyped_storage().nbytes() < v.numel() * v.element_size() for v in rng.values()):
        return "its RNG states are a view over less storage than its rows, expected the rows ddpkit's save gathers"
    return next((f"its RNG state {name!r:.40} is {problem}" for name, value in rng.items()
                 if (problem := _rng_problem(str(name), value))), None)


_TORCH_RNG = torch.get_rng_state().numel()  # bytes of a CPU generator's state (a loader's too)
_WORD = 1 << 32  # Mersenne Twister words are 32-bit


def _rng_problem(name: str, rows: torch.Tensor) -> str | None:
    """What in one gathered RNG state (one row per rank) python, numpy or torch would refuse, or take and break
    on (a negative word raised OverflowError mid-restore), before any of it is set."""
    def words(count: int, last_max: int | None = None) -> str | None:
        if rows.dtype != torch.int64 or tuple(rows.shape[1:]) != (count,):
            return f"{rows.dtype} {list(rows.shape[1:])}, expected int64 [{count}] per rank"
        past = last_max is not None and bool((rows[:, -1] > last_max).any())  # python's position in its words
        if bool(((rows < 0) | (rows >= _WORD)).any()) or past:
            return "out of the generator's range"
        return None

    if name == "python_mt":
        return words(625, last_max=624)
    if name == "numpy_keys":
        return words(624)
    if name in ("python_gauss", "numpy_rest"):
        ok = rows.dtype == torch.float64 and tuple(rows.shape[1:]) == (3,) and bool(rows.isfinite().all()) and \
            bool(((rows[:, 1] == 0) | (rows[:, 1] == 1)).all())
        bound = 3 if name == "python_gauss" else 624  # random's state version; numpy's position
        return None if ok and bool(((rows[:, 0] >= 0) & (rows[:, 0] <= bound)).all()) else \
            f"{rows.dtype} {list(rows.shape[1:])} with values out of range, expected float64 [3] per rank"
    if name == "torch" or name.startswith("loader.") or name == "rankgen.cpu":
        return None if rows.dtype == torch.uint8 and tuple(rows.shape[1:]) == (_TORCH_RNG,) else \
            f"{rows.dtype} {list(rows.shape[1:])}, expected uint8 [{_TORCH_RNG}] per rank"
    if name in ("cuda", "rankgen.cuda"):
        return None if rows.dtype == torch.uint8 and rows.dim() in (2, 3) else f"{rows.dtype}, expected uint8 rows"
    if name.startswith("rankgen."):  # (ddpkit.rank_generator's: a cpu or a cuda one, no other)
        return "a generator of no device ddpkit saves, expected rankgen.cpu or rankgen.cuda"
    return None  # a state ddpkit does not restore


def optimizer_problem(saved: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """What in an optimizer's saved state does not fit ``optimizer`` (None when nothing), before its
    ``load_state_dict`` copies it: groups of parameter ids, per-parameter state of tensors and numbers, and
    for torch's elementwise optimizers each tensor a scalar or of its parameter's shape."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or \
            not isinstance(saved.get("param_groups"), list):
        return "it is no dict of 'state' and 'param_groups', expected an optimizer's state_dict()"
    ids = [i for g in saved["param_groups"] for i in (g.get("params") if isinstance(g, dict) else None) or [None]]
    if not all(type(i) is int for i in ids):
        return "its param_groups are no dicts of parameter ids, expected an optimizer's state_dict()"
    params = dict(zip(ids, (p for g in optimizer.param_groups for p in g["params"])))
    elementwise = type(optimizer).__name__ in _ELEMENTWISE and type(optimizer).__module__.startswith("torch.optim")
    for key, state in saved["state"].items():
        if not isinstance(state, dict):
            return f"the state of parameter {key!r:.20} is a {type(state).__name__}, expected a dict"
        for name, value in state.items():
            problem = _value_problem(value, params.get(key), elementwise)
            if problem:
                return f"state {name!r:.40} of parameter {key!r:.20} is {problem}"
    return None


def _value_problem(value: Any, param: torch.Tensor | None, elementwise: bool) -> str | None:
    plain = (int, float, bool, type(None))
    if isinstance(value, torch.Tensor):
        if elementwise and param is not None and value.dim() > 0 and value.shape != param.shape:
            return f"a tensor of shape {tuple(value.shape)}, expected its parameter's {tuple(param.shape)} or a scalar"
        return None
    if isinstance(value, plain):
        return None
    if not elementwise and isinstance(value, (list, tuple)) and all(isinstance(v, (torch.Tensor, *plain))
                                                                    for v in value):
        return None  # LBFGS keeps lists of tensors
    return f"a {type(value).__name__}, expected a tensor or a number"
