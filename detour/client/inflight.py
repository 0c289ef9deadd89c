"""Sends still outstanding, per broker, and when one deserves an in-flight signal.

A hung broker (SIGSTOP, a stuck disk) fails nobody until the send timeout, and by then
every producer has sent to it. A send outstanding far longer than the broker's normal
latency is evidence already: the SDK tells Detour with a pending report
(``pending: true``, ``latencyMs`` = how long it has been outstanding), and Detour avoids
the broker for everyone once ``pendingQuorum`` producers have one open
(docs/policy.md, "Hangs: pendingQuorum"). The completed send's own report withdraws it.

The threshold is ``max(floor, factor x the broker's recent p99)`` over its completed
sends: a broker's p99 is what "far longer than normal" is measured against, the floor
keeps a very fast broker's jitter (a GC pause of this process) from signalling. A broker
with fewer than ``MIN_SAMPLES`` completed sends borrows the p99 of this client's recent
sends to every broker (at 20 msg/s over 8 brokers a producer needs 3 s to know each
broker; a hang in that time should not wait for a cold guess), and ``max(floor,
COLD_MS)`` stands before the client has that many at all. A send that stays outstanding
signals again each time its outstanding time doubles (the later signal may fall in a
tier with a longer window). No I/O and no clock of its own: ``now_ms`` comes in, the
client's background thread (or task) asks ``due`` and sends what it returns.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Completed sends per broker the p99 is taken over (the most recent).
SAMPLES = 128
#: Completed sends a broker needs before its p99 is trusted.
MIN_SAMPLES = 8
#: The threshold (ms) before a broker has MIN_SAMPLES completed sends.
COLD_MS = 200.0
#: Brokers tracked at once (the least recently used go first).
MAX_BROKERS = 1024
#: Outstanding sends tracked at once: past it a new send is not tracked (never refused).
MAX_OUTSTANDING = 10_000


@dataclass(slots=True)
class _Send:
    broker: str
    start_ms: float
    due_ms: float


class InFlight:
    """Thread-safe table of outstanding sends and each broker's recent latencies.

    ``factor`` 0 turns signals off (``begin`` still returns a token, nothing is due).
    """

    def __init__(self, factor: float = 4.0, floor_ms: float = 50.0) -> None:
        if factor < 0 or floor_ms < 0:
            raise ValueError("pending_factor and pending_floor_ms must be >= 0")
        self.factor = factor
        self.floor_ms = floor_ms
        self._lock = threading.Lock()
        self._latencies: OrderedDict[str, deque[float]] = OrderedDict()
        #: the latest completed sends to any broker (a new broker's prior)
        self._everyone: deque[float] = deque(maxlen=SAMPLES)
        self._sends: dict[int, _Send] = {}
        self._tokens = itertools.count(1)
        #: signals handed out by ``due``
        self.signals = 0

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def threshold_ms(self, broker: str) -> float:
        """How long a send to ``broker`` may be outstanding before it signals."""
        with self._lock:
            return self._threshold(broker)

    def _threshold(self, broker: str) -> float:
        recent = self._latencies.get(broker)
        if recent is None or len(recent) < MIN_SAMPLES:
            recent = self._everyone
            if len(recent) < MIN_SAMPLES:
                return max(self.floor_ms, COLD_MS)
        ordered = sorted(recent)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(self.floor_ms, self.factor * p99)

    def begin(self, broker: str, now_ms: float) -> int:
        """A send to ``broker`` starts; the token ends it (0: not tracked)."""
        if not self.enabled:
            return 0
        with self._lock:
            if len(self._sends) >= MAX_OUTSTANDING:
                return 0
            token = next(self._tokens)
            self._sends[token] = _Send(broker, now_ms, now_ms + self._threshold(broker))
            return token

    @contextmanager
    def track(
        self, broker: str, clock: Callable[[], float], wake: Callable[[float], None]
    ) -> Iterator[None]:
        """One send to ``broker`` as a ``with`` block: begun at ``clock()`` (monotonic ms),
        ``wake(due ms)`` told when it will be due, ended with its latency when the block
        completes, without one when it raises (the exception goes on)."""
        start = clock()
        token = self.begin(broker, start)
        if token:
            wake(start + self.threshold_ms(broker))
        try:
            yield
        except BaseException:
            self.end(token, None)
            raise
        self.end(token, clock() - start)

    def end(self, token: int, latency_ms: float | None) -> None:
        """The send ended: ``latency_ms`` when it completed (a sample of the broker's
        latency), None when it failed (a timeout is no sample of normal latency)."""
        with self._lock:
            send = self._sends.pop(token, None)
            if send is None or latency_ms is None:
                return
            recent = self._latencies.get(send.broker)
            if recent is None:
                recent = self._latencies[send.broker] = deque(maxlen=SAMPLES)
                while len(self._latencies) > MAX_BROKERS:
                    self._latencies.popitem(last=False)
            else:
                self._latencies.move_to_end(send.broker)
            recent.append(latency_ms)
            self._everyone.append(latency_ms)

    def due(self, now_ms: float) -> list[tuple[str, float]]:
        """(broker, outstanding ms) of each send that passed its threshold (or doubled its
        outstanding time since its last signal); each is signalled once per step."""
        out: list[tuple[str, float]] = []
        with self._lock:
            for send in self._sends.values():
                if now_ms >= send.due_ms:
                    outstanding = now_ms - send.start_ms
                    out.append((send.broker, outstanding))
                    send.due_ms = send.start_ms + 2 * max(outstanding, 1.0)
        self.signals += len(out)
        return out

    def next_due_ms(self) -> float | None:
        """When the earliest outstanding send is due, None when none is outstanding."""
        with self._lock:
            return min((s.due_ms for s in self._sends.values()), default=None)

    def outstanding(self) -> int:
        with self._lock:
            return len(self._sends)
