"""Reports waiting to reach Detour: bounded, oldest dropped first, ages kept.

While Detour is unreachable (or, in cached mode, until the next batch leaves)
reports wait here with the monotonic time they were made, so the replay can
send ``ageMs`` and Detour computes each window from when the send really
finished. The queue is bounded: a producer must not run out of memory because
its sidecar is down; the oldest reports are the least useful, so they go first,
and every drop is counted.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from detour.clock import mono_ms
from detour.model import MAX_REPORT_AGE_MS

#: ``PendingReports``' encoder: (seq, broker, latency_ms, isolation, pending) -> batch head.
Encode = Callable[[int, str, float, bool, bool], str]

#: The oldest report Detour takes (``ageMs`` limit), ms.
MAX_AGE_MS = MAX_REPORT_AGE_MS


@dataclass(frozen=True, slots=True)
class Pending:
    """A report not yet accepted by Detour; ``at_ms`` is when the send completed (monotonic)."""

    seq: int
    broker_name: str
    latency_ms: float
    isolation: bool
    at_ms: float
    #: an in-flight signal (detour/client/inflight.py): ``latency_ms`` is how long the
    #: send had been outstanding at ``at_ms``; never applied to the local table
    pending: bool = False
    #: its batch entry but the age, encoded when it was made (``wire.batch_head``)
    head: str = ""

    def age_ms(self, now_ms: float) -> int:
        return max(0, int(now_ms - self.at_ms))


class PendingReports:
    """A thread-safe bounded FIFO of reports, plus the batch currently being sent.

    The batch in flight still counts as pending (``newest`` returns it): until Detour
    accepts it, the client keeps re-applying it to its own table.
    """

    def __init__(
        self,
        capacity: int = 10_000,
        encode: Encode | None = None,
    ) -> None:
        """``encode(seq, broker, latency_ms, isolation, pending)``: a report's batch entry
        but its age (``wire.batch_head``), made in the thread that reports."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._encode = encode
        self._lock = threading.Lock()
        self._items: deque[Pending] = deque()
        self._inflight: list[Pending] = []
        self._seq = itertools.count(1)
        #: reports dropped: queue full (oldest first), or refused by Detour (4xx).
        self.dropped = 0
        #: reports Detour accepted.
        self.sent = 0
        #: isolations and in-flight signals waiting (``urgent``), counted as they come and go
        #: so that no call scans the queue
        self._urgent = 0

    def __len__(self) -> int:
        return len(self._items) + len(self._inflight)

    def queued(self) -> int:
        """Reports waiting, not counting a batch in flight."""
        return len(self._items)

    def make(
        self,
        broker_name: str,
        latency_ms: float,
        isolation: bool,
        at_ms: float,
        pending: bool = False,
    ) -> Pending:
        seq = next(self._seq)
        head = (
            self._encode(seq, broker_name, latency_ms, isolation, pending) if self._encode else ""
        )
        return Pending(seq, broker_name, latency_ms, isolation, at_ms, pending, head)

    @property
    def urgent(self) -> bool:
        """An isolation or an in-flight signal is waiting: flush without lingering."""
        return self._urgent > 0

    def add(self, items: Iterable[Pending]) -> None:
        with self._lock:
            for p in items:
                self._items.append(p)
                self._urgent += p.isolation or p.pending
            self._trim()

    def _popleft(self) -> Pending:
        p = self._items.popleft()
        self._urgent -= p.isolation or p.pending
        return p

    def _trim(self) -> None:
        over = len(self._items) - self.capacity
        for _ in range(max(0, over)):
            self._popleft()
        self.dropped += max(0, over)

    def take(self, n: int, now_ms: float | None = None) -> list[Pending]:
        """Move up to ``n`` of the oldest reports in flight; settle them with ``done``/``retry``.

        Reports older than ``MAX_AGE_MS`` at ``now_ms`` (monotonic, default now) are
        dropped and counted instead: Detour refuses such an age, and drops such
        reports from its own journal, since no default window they opened is still open.
        """
        now = mono_ms() if now_ms is None else now_ms
        with self._lock:
            while self._items and now - self._items[0].at_ms > MAX_AGE_MS:
                self._popleft()
                self.dropped += 1
            batch = [self._popleft() for _ in range(min(n, len(self._items)))]
            self._inflight.extend(batch)
            return batch

    def done(self, batch: list[Pending], accepted: bool) -> None:
        """Detour accepted the batch (or refused it for good: counted as dropped)."""
        with self._lock:
            self._forget(batch)
            if accepted:
                self.sent += len(batch)
            else:
                self.dropped += len(batch)

    def retry(self, batch: list[Pending]) -> None:
        """Detour did not answer: put the batch back in front, oldest first."""
        with self._lock:
            self._forget(batch)
            self._items.extendleft(reversed(batch))
            self._urgent += sum(p.isolation or p.pending for p in batch)
            # Over capacity now: the oldest (the batch itself) go first.
            self._trim()

    def _forget(self, batch: list[Pending]) -> None:
        ids = {p.seq for p in batch}
        self._inflight = [p for p in self._inflight if p.seq not in ids]

    def flying(self, broker: str) -> bool:
        """A report of ``broker`` is in a batch Detour has not answered yet (asked once per
        broker a stream event re-applies reports on: a scan of the batch in flight, not an
        index to keep in step with it)."""
        with self._lock:
            return any(p.broker_name == broker for p in self._inflight)

    def abandon(self) -> int:
        """The client closed with these unsent: counted as dropped and no longer pending
        (so ``stats`` does not count them twice). Returns how many."""
        with self._lock:
            left = len(self._items) + len(self._inflight)
            self._items.clear()
            self._inflight.clear()
            self._urgent = 0
            self.dropped += left
        return left

    def newest(self, n: int) -> list[Pending]:
        """Up to ``n`` of the reports Detour has not accepted, newest first (the queue's
        newest end, then the batch in flight): what a stream event re-applies is looked for
        here, so its cost does not grow with the queue."""
        with self._lock:
            out = list(itertools.islice(reversed(self._items), n))
            if len(out) < n:
                out.extend(itertools.islice(reversed(self._inflight), n - len(out)))
        return out

    def oldest_at_ms(self) -> float | None:
        with self._lock:
            return self._items[0].at_ms if self._items else None
