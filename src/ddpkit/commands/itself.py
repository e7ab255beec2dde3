"""How a command runs ``ddpkit`` again in a child process (verify's N-process launch, convert's verify, bench,
plan): ``python -m ddpkit`` puts the working directory first on ``sys.path``, so a project folder holding a package
named like the standard library's (LSGAN keeps its tests in ``unittest/``) broke torch's own import of
``unittest.mock`` in the launcher, where ``ddpkit launch`` and ``python script.py`` ran. The child drops that entry
before it imports anything (``python -P``'s safe path, on every Python ddpkit supports).

Example::

    >>> cmd = command("launch", "--nproc-per-node", "2", "train.py")
    >>> cmd[1], cmd[3:]
    ('-c', ['launch', '--nproc-per-node', '2', 'train.py'])
"""

from __future__ import annotations

import sys

# (``-c`` puts "" first, for the working directory; the script's own folder is the workers' first entry, as ever)
_SAFE = "import sys; sys.path.pop(0) if sys.path and sys.path[0] in ('', '.') else None; " \
    "from ddpkit.commands.cli import main; sys.exit(main())"


def command(*args: str) -> list[str]:
    """The argv that runs ``ddpkit ARGS`` with this interpreter, the working directory off ``sys.path``."""
    return [sys.executable, "-c", _SAFE, *args]
