"""Every call to Detour passes here: whether to make it, how long it may take, how it ended.

The sync and async clients make their calls differently but decide them the
same way, once, here:

* Whether: the circuit breaker (``detour.client.circuit``) says.
* How long: the call timeout (at least ``BACKGROUND_TIMEOUT_S`` for the report
  batches the flusher sends: they hold no send, and a batch cut while Detour
  applies it is sent again), cut to what is left of the send's deadline when
  the call is made for a send, so Detour never holds a send past its deadline.
  With less than a tenth of the timeout (or of the deadline, if shorter) left,
  Detour is not called at all (the select is decided locally, the report
  queued): so short a budget would fail a healthy Detour and open the circuit
  for nothing.
* How it ended: tallied for ``stats()``. A rejection (401/403/3xx) and an answer
  that is not Detour's will not heal by themselves, so they are also logged,
  loudly but at most once a minute each, with the number held back in between.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from detour.client.circuit import CircuitBreaker, Ticket
from detour.client.errors import (
    DetourBadAnswer,
    DetourRejected,
    DetourRequestError,
    DetourUnavailable,
)

log = logging.getLogger("detour.client")

#: A call is not started with less than this share of the timeout left in its send.
MIN_BUDGET_SHARE = 0.1
#: The least a background report batch may take (s): a busy Detour applying 1,000 reports
#: can take longer than a select's timeout, and cutting it only makes it come again.
BACKGROUND_TIMEOUT_S = 2.0
#: The same loud message is logged at most this often (s).
LOUD_EVERY_S = 60.0


class Loud:
    """A log line at ``level`` at most every ``every_s`` seconds, counting the ones held back.

    A producer sending thousands of messages a second through a rejected token must
    not write thousands of lines a second, nor hide the problem.
    """

    def __init__(
        self, level: int, every_s: float = LOUD_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.level = level
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: float | None = None
        self._held = 0

    def __call__(self, message: str) -> None:
        with self._lock:
            now = self._clock()
            if self._next is not None and now < self._next:
                self._held += 1
                return
            held, self._held = self._held, 0
            self._next = now + self.every_s
        suffix = f" ({held} more like it in the last {self.every_s:.0f} s)" if held else ""
        log.log(self.level, "detour client fails open: %s%s", message, suffix)


class Calls:
    """The gate and the tally of the calls to Detour; thread-safe.

    ``timeout`` and ``min_budget`` are seconds.
    """

    def __init__(self, timeout: float, min_budget: float, circuit: CircuitBreaker) -> None:
        self.timeout = timeout
        self.min_budget = min_budget
        self.circuit = circuit
        #: called with no arguments (in the caller's thread) when Detour answers a call with a
        #: 2xx: a cached client's event stream waiting to reconnect tries at once (Detour is
        #: back), so its copy is current again without waiting out its backoff
        self.on_answer: Callable[[], None] | None = None
        self._loud_rejected = Loud(logging.ERROR)
        self._loud_bad = Loud(logging.WARNING)
        self._loud_stream = Loud(logging.WARNING)
        self._start()

    def _start(self) -> None:
        self._lock = threading.Lock()
        #: calls that failed open, for any reason (rejections and bad answers included).
        self.failures = 0
        #: calls answered 401, 403 or a 3xx, and the last such status.
        self.rejected = 0
        self.last_rejected_status: int | None = None
        #: answers that were not Detour's (wrong shape, not JSON, too large, a proxy's page).
        self.bad_answers = 0
        #: event-stream connections dropped for a line or event over the size bound.
        self.stream_too_large = 0

    def after_fork(self) -> None:
        """In a forked child: fresh counters (``ClientCore.after_fork``)."""
        self._start()

    def begin(self, ends: float | None = None, background: bool = False) -> tuple[Ticket, float]:
        """May a call start now, and with what budget (s)? ``ends``: the send's (or the
        flush's) deadline, monotonic s, None if none; ``background``: a report batch no
        send waits for.

        Raises DetourUnavailable without counting anything when the circuit is open or
        the deadline leaves less than ``min_budget``.
        """
        budget = max(self.timeout, BACKGROUND_TIMEOUT_S) if background else self.timeout
        if ends is not None:
            # Before the circuit: a call not made must not take the half-open probe.
            left = ends - time.monotonic()
            if left < self.min_budget:
                raise DetourUnavailable(
                    f"not calling Detour: {max(0.0, left) * 1000:.0f} ms left in the send"
                )
            budget = min(budget, left)
        ticket = self.circuit.begin()
        if ticket is Ticket.DENIED:
            raise DetourUnavailable(
                f"not calling Detour for {self.circuit.remaining_s():.2f} s after a failure"
            )
        return ticket, budget

    def end(self, ticket: Ticket, error: BaseException | None) -> bool:
        """Record how a call ended (``error`` None for a 2xx); True when Detour answered.

        A 4xx is an answer (the request was wrong, Detour is fine). A cancellation
        is not, and counts against Detour in the circuit, though not in the tally.
        """
        if isinstance(error, DetourUnavailable):
            with self._lock:
                self.failures += 1
            self.note(error)
            answered = False
        else:
            answered = error is None or isinstance(error, DetourRequestError)
        self.circuit.end(ticket, answered)
        if error is None and self.on_answer is not None:
            self.on_answer()
        return answered

    def note(self, error: DetourUnavailable) -> None:
        """Tally and log what a failed call (or stream connection) says about Detour."""
        if isinstance(error, DetourRejected):
            with self._lock:
                self.rejected += 1
                self.last_rejected_status = error.status
            self._loud_rejected(str(error))
        elif isinstance(error, DetourBadAnswer):
            with self._lock:
                self.bad_answers += 1
            self._loud_bad(str(error))

    def refused(self, error: DetourBadAnswer) -> None:
        """An answer the client refused after the call (a queue not in the route): a call
        that failed open, though Detour did answer (the circuit is not touched)."""
        with self._lock:
            self.failures += 1
        self.note(error)

    def stream_dropped_too_large(self, reason: str) -> None:
        with self._lock:
            self.stream_too_large += 1
        self._loud_stream(f"event stream dropped and reconnected: {reason}")
