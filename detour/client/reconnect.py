"""Reconnect delays for the event-stream readers (the sync thread and the async task).

Full jitter (AWS's "Exponential Backoff And Jitter"): a Detour restart drops
every cached client's stream at once, and clients that reconnect in step would
all ask for a snapshot in the same millisecond.
"""

from __future__ import annotations

from collections.abc import Callable


class Jitter:
    """Reconnect delays with full jitter, so many clients do not reconnect in step."""

    def __init__(self, initial_s: float, max_s: float, rand: Callable[[], float]) -> None:
        self.initial_s, self.max_s, self._rand = initial_s, max_s, rand
        self._ceiling = initial_s

    def next_s(self) -> float:
        delay = self._rand() * self._ceiling
        self._ceiling = min(self._ceiling * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._ceiling = self.initial_s
