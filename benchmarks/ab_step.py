"""A/B of ddpkit's step time against another checkout, interleaved in one run with hand-written DDP.

A single `bench.py --only step` run on a shared 2-core machine moves by several percent from one hour to the
next; comparing two commits run at different times mixes that drift into the answer. This runs hand-written
DDP, this checkout and the other one in turn (order rotating), and prints the medians and the paired ratio.

    git worktree add /tmp/old <commit>
    python benchmarks/ab_step.py /tmp/old/src --reps 9
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the harness next to this file)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("other_src", help="the src/ folder of the other checkout (put first on PYTHONPATH)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    out = bench.interleave(args.reps, {
        "raw": lambda: bench.torchrun("raw"),
        "this": lambda: bench.torchrun("ddpkit"),
        "other": lambda: bench.torchrun("ddpkit", env={"PYTHONPATH": args.other_src}),
    })
    med = {name: statistics.median(r["median_ms"] for r in runs) for name, runs in out.items()}
    paired = statistics.median(a["median_ms"] / b["median_ms"] for a, b in zip(out["this"], out["other"]))
    print(json.dumps({**med, "this/raw": med["this"] / med["raw"], "other/raw": med["other"] / med["raw"],
                      "paired this/other": paired}))


if __name__ == "__main__":
    main()
