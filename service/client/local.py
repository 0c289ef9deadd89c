"""The client's own copy of the table, decided with the service's algorithm.

A ``service.view.TableView`` plus ``service.strategy``: the same pure code the
service runs, not a copy, so a local decision is the one Detour would make with
the same table. The remote client fills it with its own reports and fetched
routes and uses it only when Detour is unavailable (RocketMQ's producer-local
table, on the process wall clock); the cached client keeps it current from the
event stream and decides every select here, on its estimate of the service's
clock.

Thread-safe: producer threads select and report while a background thread
applies stream events. Versions in the view are local sequence numbers: the
stream is ordered, so the newest thing applied always wins.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping

from service import strategy
from service.client.values import SelectedQueue
from service.model import Config, FaultItem, Route
from service.view import Snapshot, TableView


class LocalTable:
    def __init__(self, clock: Callable[[], int]) -> None:
        """``clock``: epoch ms on the clock the table's windows are written in."""
        self.view = TableView(clock)
        self._lock = threading.Lock()
        self._version = 0

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def now_ms(self) -> int:
        return self.view.now_ms()

    # -- reads -----------------------------------------------------------------
    def select(self, topic: str, last_broker: str | None) -> SelectedQueue | None:
        """Choose a queue for ``topic`` in-process, or None when its route is unknown.

        Advances the topic's round-robin counter as ``POST /select`` does.
        """
        with self._lock:
            view = self.view
            route = view.routes.get(topic)
            if route is None:
                return None
            sel = strategy.select(
                route,
                view.counter(topic),
                view.faults,
                view.now_ms(),
                last_broker,
                view.config.send_latency_fault_enable,
            )
            view.set_counter(topic, sel.next_counter)
        q = sel.queue
        return SelectedQueue(
            topic,
            q.broker_name,
            q.queue_id,
            route.addresses.get(q.broker_name),
            sel.decision,
            sel.avoided_brokers,
            True,
        )

    def has_route(self, topic: str) -> bool:
        return topic in self.view.routes

    def fault(self, broker_name: str) -> FaultItem | None:
        return self.view.faults.get(broker_name)

    # -- own reports -----------------------------------------------------------
    def apply_report(
        self, broker_name: str, latency_ms: float, isolation: bool, age_ms: int = 0
    ) -> FaultItem | None:
        """Apply one report as Detour would, at ``now - age_ms``; returns the broker's item.

        With avoidance off the report changes nothing (RocketMQ's updateFaultItem).
        """
        latency = math.floor(latency_ms)
        with self._lock:
            view = self.view
            config = view.config
            if not config.send_latency_fault_enable:
                return view.faults.get(broker_name)
            duration = strategy.report_duration(config, latency, isolation)
            item = strategy.apply_report(
                view.faults.get(broker_name),
                broker_name,
                latency,
                duration,
                view.now_ms() - age_ms,
                config.last_report_wins,
            )
            view.apply_fault(broker_name, item, self._next_version())
            return item

    # -- what the service says -------------------------------------------------
    def set_route(self, topic: str, route: Route | None) -> None:
        with self._lock:
            self.view.apply_route(topic, route, self._next_version())

    def set_config(self, config: Config) -> None:
        with self._lock:
            self.view.apply_config(config, self._next_version())

    def set_fault(self, broker_name: str, item: FaultItem | None) -> None:
        with self._lock:
            self.view.apply_fault(broker_name, item, self._next_version())

    def replace(
        self, config: Config, routes: Iterable[Route], faults: Mapping[str, FaultItem]
    ) -> None:
        """Install a whole table (a stream snapshot): newer than anything applied, so it wins."""
        with self._lock:
            v = self._next_version()
            self.view.replace(
                Snapshot(
                    version=v,
                    config=config,
                    config_version=v,
                    routes={r.topic: r for r in routes},
                    faults=dict(faults),
                )
            )
