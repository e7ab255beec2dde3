"""``ddpkit verify script.py [args]``: does N-process training compute what one process would?

Runs the script twice for K optimizer steps with the same seed and arguments: once as one process with
the global batch (N x the per-process batch), once as N processes, then compares the final weights.

What the script needs (ddpkit scripts usually have it already): ``ddpkit.prepare_model`` for the model and
``ddpkit.data_loader`` for the training data. The runs talk to ddpkit through documented variables:

- ``DDPKIT_MAX_STEPS=K``: training loaders stop after K batches in total (the script's loops just end);
- ``DDPKIT_BATCH_SCALE=N``: the one-process run multiplies the training batch by N;
- ``DDPKIT_VERIFY_OUT=path``: rank 0 saves the prepared model's state dict there at shutdown.

Example::

    ddpkit verify --nproc-per-node 2 --steps 5 examples/digits.py
    ddpkit verify --json examples/digits.py      # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import torch

from ddpkit.launch import LaunchError, OneLineParser

PROG = "ddpkit verify"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Compare N-process training with one process on the global batch.")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes for the distributed run (default 2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def compare(reference: dict, candidate: dict, atol: float, rtol: float) -> dict:
    """Compare two state dicts; report the first tensor out of tolerance (in state-dict order)."""
    missing = sorted(set(reference) ^ set(candidate))
    if missing:
        return {"passed": False, "first_diverging": missing[0], "max_abs_diff": None,
                "reason": f"keys differ: {missing[:5]}"}
    first, worst, worst_name = None, 0.0, None
    for name, ref in reference.items():
        other = candidate[name]
        if ref.shape != other.shape:
            return {"passed": False, "first_diverging": name, "max_abs_diff": None,
                    "reason": f"shape {tuple(ref.shape)} vs {tuple(other.shape)}"}
        diff = (ref.double() - other.double()).abs()
        peak = diff.max().item() if diff.numel() else 0.0
        if peak > worst:
            worst, worst_name = peak, name
        if first is None and bool((diff > atol + rtol * ref.double().abs()).any()):
            first = {"first_diverging": name, "first_max_abs_diff": peak}
    result = {"passed": first is None, "max_abs_diff": worst, "max_abs_diff_at": worst_name, "tensors": len(reference)}
    return {**result, **(first or {})}


def run_logged(cmd: list[str], env: dict[str, str], log: str) -> None:
    """Run ``cmd`` with ``env`` added, output to ``log``; a non-zero exit raises with the end of the output."""
    with open(log, "w") as out:
        code = subprocess.call(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` exited {code}; its output ends with:\n{tail}")


def verify(script: str, script_args: Sequence[str], nproc: int, steps: int, atol: float, rtol: float) -> dict:
    """Run both trainings in a temporary directory and compare them."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        ref, dist_out = os.path.join(tmp, "single.pt"), os.path.join(tmp, "ddp.pt")
        common = {"DDPKIT_MAX_STEPS": str(steps), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        run_logged([sys.executable, script, *script_args],
             {**common, "DDPKIT_MODE": "single", "DDPKIT_BATCH_SCALE": str(nproc), "DDPKIT_VERIFY_OUT": ref},
             os.path.join(tmp, "single.log"))
        run_logged([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", str(nproc), script, *script_args],
             {**common, "DDPKIT_VERIFY_OUT": dist_out}, os.path.join(tmp, "ddp.log"))
        for path in (ref, dist_out):
            if not os.path.exists(path):
                raise RuntimeError("the script saved no weights: build the model with ddpkit.prepare_model")
        result = compare(torch.load(ref, weights_only=True), torch.load(dist_out, weights_only=True), atol, rtol)
    return {"nproc": nproc, "steps": steps, "atol": atol, "rtol": rtol, **result}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        if ns.nproc_per_node < 2 or ns.steps < 1 or not os.path.isfile(ns.script):
            raise LaunchError(f"need --nproc-per-node >= 2, --steps >= 1 and an existing script; got "
                              f"{ns.nproc_per_node}, {ns.steps}, {ns.script!r}")
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = verify(ns.script, ns.script_args, ns.nproc_per_node, ns.steps, ns.atol, ns.rtol)
    except RuntimeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(result))
    elif result["passed"]:
        print(f"PASS: {ns.nproc_per_node} processes match 1 process after {ns.steps} steps "
              f"({result['tensors']} tensors, max abs diff {result['max_abs_diff']:.3g})")
    else:
        print(f"FAIL: {result['first_diverging']!r} differs after {ns.steps} steps "
              f"(max abs diff {result.get('first_max_abs_diff', result['max_abs_diff'])}; "
              f"{result.get('reason', f'atol {ns.atol}, rtol {ns.rtol}')})")
    return 0 if result["passed"] else 1
