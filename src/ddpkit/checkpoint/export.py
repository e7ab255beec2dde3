"""A model out of a ddpkit checkpoint as safetensors: the format Hugging Face tools load, which holds tensors and
a JSON header only (nothing in it is pickled, so loading it runs no code).

One file, or, with ``max_shard_mb``, a directory of ``model-00001-of-0000N.safetensors`` files and the
``model.safetensors.index.json`` that maps each name to its file (Hugging Face's layout for split weights). The
names are the model's plain ones (no ``module.``), from a checkpoint of any mode (ddp, fsdp, hsdp, single); tied
parameters are written once per name, so ``load_state_dict(strict=True)`` finds every key.

Example::

    paths = to_safetensors("runs/exp/ckpt-0000000100", "export/model.safetensors")
    model.load_state_dict(safetensors.torch.load_file(paths[0]), strict=True)
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import torch

from ddpkit.checkpoint.dcp import full_model_state
from ddpkit.core.atomic import write_atomically
from ddpkit.core.errors import UsageError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_OURS = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # the names of an export's parts


def _remove_stale(out: str, written: set[str]) -> None:
    """An earlier export's files in ``out`` that this one did not write: its parts, its index, its single file
    (transformers loads ``model.safetensors`` before an index: a stale one would shadow new parts). Removed
    after the new files are whole; regular files of those exact names only (anything else there is the user's)."""
    for entry in os.scandir(out):
        ours = entry.name in (INDEX, SINGLE) or _OURS.fullmatch(entry.name)
        if ours and entry.name not in written and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def _backend() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError("writing safetensors needs the safetensors package, which is not installed; "
                         "pip install safetensors (or ddpkit[safetensors])") from None
    return safetensors.torch


def plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor whole, contiguous and in memory of its own (safetensors refuses views of one storage, which
    tied weights are), on the CPU.

    >>> w = torch.ones(2, 2); out = plain({"a": w, "b": w, "c": w.t()})
    >>> [t.data_ptr() == w.data_ptr() for t in out.values()], out["c"].is_contiguous()
    ([True, False, False], True)
    """
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        whole = tensor.is_contiguous() and tensor.storage_offset() == 0 and \
            tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
        out[name] = tensor if whole and storage not in seen else tensor.contiguous().clone()
        seen.add(storage)
    return out


def split(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, in parts of at most ``max_bytes`` each (a tensor larger than that alone in its part).

    >>> [list(p) for p in split({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(8)}, 32)]
    [['a', 'b'], ['c']]
    """
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and parts[-1] and size + nbytes > max_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    return parts


def to_safetensors(checkpoint: str, out: str, name: str = "model", max_shard_mb: float | None = None) -> list[str]:
    """Write object ``name`` of ``checkpoint`` (a ``ckpt-*`` directory) to ``out``; returns the files written.

    Without ``max_shard_mb``, ``out`` is one ``.safetensors`` file (an existing directory: ``model.safetensors``
    in it). With it, ``out`` is a directory that receives the parts and ``model.safetensors.index.json``, the
    layout ``transformers`` loads with ``from_pretrained(out)``. Every file is written
    whole or not at all (a temporary file renamed into place), the index last; then an earlier export's parts,
    index or single file there that this one did not write are removed (exporting again is idempotent)."""
    if max_shard_mb is not None and not 0 < max_shard_mb < math.inf:  # nan fails both; inf would overflow int()
        raise UsageError(f"--max-shard-mb {max_shard_mb} is not a size; pass a number of MB > 0, e.g. 5000")
    if max_shard_mb is not None and os.path.exists(out.rstrip(os.sep) or out) and not os.path.isdir(out):
        raise UsageError(f"{out} is a file, and --max-shard-mb writes a directory of parts; name a directory")
    parent = os.path.dirname(os.path.abspath(out)) if max_shard_mb is None or os.path.isdir(out) else \
        os.path.dirname(os.path.abspath(out.rstrip(os.sep)))
    if not os.path.isdir(parent):
        raise UsageError(f"the directory {parent} of {out} does not exist; create it or name another path")
    backend = _backend()
    # tensors only: a module's _extra_state (any picklable value) has no place in safetensors
    state = plain({k: v for k, v in full_model_state(checkpoint, name).items() if isinstance(v, torch.Tensor)})
    parts = split(state, None if max_shard_mb is None else int(max_shard_mb * 2**20))
    metadata = {"format": "pt"}  # what transformers' loader checks
    if max_shard_mb is None:
        path = os.path.join(out, SINGLE) if os.path.isdir(out) else out
        write_atomically(path, lambda f: f.write(backend.save(parts[0], metadata=metadata)))
        if os.path.isdir(out):
            _remove_stale(out, {SINGLE})
        return [path]
    os.makedirs(out, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for file, part in zip(names, parts):
        data = backend.save(part, metadata=metadata)
        write_atomically(os.path.join(out, file), lambda f: f.write(data))  # noqa: B023 (called at once)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: file for file, p in zip(names, parts) for k in p}}
    write_atomically(os.path.join(out, INDEX), lambda f: f.write(json.dumps(index, indent=2).encode()))
    _remove_stale(out, {*names, INDEX})
    return [os.path.join(out, file) for file in names] + [os.path.join(out, INDEX)]
