"""Clocks the server and the SDK share: the local monotonic clock in ms, and readings of a
remote clock estimated from it.

Both estimate a clock they cannot read directly (the server Redis's, the SDK the
service's) as the local monotonic clock plus an offset, each sample of which is a lower
bound. The offset may drop a few ms when the best sample ages out or a new connection
starts over; a reading must not, or a report accepted next would be dated before one
accepted earlier, and an item judged available a moment ago would look avoided again.
"""

from __future__ import annotations

import time


def mono_ms() -> float:
    """The local monotonic clock in ms (the base of every age, latency and estimate)."""
    return time.monotonic_ns() / 1_000_000


class Readings:
    """Readings of ``mono_ms() + offset`` that never go back: when the offset drops, a
    reading holds still until the estimate catches up. Each reading was a lower bound of
    the remote clock when made, so it stays one. ``reset`` when the remote clock itself
    went back (a step the estimator detected) or the offset was only a guess.

    Not thread-safe: a clock read from several threads reads under a lock (the SDK's
    ``ServiceClock``); the server reads its clock on the event loop's thread only."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = 0

    def read(self, offset_ms: float) -> int:
        now = int(time.monotonic_ns() / 1_000_000 + offset_ms)
        if now < self._last:
            return self._last
        self._last = now
        return now

    def reset(self) -> None:
        self._last = 0
