"""The embedded store: the table lives in this process only (no Redis, nothing shared)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from detour import policy
from detour.apply import scan_ended
from detour.model import Config, FaultItem, Route
from detour.view import TableView
from service import metrics
from service.store.base import (
    Event,
    LogEntry,
    ReportIn,
    ReportOutcome,
)
from service.store.ids import ReportIds
from service.store.local import apply_locally, outcome


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _log_key(entry_id: str) -> tuple[int, int]:
    """Log ids are ``ms-seq`` as in a Redis stream; order them numerically."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class MemoryStore:
    kind = "memory"

    def __init__(
        self,
        latency_log_max: int = 100_000,
        namespace: str = "default",
        max_brokers: int = 10_000,
        events_max: int = 10_000,
        config: Config | None = None,
    ) -> None:
        self.namespace = namespace
        self.max_brokers = max_brokers
        self.view = TableView(_wall_ms, namespace, config)
        self._version = 0
        self._log: deque[LogEntry] = deque(maxlen=latency_log_max)
        self._log_seq = 0
        self._events: deque[Event] = deque(maxlen=events_max)
        self._event_seq = 0
        #: No item of a full table can have ended before this (ms): skip the scan until then.
        self._prune_at = 0
        #: the producers' report ids, per scope, with the answer each got first
        self._ids = ReportIds()

    def _next_version(self) -> int:
        self._version += 1
        self.view.version = self._version
        return self._version

    @property
    def degraded(self) -> bool:
        return False

    @property
    def journal_size(self) -> int:
        return 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def report_many(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        return self.report_now(reports)

    def report_now(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        # Nothing here waits: the table is this process's.
        now = self.view.now_ms()
        config = self.view.config
        done = self._ids.sort(reports, now, self.view.window_end)
        if done.duplicates:
            metrics.DUPLICATE_REPORTS.inc(done.duplicates)
        if done.expired:
            metrics.EXPIRED_REPORTS.inc(done.expired)
        applied = apply_locally(
            self.view,
            [r for _, r in done.fresh],
            now,
            self.max_brokers,
            self._evict,
            self._write,
            self.namespace,
            self._ended,
        )
        if applied.evicted:
            metrics.EVICTED.labels(self.namespace).inc(len(applied.evicted))
        answers = []
        for (_, r), e in zip(done.fresh, applied.effects, strict=True):
            answer = outcome(r, e, now, config)
            answers.append(answer)
            if not r.pending:
                # (a send still outstanding has no latency yet for the log)
                self._log_report(r, now)
                self.view.observe_latency(r.broker_name, r.latency_ms, now)
            if e.event is not None:
                self._event(
                    *e.event,
                    r.broker_name,
                    answer.tier_ms,
                    answer.reporters,
                    answer.available_at,
                    r.at(now),
                    now,
                )
        return self._ids.settle(done, answers, now)

    def _ended(self, now: int, n: int) -> list[str]:
        """Up to ``n`` brokers whose window ended, oldest first (the cap's eviction). A table
        found full of open windows is not scanned again before the earliest of them ends,
        unless an item is written meanwhile (``_write``)."""
        if now < self._prune_at:
            return []
        found = scan_ended(self.view.faults)(now, n)
        if not found:
            self._prune_at = min((i.available_at for i in self.view.faults.values()), default=0)
        return found

    def _evict(self, broker: str) -> None:
        self.view.apply_fault(broker, None, self._next_version())

    def _write(self, item: FaultItem) -> None:
        self._prune_at = 0
        self.view.apply_fault(item.broker_name, item, self._next_version())

    def _event(
        self,
        kind: str,
        reason: str,
        broker: str,
        tier_ms: int | None,
        reporters: int,
        available_at: int,
        at: int,
        now: int,
    ) -> None:
        if self._events.maxlen == 0:
            return
        self._event_seq += 1
        self._events.append(
            Event(
                f"{now}-{self._event_seq}",
                kind,
                reason,
                broker,
                tier_ms,
                reporters,
                available_at,
                at,
            )
        )

    async def events(self, since: str | None, limit: int, latest: bool = False) -> list[Event]:
        entries = list(self._events)
        if latest:
            return entries[-limit:]
        if since is not None:
            key = _log_key(since)
            entries = [e for e in entries if _log_key(e.id) > key]
        return entries[:limit]

    def _log_report(self, r: ReportIn, now: int) -> None:
        if self._log.maxlen == 0:
            return
        self._log_seq += 1
        at = r.at(now)
        self._log.append(
            LogEntry(
                f"{now}-{self._log_seq}", r.broker_name, r.latency_ms, r.isolation, r.producer, at
            )
        )

    async def latency_log(self, after: str | None, limit: int) -> list[LogEntry]:
        entries = list(self._log)
        if after is not None:
            key = _log_key(after)
            entries = [e for e in entries if _log_key(e.id) > key]
        return entries[:limit]

    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        return self.view.now_ms(), list(self.view.faults.values())

    async def detector_lease(self, ttl_ms: int) -> bool:
        return True  # one process: nobody to share the detector with

    async def set_reachability(self, readings: Mapping[str, bool]) -> None:
        now, config = self.view.now_ms(), self.view.config
        for broker, reachable in readings.items():
            item = self.view.faults.get(broker)
            if item is not None and item.reachable is not reachable:
                self._write(policy.reach(item, reachable, now, config))

    async def delete_fault(self, broker: str) -> bool:
        item = self.view.faults.get(broker)
        if item is None:
            return False
        now = self.view.now_ms()
        if item.available_at > now:
            self._event("ended", "operator", broker, None, 0, now, now, now)
            metrics.EVENTS.labels(self.namespace, "ended", "operator").inc()
        self.view.apply_fault(broker, None, self._next_version())
        return True

    async def put_route(self, route: Route) -> None:
        self.view.apply_route(route.topic, route, self._next_version())

    async def delete_route(self, topic: str) -> bool:
        if topic not in self.view.routes:
            return False
        self.view.apply_route(topic, None, self._next_version())
        return True

    async def put_config(self, config: Config) -> None:
        self.view.apply_config(config, self._next_version())

    async def patch_config(self, update: Callable[[Config], Config]) -> Config:
        # one process, no await between the read and the write: nothing comes in between
        config = update(self.view.config)
        self.view.apply_config(config, self._next_version())
        return config
