"""Reconnect delays for the event-stream readers (the sync thread and the async task).

Full jitter (AWS's "Exponential Backoff And Jitter"): a Detour restart drops
every cached client's stream at once, and clients that reconnect in step would
all ask for a snapshot in the same millisecond.
"""

from __future__ import annotations

from collections.abc import Callable

#: The event stream's reconnect delays (s): full jitter from 0.1 s, the ceiling doubling up
#: to 1 s. The ceiling bounds how long a cached copy stays stale after Detour is back (the
#: stream also reconnects at once when any other call is answered, ``Calls.on_answer``);
#: a refused reconnect costs Detour one short request, so a second between tries per client
#: is cheap next to what a stale copy costs its producer.
STREAM_RECONNECT_INITIAL_S = 0.1
STREAM_RECONNECT_MAX_S = 1.0
#: The stream's connecting and headers may take this long (s): no send waits for it, and a
#: throttled Detour that answers in 0.5 s should be followed, not dropped and retried.
STREAM_CONNECT_TIMEOUT_S = 2.0


def stream_connect_s(call_timeout_s: float) -> float:
    """How long the stream's connecting and headers may take: the call timeout, or
    ``STREAM_CONNECT_TIMEOUT_S`` if that is longer."""
    return max(call_timeout_s, STREAM_CONNECT_TIMEOUT_S)


def stream_jitter(rand: Callable[[], float]) -> Jitter:
    """The event stream's reconnect delays (the sync thread's and the async task's)."""
    return Jitter(STREAM_RECONNECT_INITIAL_S, STREAM_RECONNECT_MAX_S, rand)


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
