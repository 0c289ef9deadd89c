"""GET /metrics' text: this process's (or every worker's) counters, then the tables' state.

A scrape must never stall selects, however often it comes and however large the
tables: ``Exposition`` renders at most once per ``cache_s`` per audience (every
namespace, or one token's), copies the tables on the event loop (a dict copy each)
and renders in a worker thread, and every scrape in between gets the same bytes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector

from detour.model import FaultItem, Route
from service.metrics import MAX_BROKER_SERIES, MAX_TOPIC_SERIES
from service.store import FaultStore


@dataclass(frozen=True, slots=True)
class TableState:
    """One namespace's table as a scrape sees it: a copy taken on the event loop, so the
    rendering thread never reads a dict the loop is changing."""

    namespace: str
    now: int
    faults: Mapping[str, FaultItem]
    routes: Mapping[str, Route]
    enabled: bool
    degraded: bool = False

    @classmethod
    def of(cls, store: FaultStore) -> TableState:
        view = store.view
        return cls(
            view.namespace,
            view.now_ms(),
            dict(view.faults),
            dict(view.routes),
            view.config.send_latency_fault_enable,
            store.degraded,
        )


class TableCollector(Collector):
    """Per-broker and per-route state, computed from the shared tables when scraped."""

    def __init__(
        self, tables: Callable[[], Sequence[TableState]], max_brokers: int = MAX_BROKER_SERIES
    ) -> None:
        self._tables = tables
        self._max_brokers = max_brokers

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
        reason = GaugeMetricFamily(
            "detour_broker_avoided_reason",
            "1 while the broker's window is open, labelled with why it was set (the fault "
            "item's why: isolation, latency, quorum, pending, probe; unknown for an item "
            "written before reasons were kept).",
            labels=[*ns, "broker", "reason"],
        )
        since = GaugeMetricFamily(
            "detour_broker_avoided_since_seconds",
            "When the report that set the broker's open window was sent (epoch seconds).",
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
            name = table.namespace
            now = table.now
            faults = table.faults
            brokers = set(faults)
            for route in table.routes.values():
                brokers.update(route.by_broker)
            left = {
                b: max(0, item.available_at - now) if (item := faults.get(b)) else 0
                for b in brokers
            }
            shown = sorted(brokers, key=lambda b: (left[b] == 0, b))[: self._max_brokers]
            for broker in sorted(shown):
                avoided.add_metric([name, broker], 1.0 if left[broker] > 0 else 0.0)
                until.add_metric([name, broker], left[broker] / 1000)
                item = faults.get(broker)
                if item is not None:
                    latency.add_metric([name, broker], item.current_latency_ms / 1000)
                    isolations.add_metric([name, broker], float(item.isolations))
                    if left[broker] > 0:
                        why = item.why
                        reason.add_metric(
                            [name, broker, "unknown" if why is None else why.reason], 1.0
                        )
                        if why is not None:
                            since.add_metric([name, broker], why.since / 1000)
            open_total.add_metric([name], sum(1 for v in left.values() if v > 0))
            items.add_metric([name], len(faults))
            in_panic = 0
            for i, topic in enumerate(sorted(table.routes)):
                all_avoided = all(left.get(b, 0) > 0 for b in table.routes[topic].by_broker)
                in_panic += all_avoided
                if i < MAX_TOPIC_SERIES:
                    panic.add_metric([name, topic], 1.0 if all_avoided else 0.0)
            panic_total.add_metric([name], in_panic)
            degraded.add_metric([name], 1.0 if table.degraded else 0.0)
            enabled.add_metric([name], 1.0 if table.enabled else 0.0)
        yield from (avoided, until, latency, isolations, reason, since, open_total, items)
        yield from (panic, panic_total)
        yield from (degraded, enabled)


class _Only:
    """A registry's families with only the samples of ``namespaces`` (and those with no
    namespace label: the process's own), for a token that sees one namespace."""

    def __init__(self, source: CollectorRegistry, namespaces: frozenset[str]) -> None:
        self._source = source
        self._namespaces = namespaces

    def collect(self) -> Iterable[Metric]:
        keep = self._namespaces
        for family in self._source.collect():
            samples = [
                s
                for s in family.samples
                if s.labels.get("namespace", "") in keep or "namespace" not in s.labels
            ]
            if len(samples) == len(family.samples):
                yield family
                continue
            if not samples:
                continue
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = samples
            yield copy


def exposition(
    tables: Sequence[TableState],
    namespaces: frozenset[str] | None = None,
    max_brokers: int = MAX_BROKER_SERIES,
) -> bytes:
    """The text for GET /metrics: counters (this process's, or every worker's) + table state.

    ``namespaces``: show only their series (and the process-wide ones); None: all.
    Reads no view: ``tables`` are copies, so this may run in a worker thread."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        source = CollectorRegistry()
        MultiProcessCollector(source)  # type: ignore[no-untyped-call]
    else:
        source = REGISTRY
    head = generate_latest(source if namespaces is None else _Only(source, namespaces))
    shown = [t for t in tables if namespaces is None or t.namespace in namespaces]
    table = CollectorRegistry(auto_describe=False)
    table.register(TableCollector(lambda: shown, max_brokers))
    return head + generate_latest(table)


@dataclass(frozen=True, slots=True)
class _Render:
    #: Loop time the tables are copied at (not before): who arrived by then may share it.
    at: float
    task: asyncio.Task[bytes]


class Exposition:
    """GET /metrics' text per audience, rendered at most once per ``cache_s``, off the loop.

    A scrape never gets a text older than itself (a count it caused is in it), and the
    rate holds whatever the scrape rate: a scrape that comes within ``cache_s`` of the
    last rendering waits for the next one, which every scrape waiting by then shares.
    At Prometheus's pace (one scrape per interval) nobody waits. One rendering per
    audience (every namespace, or one namespace: a fixed set) is kept.
    """

    def __init__(self, cache_s: float = 1.0, max_brokers: int = MAX_BROKER_SERIES) -> None:
        self.cache_s = cache_s
        self.max_brokers = max_brokers
        #: Renderings done (tests: the rate bound).
        self.renders = 0
        #: audience -> (loop time its tables were copied, the text)
        self._last: dict[frozenset[str] | None, tuple[float, bytes]] = {}
        self._pending: dict[frozenset[str] | None, _Render] = {}

    async def text(
        self, stores: Mapping[str, FaultStore], namespaces: frozenset[str] | None
    ) -> bytes:
        """The text for ``namespaces`` (None: every one), as of this call or later."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        while True:
            pending = self._pending.get(namespaces)
            if pending is not None:
                # Shielded: a scraper that hangs up does not cancel the others' rendering.
                body = await asyncio.shield(pending.task)
                if pending.at >= arrived:
                    return body
                continue  # copied before this scrape came: wait for the next one
            last = self._last.get(namespaces)
            at = arrived if last is None else max(arrived, last[0] + self.cache_s)
            task = loop.create_task(self._render(stores, namespaces, at))
            self._pending[namespaces] = _Render(at, task)

    async def _render(
        self, stores: Mapping[str, FaultStore], namespaces: frozenset[str] | None, at: float
    ) -> bytes:
        loop = asyncio.get_running_loop()
        try:
            if at > loop.time():
                await asyncio.sleep(at - loop.time())
            copied = loop.time()
            tables = [
                TableState.of(s)
                for ns, s in sorted(stores.items())
                if namespaces is None or ns in namespaces
            ]
            body = await asyncio.to_thread(exposition, tables, namespaces, self.max_brokers)
            self.renders += 1
            self._last[namespaces] = (copied, body)
            return body
        finally:
            del self._pending[namespaces]
