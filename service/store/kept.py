"""The reports a Redis replica keeps local, from the answer to the flush.

Why its own module: keeping a report is a decision on the replica's copy (policy.quiet),
an answer made from that copy, an id remembered, and a summary waiting to be written;
none of it talks to Redis. RedisStore decides when to keep and sends the summaries
(``summary_args`` is their part of report.lua's call); this holds everything between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from detour import policy, strategy
from detour.view import TableView
from service import metrics
from service.store.aggregate import Aggregate, Summary
from service.store.base import ReportIn, ReportOutcome
from service.store.ids import ReportIds, expired_answer

#: Summaries per report.lua call of a flush.
FLUSH_CHUNK = 1000


class Kept:
    """Kept reports: summed per broker and producer (``Aggregate``), the ids they carried
    (this replica's to remember: ``ReportIds``), and the summaries numbered but not yet
    acknowledged by Redis, at most ``most`` of them (the oldest dropped, counted)."""

    def __init__(self, max_brokers: int, most: int) -> None:
        self._quiet = Aggregate(max_brokers)
        #: The ids this replica answered itself, kept, journaled or sent: a retry that comes
        #: back to it is answered as the first time, whether or not Redis answers then.
        self.ids = ReportIds()
        self._most = most
        self.unflushed: list[Summary] = []

    def has_room(self, broker: str, producer: str) -> bool:
        return self._quiet.has_room(broker, producer)

    def written(self, broker: str, at_ms: int) -> None:
        """A report of ``broker`` went to Redis: what was summed before it is older."""
        self._quiet.written(broker, at_ms)

    def keep(
        self, view: TableView, reports: Sequence[ReportIn], now: int
    ) -> dict[int, ReportOutcome]:
        """The reports that change nothing another replica must see (policy.quiet, decided
        on ``view``), summed for the next flush and answered from the copy, by index.

        A repeated id is answered as the first time; an id reused with other content is
        refused before anything of the call is kept (raises ReportIdReused)."""
        config = view.config
        quiet = [
            (i, r)
            for i, r in enumerate(reports)
            if policy.quiet(
                view.faults.get(r.broker_name),
                r.latency_ms,
                r.isolation,
                r.at(now),
                config,
                r.pending,
            )
        ]
        self.ids.check([r for _, r in quiet], now)
        kept: dict[int, ReportOutcome] = {}
        for i, r in quiet:
            first = self.ids.first(r, now)
            if first is not None:
                metrics.DUPLICATE_REPORTS.inc()
                kept[i] = first
                continue
            if self.ids.expired(r, now):
                metrics.EXPIRED_REPORTS.inc()
                kept[i] = expired_answer(r, now, view.window_end(r.broker_name))
                continue
            at = r.at(now)
            if not self._quiet.add(r.broker_name, r.producer, r.latency_ms, at):
                continue
            metrics.REPORTS_LOCAL.inc()
            view.observe_latency(r.broker_name, r.latency_ms, now)
            old = view.faults.get(r.broker_name)
            end = max(old.available_at, at) if old is not None else at
            if config.ramp_ms:
                end = policy.ramp_end(old, end, at)
            t = strategy.tier(config, r.latency_ms) if config.send_latency_fault_enable else None
            kept[i] = ReportOutcome(
                r.broker_name,
                r.latency_ms,
                0,
                end,
                now,
                False,
                None if t is None else config.latency_max[t],
            )
            self.ids.remember(r, kept[i], now)
        return kept

    def number(self, next_seq: Callable[[], int]) -> None:
        """Take what was summed since the last flush as summaries, each with the replica's
        next sequence number, once: a call that did not answer is retried with the same
        numbers, so Redis applies it once."""
        fresh = self._quiet.take()
        for summary in fresh:
            summary.seq = next_seq()
        self.unflushed += fresh
        excess = len(self.unflushed) - self._most
        if excess > 0:
            del self.unflushed[:excess]
            metrics.JOURNAL_DROPPED.labels("full").inc(excess)

    def chunks(self) -> Iterator[list[Summary]]:
        """The unflushed summaries a call at a time; each is dropped once the caller comes
        back for the next (it was acknowledged)."""
        while self.unflushed:
            yield self.unflushed[:FLUSH_CHUNK]
            del self.unflushed[:FLUSH_CHUNK]


def summary_args(batch: Sequence[Summary], now: int) -> list[Any]:
    """Report.lua's entries for ``batch``: one summary entry (``s``) per broker and producer
    (docs/semantics.md), of the report entries' stride; their ages are from ``now``, the
    call's base (ARGV[11])."""
    args: list[Any] = []
    for sm in batch:
        args += [
            sm.broker,
            "" if sm.latency_ms < 0 else sm.latency_ms,
            max(0, now - sm.since_ms),
            max(0, now - sm.at_ms),
            "s",
            sm.wire_counts(),
            0,
            0,
            "",
            sm.producer,
            sm.seq,
            "",
            "",
            "",
        ]
    return args
