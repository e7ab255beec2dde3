"""``ddpkit consolidate CKPT_DIR OUT.pt``: one plain state dict of a model from a checkpoint of either format
(sharded DCP or a single ``state.pt``), written atomically, with no process group.

Example::

    ddpkit consolidate runs/exp/ckpt-0000000100 model.pt
    model.load_state_dict(torch.load("model.pt", weights_only=True))
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
from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.core.atomic import write_atomically
from ddpkit.core.errors import UsageError

PROG = "ddpkit consolidate"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Write one plain state dict of a model from a ddpkit checkpoint.")
    p.add_argument("checkpoint", help="a ckpt-* directory (sharded or not), or a run directory: its newest valid")
    p.add_argument("out", help="the .pt file to write (torch.load(out, weights_only=True) reads it)")
    p.add_argument("--name", default="model", help="the object's name in Checkpointer.save (default: model)")
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
        state = full_model_state(path, ns.name)
    except (UsageError, safeload.UnsafeCheckpoint) as exc:
        return usage_error(PROG, exc)
    write_atomically(ns.out, lambda f: torch.save(state, f))
    print(f"{PROG}: {len(state)} tensors of {ns.name!r} from {path} -> {ns.out}", file=sys.stderr)
    return 0
