"""The ``ddpkit`` command: one subcommand per module, dispatched without importing the others, and the
conventions every subcommand shares: argparse whose errors are one line (``ddpkit CMD: error: ...``, exit 2),
the exit codes below.

Example::

    ddpkit launch --nproc-per-node 2 train.py
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence

# The exit codes live in ddpkit.core.errors (the library returns them too); commands import them from there.
from ddpkit.core.errors import OK, USAGE_ERROR, UsageError
from ddpkit.core.version import __version__


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (one line, exit 2) instead of printing the whole usage, and
    takes options by their whole name only: with argparse's prefix matching, ``--nproc-per-nod 2`` ran as
    ``--nproc-per-node 2`` and a misspelt option of the user's script could be taken for one of ddpkit's."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        # `ddpkit launch --version` as `ddpkit --version`: stdout, exit 0
        self.add_argument("--version", action="version", version=f"ddpkit {version()}", help=argparse.SUPPRESS)

    def error(self, message: str):
        raise UsageError(message + self._did_you_mean(message))

    def _did_you_mean(self, message: str) -> str:
        """``; did you mean --nproc-per-node?`` for an unrecognised option close to one of this parser's.

        >>> p = OneLineParser(prog="x"); _ = p.add_argument("--nproc-per-node")
        >>> p._did_you_mean("unrecognized arguments: --nproc-per-nod 2")
        '; did you mean --nproc-per-node?'
        """
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for word in message.split(":", 1)[1].split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1, cutoff=0.8)
            if word.startswith("--") and close:
                return f"; did you mean {close[0]}?"
        return ""


def usage_error(prog: str, exc: Exception | str) -> int:
    """Print ``PROG: error: MESSAGE`` (one line) and return :data:`USAGE_ERROR`."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return USAGE_ERROR


# subcommand -> (module with main(argv) -> int, one-line help); a command with parts is a folder whose entry
# module is <folder>.command
COMMANDS = {
    "launch": ("ddpkit.commands.launch", "run a script as N data-parallel processes (torchrun underneath)"),
    "verify": ("ddpkit.commands.verify.command",
               "check that N-process training equals 1 process on the global batch"),
    "check": ("ddpkit.commands.check.command", "find common DP/DDP mistakes in a training script (static analysis)"),
    "bench": ("ddpkit.commands.bench.command",
              "throughput at 1..N processes, communication share, a measured recommendation"),
    "plan": ("ddpkit.commands.plan.command",
             "will it fit: per-rank peak memory of each mode and process count, before launch"),
    "consolidate": ("ddpkit.commands.consolidate", "one plain state dict of a model from a (sharded) checkpoint"),
    "convert": ("ddpkit.commands.convert.command",
                "rewrite a single-device training script into a ddpkit one, and verify it"),
    "doctor": ("ddpkit.commands.doctor", "what this machine can do: versions, GPUs, backends, an all-reduce test"),
}


def version() -> str:
    """ddpkit's version from the installed package's metadata (the source tree's when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("ddpkit")
    except PackageNotFoundError:
        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """``ddpkit COMMAND ...``; ``--help`` (asked for: stdout, exit 0) and ``--version`` (``ddpkit 0.1.0``).

    >>> main(["--version"])  # doctest: +ELLIPSIS
    ddpkit ...
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        print(f"ddpkit {version()}")
        return OK
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])  # asked for: the answer is output; otherwise a usage error
        lines = [f"  {name:11} {text}" for name, (_, text) in COMMANDS.items()]
        print("usage: ddpkit COMMAND [options]\n       ddpkit --version\n\ncommands:\n" + "\n".join(lines),
              file=sys.stdout if asked else sys.stderr)
        if argv and not asked:
            print(f"ddpkit: error: unknown command {argv[0]!r}; expected one of {', '.join(COMMANDS)}",
                  file=sys.stderr)
        return OK if asked else USAGE_ERROR
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
