"""The ``ddpkit`` command: one subcommand per module, dispatched without importing the others.

Example::

    ddpkit launch --nproc-per-node 2 train.py
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# Exit codes shared by every command (docs/when-things-go-wrong.md lists them).
OK = 0
SCRIPT_FAILED = 1  # your script (a worker) failed: launch, verify, bench; doctor: a check failed; check: findings
USAGE_ERROR = 2  # bad input: one line `ddpkit CMD: error: ...`, nothing started
HANG = 3  # launch: a collective timed out (hang report)
NOT_EQUIVALENT = 4  # verify: both runs finished, the weights differ

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "launch": ("ddpkit.launch", "run a script as N data-parallel processes (torchrun underneath)"),
    "verify": ("ddpkit.verify", "check that N-process training equals 1 process on the global batch"),
    "check": ("ddpkit.check", "find common DP/DDP mistakes in a training script (static analysis)"),
    "bench": ("ddpkit.bench", "throughput at 1..N processes, communication share, a measured recommendation"),
    "doctor": ("ddpkit.doctor", "what this machine can do: versions, GPUs, backends, an all-reduce test"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:8} {text}" for name, (_, text) in COMMANDS.items()]
        print("usage: ddpkit COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"ddpkit: error: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)}",
                  file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
