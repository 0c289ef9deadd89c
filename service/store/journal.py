"""Reports accepted while Redis did not answer, kept in order until they can be replayed."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from detour.model import MAX_REPORT_AGE_MS
from service import metrics
from service.errors import TableFull
from service.store.base import ReportIn

#: Journaled reports sent per script call on replay (the batch endpoint's cap).
REPLAY_BATCH = 1000

Send = Callable[[Sequence[ReportIn]], Awaitable[Any]]


class Journal:
    """A bounded FIFO of reports with the local monotonic time each was accepted.

    When full, the oldest report is dropped: the newest say most about brokers
    now, and an old failure's window has often ended anyway. Drops are counted
    in ``detour_journal_dropped_total{reason="full"}``; reports older than the
    longest window a config may set (a day) are dropped on replay with
    ``reason="expired"``: no window they could open is still open.
    """

    def __init__(self, max_reports: int) -> None:
        self._max = max_reports
        self._items: deque[tuple[ReportIn, float]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def append(self, report: ReportIn, accepted_mono_ms: float) -> None:
        if len(self._items) >= self._max:
            self._items.popleft()
            metrics.JOURNAL_DROPPED.labels("full").inc()
        self._items.append((report, accepted_mono_ms))
        metrics.JOURNAL_SIZE.set(len(self._items))

    def take(self, n: int, now_mono_ms: float) -> list[ReportIn]:
        """The oldest ``n`` reports with ``age_ms`` brought up to now; expired ones removed."""
        while self._items:
            report, accepted = self._items[0]
            if report.age_ms + (now_mono_ms - accepted) <= MAX_REPORT_AGE_MS:
                break
            self._items.popleft()
            metrics.JOURNAL_DROPPED.labels("expired").inc()
        out = []
        for report, accepted in list(self._items)[:n]:
            out.append(replace(report, age_ms=report.age_ms + int(now_mono_ms - accepted)))
        return out

    def drop(self, n: int) -> None:
        """Forget the oldest ``n`` reports once Redis has them."""
        for _ in range(min(n, len(self._items))):
            self._items.popleft()
        metrics.JOURNAL_SIZE.set(len(self._items))


async def replay(journal: Journal, send: Send, now_mono_ms: Callable[[], float]) -> None:
    """Hand journaled reports to the store in order, each dated from when it was accepted.

    Each report keeps the sequence number it was given when first tried, so one that did
    reach Redis before its reply was lost is skipped there, not applied twice.
    """
    while journal:
        batch = journal.take(REPLAY_BATCH, now_mono_ms())
        if batch:
            try:
                await send(batch)
            except TableFull:
                # The table filled while Redis was away: keep what still fits.
                await _replay_one_by_one(batch, send)
        journal.drop(len(batch))
        metrics.JOURNAL_REPLAYED.inc(len(batch))


async def _replay_one_by_one(batch: Sequence[ReportIn], send: Send) -> None:
    for report in batch:
        try:
            await send([report])
        except TableFull:
            metrics.JOURNAL_DROPPED.labels("table_full").inc()
