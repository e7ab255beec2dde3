"""ddpkit's version, in the bottom layer so that the launcher (which compares it across nodes) and the CLI
read it without importing the package's facade.

    >>> __version__.count(".") >= 1
    True
"""

__version__ = "0.1.0"
