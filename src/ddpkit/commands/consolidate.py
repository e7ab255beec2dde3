"""``ddpkit consolidate CKPT_DIR OUT``: one plain state dict of a model from a checkpoint of either format
(sharded DCP or a single ``state.pt``), written atomically, with no process group: a torch file, or safetensors
(``--format safetensors``, or an ``OUT`` ending in ``.safetensors``; :mod:`ddpkit.checkpoint.export`).

Example::

    ddpkit consolidate runs/exp/ckpt-0000000100 model.pt
    model.load_state_dict(torch.load("model.pt", weights_only=True))
    ddpkit consolidate runs/exp model.safetensors               # safetensors.torch.load_file("model.safetensors")
    ddpkit consolidate runs/exp export/ --format safetensors --max-shard-mb 5000   # parts + the index
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from ddpkit.checkpoint import safeload
from ddpkit.checkpoint.dcp import full_model_state
from ddpkit.checkpoint.disk import newest_valid, validate
from ddpkit.checkpoint.export import to_safetensors
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.core.atomic import write_atomically
from ddpkit.core.errors import UsageError

PROG = "ddpkit consolidate"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Write one plain state dict of a model from a ddpkit checkpoint.")
    p.add_argument("checkpoint", help="a ckpt-* directory (sharded or not), or a run directory: its newest valid")
    p.add_argument("out", help="the file to write: .pt (torch.load(out, weights_only=True) reads it) or "
                   ".safetensors; a directory with --max-shard-mb")
    p.add_argument("--name", default="model", help="the object's name in Checkpointer.save (default: model)")
    p.add_argument("--format", choices=("pt", "safetensors"), default=None,
                   help="pt (a torch file) or safetensors (tensors and a JSON header, no pickle: what Hugging Face "
                        "tools load); default: safetensors for an OUT ending in .safetensors, or a directory "
                        "with --max-shard-mb")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="safetensors split into parts of at most this many MB, with model.safetensors.index.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        path = ns.checkpoint if os.path.exists(os.path.join(ns.checkpoint, "manifest.json")) else \
            newest_valid(ns.checkpoint)
        if path is None:
            raise UsageError(f"{ns.checkpoint} holds no valid checkpoint; pass a ckpt-* directory or a run directory")
        reason = validate(path)
        if reason:
            raise UsageError(f"{path} is not a valid checkpoint: {reason}")
        named = ns.out.endswith(".safetensors") or (ns.max_shard_mb is not None and not ns.out.endswith(".pt"))
        form = ns.format or ("safetensors" if named else "pt")
        if form == "pt" and ns.max_shard_mb is not None:
            raise UsageError("--max-shard-mb splits safetensors files only; drop it or pass --format safetensors")
        if form == "safetensors":
            written = to_safetensors(path, ns.out, ns.name, ns.max_shard_mb)
            print(f"{PROG}: {ns.name!r} from {path} -> {', '.join(written)}", file=sys.stderr)
            return 0
        state = full_model_state(path, ns.name)
        if not os.path.isdir(os.path.dirname(os.path.abspath(ns.out))):
            raise UsageError(f"the directory of {ns.out} does not exist; create it or name another path")
        if os.path.isdir(ns.out):
            raise UsageError(f"{ns.out} is a directory; name the .pt file to write (e.g. {ns.out.rstrip(os.sep)}/"
                             "model.pt)")
    except (UsageError, safeload.UnsafeCheckpoint) as exc:
        return usage_error(PROG, exc)
    write_atomically(ns.out, lambda f: torch.save(state, f))
    print(f"{PROG}: {len(state)} tensors of {ns.name!r} from {path} -> {ns.out}", file=sys.stderr)
    return 0
