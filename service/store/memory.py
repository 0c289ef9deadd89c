"""The embedded store: the table lives in this process only (no Redis, nothing shared)."""

from __future__ import annotations

import time

from service import strategy
from service.model import Config, FaultItem, Route
from service.store.base import ReportOutcome
from service.view import TableView


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class MemoryStore:
    kind = "memory"

    def __init__(self) -> None:
        self.view = TableView(_wall_ms)
        self._version = 0

    def _next_version(self) -> int:
        self._version += 1
        self.view.version = self._version
        return self._version

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    async def report(self, broker: str, latency_ms: int, isolation: bool) -> ReportOutcome:
        view = self.view
        config = view.config
        now = view.now_ms()
        old = view.faults.get(broker)
        if not config.send_latency_fault_enable:
            # RocketMQ's updateFaultItem does nothing when avoidance is off.
            return ReportOutcome(broker, latency_ms, 0, old.available_at if old else now, now)
        duration = strategy.report_duration(config, latency_ms, isolation)
        item = strategy.apply_report(
            old, broker, latency_ms, duration, now, config.last_report_wins
        )
        view.apply_fault(broker, item, self._next_version())
        return ReportOutcome(broker, latency_ms, duration, item.available_at, now)

    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        return self.view.now_ms(), list(self.view.faults.values())

    async def delete_fault(self, broker: str) -> bool:
        if broker not in self.view.faults:
            return False
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
