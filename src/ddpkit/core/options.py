"""The string options of the API as ``Literal`` types, checked in one place with one error style.

Each public function that takes one of these calls :func:`check` first, so a typo fails at once, naming the
value received and the values accepted (mypy users also get them from the annotations).

Example::

    >>> check("uneven", "drop", Uneven)
    'drop'
    >>> check("uneven", "dorp", Uneven)
    Traceback (most recent call last):
    ...
    ValueError: uneven='dorp' is not one of pad, drop, join; pass one of them
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_args

Uneven = Literal["pad", "drop", "join"]
Op = Literal["sum", "mean", "max", "min"]
Precision = Literal["fp32", "bf16", "fp16"]
Compression = Literal["fp16", "bf16", "powersgd"]
Device = Literal["auto", "cpu", "cuda"]

T = TypeVar("T")


def choices(kind: Any) -> tuple[str, ...]:
    """The values a ``Literal`` type accepts, in their documented order."""
    return tuple(get_args(kind))


def check(name: str, value: T, kind: Any, *, none: str | None = None) -> T:
    """``value`` when ``kind`` accepts it (or it is None and ``none`` names what None means), else ValueError."""
    if value is None and none is not None:
        return value
    allowed = choices(kind)
    if value not in allowed:
        shown = ", ".join(([none] if none else []) + list(allowed))
        raise ValueError(f"{name}={value!r} is not one of {shown}; pass one of them")
    return value
