"""A rank's timeline of stamps, resolved into seconds per phase once per window: no synchronisation per step.

On the CPU a stamp is ``time.perf_counter()``. On a CUDA device it is a CUDA event recorded on the current
stream: it completes when the device reaches that point of the work queued so far, so the span between two
stamps is the device's time (a data fetch that the GPU spends busy with the previous step shows as ~0, one it
spends idle shows whole). Events are only read when the window is resolved: one ``synchronize()`` on the last
stamp, then ``elapsed_time`` between neighbours; resolved events go back to a pool.

Example::

    >>> line = Timeline(phases=2, cuda=False)
    >>> line.close(0); line.close(1)
    >>> sums = line.resolve(); len(sums), all(s >= 0 for s in sums)
    (2, True)
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Timeline:
    """Stamps in order, each with the phase of the span it ends (``skip``: the span counts for no phase)."""

    def __init__(self, phases: int, cuda: bool):
        self.phases, self.skip, self.cuda = phases, phases, cuda
        self.free: list[Any] = []  # resolved CUDA events, recorded again later
        self.start = self.stamp()
        self.marks: list[tuple[int, Any]] = []

    def stamp(self) -> Any:
        """A point of this rank's time, now."""
        if not self.cuda:
            return time.perf_counter()
        event = self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def discard(self, stamp: Any) -> None:
        """A stamp taken and not closed (a gradient that was not the last one of its backward)."""
        if self.cuda:
            self.free.append(stamp)

    def close(self, phase: int, stamp: Any = None) -> None:
        """The span from the previous stamp to ``stamp`` (default: now) was ``phase``."""
        self.marks.append((phase, self.stamp() if stamp is None else stamp))

    def skip_from(self, index: int) -> None:
        """The spans from mark ``index`` on count for no phase (time outside any step)."""
        self.marks[index:] = [(self.skip, stamp) for _, stamp in self.marks[index:]]

    def resolve(self) -> list[float]:
        """Seconds per phase over every span closed since the last resolve; the last stamp starts the next."""
        sums = [0.0] * (self.phases + 1)
        if not self.marks:
            return sums[:-1]
        if self.cuda:
            self.marks[-1][1].synchronize()  # the only wait: once per window, for work already queued
        previous = self.start
        for phase, stamp in self.marks:
            sums[phase] += self._seconds(previous, stamp)
            if self.cuda and previous is not self.start:
                self.free.append(previous)
            previous = stamp
        if self.cuda:
            self.free.append(self.start)
        self.start, self.marks = previous, []
        return sums[:-1]

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a
