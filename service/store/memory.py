"""The embedded store: the table lives in this process only (no Redis, nothing shared)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

from detour import policy, strategy
from detour.model import Config, FaultItem, Route
from detour.view import TableView
from service import metrics
from service.errors import TableFull
from service.store.base import (
    REPORT_ID_CAP,
    REPORT_ID_WINDOW_MS,
    Event,
    LogEntry,
    ReportIn,
    ReportOutcome,
)
from service.store.local import report_locally


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
    ) -> None:
        self.namespace = namespace
        self.max_brokers = max_brokers
        self.view = TableView(_wall_ms, namespace)
        self._version = 0
        self._log: deque[LogEntry] = deque(maxlen=latency_log_max)
        self._log_seq = 0
        self._events: deque[Event] = deque(maxlen=events_max)
        self._event_seq = 0
        #: No item of a full table can have ended before this (ms): skip the scan until then.
        self._prune_at = 0
        #: report id -> when first applied (ms): the bounded anti-replay window
        self._report_ids: OrderedDict[str, int] = OrderedDict()

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
        if self.view.config.send_latency_fault_enable:
            self._make_room({r.broker_name for r in reports}, now)
        out = []
        self._forget_report_ids(now)
        for r in reports:
            if r.report_id and r.report_id in self._report_ids:
                out.append(self._duplicate(r, now))
                continue
            if r.report_id:
                self._report_ids[r.report_id] = now
            if not r.pending:
                # (a send still outstanding has no latency yet for the log)
                self._log_report(r, now)
            outcome = report_locally(self.view, r, now, self._write)
            out.append(outcome)
            event = policy.window_event(
                outcome.change, r.isolation, outcome.quorum == "reached", outcome.probe, r.pending
            )
            if event is not None:
                self._event(
                    *event,
                    r.broker_name,
                    outcome.tier_ms,
                    outcome.reporters,
                    outcome.available_at,
                    now - r.age_ms,
                    now,
                )
            if not r.pending:
                self.view.observe_latency(r.broker_name, r.latency_ms, now)
        return out

    def _forget_report_ids(self, now: int) -> None:
        ids = self._report_ids
        while ids and (
            len(ids) > REPORT_ID_CAP or next(iter(ids.values())) <= now - REPORT_ID_WINDOW_MS
        ):
            ids.popitem(last=False)

    def _duplicate(self, r: ReportIn, now: int) -> ReportOutcome:
        """A report whose id was applied already: nothing changes; the window as it is."""
        metrics.DUPLICATE_REPORTS.inc()
        config = self.view.config
        item = self.view.faults.get(r.broker_name)
        tier = strategy.tier(config, r.latency_ms, r.isolation)
        return ReportOutcome(
            r.broker_name,
            r.latency_ms,
            0 if tier is None else config.not_available_duration[tier],
            now if item is None else item.available_at,
            now,
            r.isolation,
            None if tier is None else config.latency_max[tier],
            duplicate=True,
        )

    def _make_room(self, brokers: set[str], now: int) -> None:
        """The Redis script's cap rule (service/store/lua/report.lua), step for step."""
        faults = self.view.faults
        new = len(brokers - faults.keys())
        if new == 0:
            return
        if len(faults) + new > self.max_brokers:
            if now >= self._prune_at:
                ended = [b for b, item in faults.items() if item.available_at <= now]
                for broker in ended:
                    self.view.apply_fault(broker, None, self._next_version())
                metrics.EVICTED.labels(self.namespace).inc(len(ended))
                if len(faults) + len(brokers - faults.keys()) > self.max_brokers:
                    self._prune_at = min((i.available_at for i in faults.values()), default=0)
            if len(faults) + len(brokers - faults.keys()) > self.max_brokers:
                raise TableFull(self.namespace, self.max_brokers)
        self._prune_at = 0

    def _write(self, item: FaultItem) -> None:
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
        at = now - r.age_ms
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
