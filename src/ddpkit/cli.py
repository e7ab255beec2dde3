"""The ``ddpkit`` command: one subcommand per module, dispatched without importing the others, and the
conventions every subcommand shares: argparse whose errors are one line (``ddpkit CMD: error: ...``, exit 2),
the exit codes below, and :func:`run_logged` for running the user's script.

Example::

    ddpkit launch --nproc-per-node 2 train.py
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from collections.abc import Sequence

# Exit codes shared by every command (docs/when-things-go-wrong.md lists them).
OK = 0
SCRIPT_FAILED = 1  # your script (a worker) failed: launch, verify, bench; doctor: a check failed; check: findings
USAGE_ERROR = 2  # bad input: one line `ddpkit CMD: error: ...`, nothing started
HANG = 3  # launch: a collective timed out (hang report)
NOT_EQUIVALENT = 4  # verify: both runs finished, the weights differ



class UsageError(ValueError):
    """Bad input to a command; the message is one line naming what was received and what to do."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (one line, exit 2) instead of printing the whole usage."""

    def error(self, message: str):
        raise UsageError(message)


def usage_error(prog: str, exc: Exception | str) -> int:
    """Print ``PROG: error: MESSAGE`` (one line) and return :data:`USAGE_ERROR`."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return USAGE_ERROR


class ScriptFailed(RuntimeError):
    """The user's script exited non-zero under verify or bench (exit :data:`SCRIPT_FAILED`)."""


def run_logged(cmd: list[str], env: dict[str, str], log: str) -> None:
    """Run ``cmd`` with ``env`` added, output to ``log``; a non-zero exit raises :class:`ScriptFailed` with the
    end of the output."""
    with open(log, "w") as out:
        code = subprocess.call(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        raise ScriptFailed(f"`{' '.join(cmd)}` exited {code}; its output ends with:\n{tail}")


# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "launch": ("ddpkit.launch", "run a script as N data-parallel processes (torchrun underneath)"),
    "verify": ("ddpkit.verify", "check that N-process training equals 1 process on the global batch"),
    "check": ("ddpkit.check", "find common DP/DDP mistakes in a training script (static analysis)"),
    "bench": ("ddpkit.bench", "throughput at 1..N processes, communication share, a measured recommendation"),
    "consolidate": ("ddpkit.shards", "one plain state dict of a model from a (sharded) checkpoint"),
    "doctor": ("ddpkit.doctor", "what this machine can do: versions, GPUs, backends, an all-reduce test"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:11} {text}" for name, (_, text) in COMMANDS.items()]
        print("usage: ddpkit COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"ddpkit: error: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)}",
                  file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
