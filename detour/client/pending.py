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
from detour.model import MAX_REPORT_AGE_MS, REPORT_ID_WINDOW_MS

#: ``PendingReports``' encoder: (seq, broker, latency_ms, isolation, pending) -> batch head.
Encode = Callable[[int, str, float, bool, bool], str]

#: The oldest report Detour takes (``ageMs`` limit), ms.
MAX_AGE_MS = MAX_REPORT_AGE_MS
#: The safety margin under Detour's id memory (``REPORT_ID_WINDOW_MS``, detour/model.py,
#: the number the stores use) (ms): a batch in flight, a replica that saw the id late, and
#: more than twice the stores' own ``REPORT_ID_MARGIN_MS``, inside which a report dated so
#: old is answered expired anyway.
REPLAY_MARGIN_MS = 60 * 1000
#: The oldest report id this client sends again (ms since it was made). Past Detour's id
#: memory a replay of a batch Detour applied (its reply lost) would be applied twice: such
#: reports are dropped and counted as ``expired`` instead.
REPLAY_WINDOW_MS = REPORT_ID_WINDOW_MS - REPLAY_MARGIN_MS


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
    #: when its report id was made (monotonic ms): a replay must come within Detour's id
    #: memory of it (``REPLAY_WINDOW_MS``), whatever the report's age
    made_ms: float = 0.0

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
        self._seq = itertools.count(1)
        self._start()

    def _start(self) -> None:
        """Empty, with fresh counters (and a new lock: ``after_fork``)."""
        self._lock = threading.Lock()
        self._items: deque[Pending] = deque()
        self._inflight: list[Pending] = []
        #: reports dropped: queue full (oldest first), or refused by Detour (its own 4xx),
        #: or not sent at close.
        self.dropped = 0
        #: reports not sent again because their id is older than Detour remembers ids
        #: (``REPLAY_WINDOW_MS``), or that Detour declined as ``expired``.
        self.expired = 0
        #: reports Detour accepted.
        self.sent = 0
        #: isolations and in-flight signals waiting (``urgent``), counted as they come and go
        #: so that no call scans the queue
        self._urgent = 0

    def after_fork(self) -> None:
        """In a forked child: nothing queued, fresh counters. The parent owns, sends and
        counts what it had queued; the child sending it too would apply it twice (or, with
        the parent's ids, be refused)."""
        self._start()

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
        return Pending(seq, broker_name, latency_ms, isolation, at_ms, pending, head, mono_ms())

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
        So are reports whose id is older than ``REPLAY_WINDOW_MS`` (counted as
        ``expired``): Detour may have applied them already and no longer know it.
        """
        now = mono_ms() if now_ms is None else now_ms
        with self._lock:
            batch: list[Pending] = []
            while self._items and len(batch) < n:
                p = self._popleft()
                if now - p.made_ms > REPLAY_WINDOW_MS:
                    self.expired += 1
                elif now - p.at_ms > MAX_AGE_MS:
                    self.dropped += 1
                else:
                    batch.append(p)
            self._inflight.extend(batch)
            return batch

    def done(self, batch: list[Pending], accepted: bool, expired: int = 0) -> None:
        """Detour accepted the batch, ``expired`` of its reports declined as expired (or
        refused it for good: counted as dropped)."""
        with self._lock:
            self._forget(batch)
            if accepted:
                self.sent += len(batch) - expired
                self.expired += expired
            else:
                self.dropped += len(batch)

    def answered(self, sent: int = 0, expired: int = 0, refused: int = 0) -> None:
        """Reports sent straight (not through the queue) were answered: ``sent`` accepted,
        ``expired`` declined as expired, ``refused`` refused by Detour's own 4xx (counted
        as dropped). Counted, never only logged."""
        with self._lock:
            self.sent += sent
            self.expired += expired
            self.dropped += refused

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
