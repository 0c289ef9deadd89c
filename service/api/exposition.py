"""GET /metrics' text: this process's (or every worker's) counters, then the tables' state."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector

from service.metrics import MAX_BROKER_SERIES, MAX_TOPIC_SERIES
from service.view import TableView


@dataclass(frozen=True, slots=True)
class TableState:
    """One namespace's table as a scrape sees it."""

    view: TableView
    degraded: bool = False


class TableCollector(Collector):
    """Per-broker and per-route state, computed from the shared tables when scraped."""

    def __init__(self, tables: Callable[[], Sequence[TableState]]) -> None:
        self._tables = tables

    def collect(self) -> Iterable[Metric]:
        tables = self._tables()
        if not tables:
            return
        ns = ["namespace"]
        avoided = GaugeMetricFamily(
            "detour_broker_avoided",
            "1 while the broker's avoidance window is open.",
            labels=[*ns, "broker"],
        )
        until = GaugeMetricFamily(
            "detour_broker_available_in_seconds",
            "Seconds until the broker's window ends (0 when available).",
            labels=[*ns, "broker"],
        )
        latency = GaugeMetricFamily(
            "detour_broker_current_latency_seconds",
            "The latency of the report that set the broker's current window.",
            labels=[*ns, "broker"],
        )
        isolations = GaugeMetricFamily(
            "detour_broker_isolations",
            "The broker's recent isolation count: its next failure's window is the tier's "
            "times this plus one (repeatMultiplier; 0 when off).",
            labels=[*ns, "broker"],
        )
        open_total = GaugeMetricFamily(
            "detour_brokers_avoided", "Brokers whose avoidance window is open now.", labels=ns
        )
        items = GaugeMetricFamily(
            "detour_fault_items", "Fault items in the namespace's table.", labels=ns
        )
        panic = GaugeMetricFamily(
            "detour_route_all_avoided",
            "1 while every broker of the route is avoided (pickOneAtLeast decides); "
            f"first {MAX_TOPIC_SERIES} topics by name.",
            labels=[*ns, "topic"],
        )
        panic_total = GaugeMetricFamily(
            "detour_routes_all_avoided", "Routes whose every broker is avoided now.", labels=ns
        )
        degraded = GaugeMetricFamily(
            "detour_store_degraded",
            "1 while this replica answers from its own copy because Redis is unreachable "
            "(or journaled reports are not replayed yet).",
            labels=ns,
        )
        enabled = GaugeMetricFamily(
            "detour_avoidance_enabled", "1 when sendLatencyFaultEnable is on.", labels=ns
        )
        for table in tables:
            view = table.view
            name = view.namespace
            now = view.now_ms()
            brokers = set(view.faults)
            for route in view.routes.values():
                brokers.update(route.by_broker)
            left = {
                b: max(0, item.available_at - now) if (item := view.faults.get(b)) else 0
                for b in brokers
            }
            shown = sorted(brokers, key=lambda b: (left[b] == 0, b))[:MAX_BROKER_SERIES]
            for broker in sorted(shown):
                avoided.add_metric([name, broker], 1.0 if left[broker] > 0 else 0.0)
                until.add_metric([name, broker], left[broker] / 1000)
                item = view.faults.get(broker)
                if item is not None:
                    latency.add_metric([name, broker], item.current_latency_ms / 1000)
                    isolations.add_metric([name, broker], float(item.isolations))
            open_total.add_metric([name], sum(1 for v in left.values() if v > 0))
            items.add_metric([name], len(view.faults))
            in_panic = 0
            for i, topic in enumerate(sorted(view.routes)):
                all_avoided = all(left.get(b, 0) > 0 for b in view.routes[topic].by_broker)
                in_panic += all_avoided
                if i < MAX_TOPIC_SERIES:
                    panic.add_metric([name, topic], 1.0 if all_avoided else 0.0)
            panic_total.add_metric([name], in_panic)
            degraded.add_metric([name], 1.0 if table.degraded else 0.0)
            enabled.add_metric([name], 1.0 if view.config.send_latency_fault_enable else 0.0)
        yield from (avoided, until, latency, isolations, open_total, items, panic, panic_total)
        yield from (degraded, enabled)


def exposition(tables: Sequence[TableState]) -> bytes:
    """The text for GET /metrics: counters (this process's, or every worker's) + table state."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        workers = CollectorRegistry()
        MultiProcessCollector(workers)  # type: ignore[no-untyped-call]
        head = generate_latest(workers)
    else:
        head = generate_latest(REGISTRY)
    table = CollectorRegistry(auto_describe=False)
    table.register(TableCollector(lambda: tables))
    return head + generate_latest(table)
