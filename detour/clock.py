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
    """Readings of ``mono_ms() + offset`` that never go back when the offset drops: they
    hold at the highest reading the old offset could have given until the new one catches
    up. Each reading was a lower bound of the remote clock when made, so it stays one.

    Only the estimator writes (``move``, ``restart``); a read writes nothing, so readers on
    any thread need no lock. ``move`` raises the floor before it lowers the offset, and
    ``read`` takes the offset before the floor: a reader that sees the lower offset also
    sees the floor that goes with it.
    """

    __slots__ = ("offset_ms", "_floor")

    def __init__(self, offset_ms: float) -> None:
        self.offset_ms = offset_ms
        self._floor = 0

    def read(self) -> int:
        now = int(time.monotonic_ns() / 1_000_000 + self.offset_ms)
        floor = self._floor
        return now if now >= floor else floor

    def move(self, offset_ms: float) -> None:
        """The estimator's new offset; a lower one holds the readings still."""
        if offset_ms < self.offset_ms:
            self._floor = max(self._floor, int(mono_ms() + self.offset_ms))
        self.offset_ms = offset_ms

    def restart(self, offset_ms: float) -> None:
        """The new offset, readings following it back: the remote clock was set back (a
        step the estimator detected), or the old offset was only a guess."""
        self.offset_ms = offset_ms
        self._floor = 0
