"""The one set of exit codes every ``ddpkit`` command and the launcher return, and the errors the library
raises for bad input. The CLI turns a :class:`UsageError` into one line and :data:`USAGE_ERROR`; the
library never imports the CLI to do so.

Example::

    >>> raise UsageError("--nproc-per-node 0: expected >= 1")
    Traceback (most recent call last):
    ...
    ddpkit.core.errors.UsageError: --nproc-per-node 0: expected >= 1

docs/when-things-go-wrong.md lists the codes; tests/test_layers.py checks that no other module defines them.
"""

OK = 0
SCRIPT_FAILED = 1  # your script (a worker) failed: launch, verify, bench; doctor: a check failed; check: findings
USAGE_ERROR = 2  # bad input: one line `ddpkit CMD: error: ...`, nothing started
HANG = 3  # launch: a collective timed out (hang report)
NOT_EQUIVALENT = 4  # verify: both runs finished, the weights differ
CANNOT_COMPARE = 5  # verify: the script lacks what a comparison needs (no prepared model, no ddpkit loader)


class UsageError(ValueError):
    """Bad input to a command; the message is one line naming what was received and what to do."""


class ShutdownError(RuntimeError):
    """A shutdown hook failed after the script's last line (the last background checkpoint write): raised by an
    explicit ``ddpkit.shutdown()``; at interpreter exit the process exits :data:`SCRIPT_FAILED` instead."""


class ScriptFailed(RuntimeError):
    """The user's script exited non-zero under verify or bench (exit :data:`SCRIPT_FAILED`)."""


def first_line(value: object, limit: int = 200) -> str:
    """The first line of an error (or any value's text), at most ``limit`` characters: what a one-line message
    quotes of a longer one (a carriage return ends a line too; nothing at all is "").

    >>> first_line(OSError(28, "No space left on device")), first_line(RuntimeError("a\\r\\nb"), 1), first_line("")
    ('[Errno 28] No space left on device', 'a', '')
    """
    return (str(value).replace("\r", "\n").splitlines() or [""])[0][:limit]
