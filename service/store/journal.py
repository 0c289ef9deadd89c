"""Reports accepted while Redis did not answer, kept in order until they can be replayed."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from detour.model import MAX_REPORT_AGE_MS
from service import metrics
from service.errors import TableFull
from service.store.base import ReportIn

#: Journaled reports sent per script call on replay (the batch endpoint's cap).
REPLAY_BATCH = 1000

Send = Callable[[Sequence[ReportIn]], Awaitable[Any]]


class Journal:
    """A bounded FIFO of reports, each dated when it was accepted (``ReportIn.at_ms``, on
    the table's clock): the replay opens the window from that date, the one the replica
    answered, however long Redis was away.

    When full, the oldest report is dropped: the newest say most about brokers
    now, and an old failure's window has often ended anyway. Drops are counted
    in ``detour_journal_dropped_total{reason="full"}``; reports older than the
    longest window a config may set (a day) are dropped on replay with
    ``reason="expired"``: no window they could open is still open.
    """

    def __init__(self, max_reports: int) -> None:
        self._max = max_reports
        self._items: deque[ReportIn] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def append(self, report: ReportIn) -> None:
        """Keep ``report``, dated (``ReportIn.dated``) when the replica accepted it."""
        if report.at_ms is None:
            raise ValueError("a journaled report carries the date it was accepted at")
        if len(self._items) >= self._max:
            self._items.popleft()
            metrics.JOURNAL_DROPPED.labels("full").inc()
        self._items.append(report)
        metrics.JOURNAL_SIZE.set(len(self._items))

    def take(self, n: int, now_ms: int) -> list[ReportIn]:
        """The oldest ``n`` reports; those older than any window at ``now_ms`` removed."""
        while self._items and now_ms - self._items[0].at(now_ms) > MAX_REPORT_AGE_MS:
            self._items.popleft()
            metrics.JOURNAL_DROPPED.labels("expired").inc()
        return list(itertools.islice(self._items, n))

    def drop(self, n: int) -> None:
        """Forget the oldest ``n`` reports once Redis has them."""
        for _ in range(min(n, len(self._items))):
            self._items.popleft()
        metrics.JOURNAL_SIZE.set(len(self._items))


async def replay(journal: Journal, send: Send, now_ms: Callable[[], int]) -> None:
    """Hand journaled reports to the store in order, each dated from when it was accepted
    (``now_ms``: the table's clock, as the reports' dates).

    Each report keeps the sequence number it was given when first tried, so one that did
    reach Redis before its reply was lost is skipped there, not applied twice.
    """
    while journal:
        batch = journal.take(REPLAY_BATCH, now_ms())
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
