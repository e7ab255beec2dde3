"""The phase report's JSON read from outside the process, bounded before anything is built from it.

Two readers take bytes that ddpkit did not necessarily write: rank 0 reads its peers' windows and totals from
the group's store (:mod:`ddpkit.runtime.phase_store`), and the launcher reads ``phases.json`` from the report
folder (:mod:`ddpkit.launcher.phase_report`). Both go through here, so that whatever the bytes hold the answer
is a dict of the report's format or :class:`~ddpkit.core.straggler.ReportError` (one line), never another
exception (a traceback at the end of a clean run) nor memory or time out of proportion to a real report:

- the size is capped before decoding: :data:`MAX_WINDOW_BYTES` for a window, :data:`MAX_REPORT_BYTES` for a file;
- the values are capped before decoding too: every JSON value but the first follows a ``,``, ``:`` or ``[``, and
  every container opens with ``[`` or ``{``, so counting those bytes bounds what ``json.loads`` would build
  (64 MB of ``[[[[...]]]]`` 900 deep, under the recursion limit, would otherwise be ~2 GB of lists);
- a number's literal is capped (an int of 4,000 digits parses in Python, then ``float()`` of it raised
  OverflowError in the checks), ``NaN`` / ``Infinity`` are refused, nesting past the recursion limit is a
  ReportError (``json`` raises RecursionError);
- then :mod:`ddpkit.core.straggler` checks every field (types, ranges, finite times) and recomputes the verdict.

Example::

    win = window(store.get(key))   # a dict of the window format, or ReportError with one line
"""

from __future__ import annotations

import json
from typing import Any

from ddpkit.core import straggler

MAX_WINDOW_BYTES = 4096  # a window is ~250 bytes with a 64-character host name
MAX_REPORT_BYTES = 64 << 20  # a report is ~300 bytes a rank: 65,536 ranks fit in 20 MB
_WINDOW_VALUES = 64  # a window holds 26 values: 7 fields, 5 phases, their keys and 2 objects
_VALUES_PER_RANK = 32  # in a report: a window (26) and the rank in 'missing' (1), and the list's commas
_MAX_DIGITS = 12  # a count is at most MAX_RANKS**2 (10 digits)
_MAX_FLOAT_CHARS = 40  # repr() of a float is at most 24 characters
_EXPECTED = "expected the phase report ddpkit writes"


def window(raw: str | bytes) -> dict[str, Any]:
    """A peer's window (from the store), checked: :class:`~ddpkit.core.straggler.ReportError` otherwise."""
    _bounded(raw, MAX_WINDOW_BYTES, _WINDOW_VALUES)
    return _checked(straggler.parse_window, raw)


def report(raw: str | bytes) -> dict[str, Any]:
    """A ``phases.json``, checked and its verdict recomputed: :class:`~ddpkit.core.straggler.ReportError`
    otherwise."""
    _bounded(raw, MAX_REPORT_BYTES, _VALUES_PER_RANK * straggler.MAX_RANKS)
    return _checked(straggler.parse_report, raw)


def _bounded(raw: str | bytes, max_bytes: int, max_values: int) -> None:
    """Refuse ``raw`` unless it is at most ``max_bytes``, ``max_values`` JSON values and JSON whose numbers are
    short literals; decoded once here, with the hooks that keep every number small."""
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > max_bytes:
        raise straggler.ReportError(f"it is {len(data)} bytes, more than {max_bytes}; {_EXPECTED}")
    values = sum(data.count(c) for c in (b",", b":", b"[", b"{"))
    if values > max_values:
        raise straggler.ReportError(f"it holds up to {values} JSON values, more than {max_values}; {_EXPECTED}")
    try:
        json.loads(data, parse_int=_small_int, parse_float=_short_float, parse_constant=_no_constant)
    except RecursionError:
        raise straggler.ReportError(f"it nests deeper than JSON allows here (RecursionError); {_EXPECTED}") from None
    except (ValueError, UnicodeDecodeError) as exc:  # ReportError is a ValueError: the hooks' own pass through
        raise straggler.ReportError(str(exc) if isinstance(exc, straggler.ReportError) else f"not JSON ({exc})") \
            from None


def _checked(parse: Any, raw: str | bytes) -> dict[str, Any]:
    # the bounds above leave no way to these errors that we know of; a value that found one is still one line
    try:
        return parse(raw)
    except (OverflowError, RecursionError, TypeError, KeyError) as exc:
        raise straggler.ReportError(f"{type(exc).__name__}: {exc}; {_EXPECTED}") from None


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise straggler.ReportError(f"it holds an integer of {len(text)} digits, expected at most {_MAX_DIGITS}")
    return int(text)


def _short_float(text: str) -> float:
    if len(text) > _MAX_FLOAT_CHARS:
        raise straggler.ReportError(f"it holds a number written in {len(text)} characters, expected at most "
                                    f"{_MAX_FLOAT_CHARS}")
    return float(text)


def _no_constant(text: str) -> Any:
    raise straggler.ReportError(f"it holds {text}, expected finite numbers")
