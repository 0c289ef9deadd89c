"""The circuit breaker in front of Detour: after a failure, stop calling it for a while.

It is one in the usual sense (closed, open, half-open): a dead sidecar must not
add a timeout to every send. Closed, every call goes through. A call that fails
opens the circuit for ``initial_s`` (0.5 s), doubling on each further failure up
to ``max_s`` (5 s); while open, every call goes local at once. When the pause is
over the circuit is half-open: exactly one caller probes Detour (the others keep
going local until it answers), and any answer, even a 4xx, closes it again.

The threshold is one failure: a sidecar that timed out once is likely to time
out again, and a local decision costs nothing but the shared table's freshness.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum


class Ticket(Enum):
    """What ``CircuitBreaker.begin`` allows: no call, a normal call, or the one probe."""

    DENIED = 0
    CALL = 1
    PROBE = 2


class CircuitBreaker:
    """Thread-safe; ``clock`` is monotonic seconds (a parameter so tests need not sleep)."""

    def __init__(
        self,
        initial_s: float = 0.5,
        max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError("the circuit needs 0 < initial_s <= max_s")
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._delay_s = initial_s
        self._until = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        """True while Detour is considered down (a failure and no answer since)."""
        return self._failures > 0

    def begin(self) -> Ticket:
        """Ask to call Detour now; pass the ticket to ``end`` with the outcome."""
        if self._failures == 0:
            return Ticket.CALL
        with self._lock:
            if self._failures == 0:
                return Ticket.CALL
            if self._probing or self._clock() < self._until:
                return Ticket.DENIED
            self._probing = True
            return Ticket.PROBE

    def end(self, ticket: Ticket, answered: bool) -> None:
        """Record a call's outcome: ``answered`` is True for any HTTP answer below 500."""
        if ticket is Ticket.DENIED:
            return
        with self._lock:
            if ticket is Ticket.PROBE:
                self._probing = False
            if answered:
                self._failures, self._delay_s = 0, self.initial_s
                return
            now = self._clock()
            if self._failures and now < self._until and ticket is Ticket.CALL:
                # A call that started before the circuit opened: already counted.
                return
            self._failures += 1
            self._until = now + self._delay_s
            self._delay_s = min(self._delay_s * 2, self.max_s)

    def remaining_s(self) -> float:
        """Seconds until a probe is allowed (0 when the circuit is closed or the pause is over)."""
        if self._failures == 0:
            return 0.0
        return max(0.0, self._until - self._clock())
