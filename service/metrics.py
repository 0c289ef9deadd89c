"""Every Prometheus metric Detour exports, defined once, and the collector of table state.

Counters and histograms count what this process did; with several uvicorn
workers they go through prometheus-client's multiprocess mode (files in
``PROMETHEUS_MULTIPROC_DIR``, set by ``python -m service``) so a scrape of any
worker adds up all of them. Per-broker state (avoided, seconds until
available, routes in panic) is *derived from the shared table* at scrape time
by ``TableCollector``, so every replica reports the same truth whichever
replica made the change.

Label cardinality: ``namespace`` is one of the configured namespaces (fixed at
start). ``broker`` on counters and histograms takes the first
``MAX_BROKER_SERIES`` broker names this process sees; later ones count under
``broker="_other"`` (a flood of invented names cannot grow the process or the
Prometheus series). The table's gauges list at most ``MAX_BROKER_SERIES``
brokers per namespace, avoided ones first; the totals are always complete.
``decision``, ``outcome``, ``tier`` (a ``latencyMax`` value, at most 32), ``route``
(the route template, never the raw path), ``method``, ``status``, ``op`` and
``reason`` are fixed sets. Topics appear only on ``detour_route_all_avoided``,
capped at ``MAX_TOPIC_SERIES`` topics (by name); the total is always in
``detour_routes_all_avoided``. Producer ids are never labels.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.policy import Choice, window_event
from service.store.base import ReportOutcome
from service.strategy import Decision, Selection, WindowChange
from service.view import TableView

# A `_created` twin per counter and histogram would nearly double the series.
disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds. Every default latencyMax tier (0.05 ... 15 s) is a bucket boundary, so
#: `le` lines up with the tiers on the heatmap; custom tiers fall between buckets.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.55,
    1.0,
    2.0,
    3.0,
    5.0,
    10.0,
    15.0,
    30.0,
    60.0,
)
#: Seconds, for Detour's own endpoints and Redis calls.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_TOPIC_SERIES = 100
MAX_BROKER_SERIES = 1000
OTHER_BROKER = "_other"

SELECTS = Counter("detour_selects_total", "Selects by decision.", ["namespace", "decision"])
SELECTS_AVOIDING = Counter(
    "detour_selects_avoiding_total",
    "Selects that passed over at least one avoided broker (or had to pickOneAtLeast): "
    "divided by detour_selects_total, the avoidance ratio.",
    ["namespace"],
)
SELECT_AVOIDED = Counter(
    "detour_select_avoided_total",
    "Brokers passed over by a select because their avoidance window was open.",
    ["namespace", "broker"],
)
REPORTS = Counter(
    "detour_reports_total", "Reports by broker and outcome.", ["namespace", "broker", "outcome"]
)
REPORTS_REFUSED = Counter(
    "detour_reports_refused_total",
    "Reports refused whole: reason=table_full (a new broker while the namespace's table "
    "held max_brokers open windows).",
    ["namespace", "reason"],
)
REPORTED_LATENCY = Histogram(
    "detour_reported_latency_seconds",
    "Latency producers reported, per broker.",
    ["namespace", "broker"],
    buckets=LATENCY_BUCKETS,
)
WINDOWS_OPENED = Counter(
    "detour_windows_opened_total",
    "Avoidance windows opened (the broker was available before), by broker and tier "
    "(the tier's latencyMax in ms).",
    ["namespace", "broker", "tier"],
)
WINDOWS_EXTENDED = Counter(
    "detour_windows_extended_total",
    "Open windows a report moved, by broker.",
    ["namespace", "broker"],
)
EVICTED = Counter(
    "detour_fault_items_evicted_total",
    "Fault items whose window had ended, dropped to make room in a full table.",
    ["namespace"],
)
AVOIDANCE = Counter(
    "detour_avoidance_selects_total",
    "Selects that met at least one open window, by what they did: enforced (obeyed every "
    "one), limited (maxAvoidedPercent: the least bad served), panic (panicThresholdPercent: "
    "all ignored) or dry_run (enforcementPercent: counted, not obeyed). The sum is the "
    "detected avoidance; outcome=enforced plus limited is the enforced one.",
    ["namespace", "outcome"],
)
ORDERED = Counter(
    "detour_ordered_selects_total",
    "Selects with a shardingKey, by placement: home (the key's queue), wait (the key's queue "
    "on an avoided broker) or remap (moved to the next available queue).",
    ["namespace", "placement"],
)
QUORUM = Counter(
    "detour_quorum_reports_total",
    "Failures subject to isolationQuorum, by broker and outcome: suspected (short of the "
    "quorum: only the reporter avoids the broker) or reached (isolated for everyone).",
    ["namespace", "broker", "outcome"],
)
EVENTS = Counter(
    "detour_window_events_total",
    "Event log entries written by this process: kind opened, extended, ended (early) or "
    "quorum; reason isolation, latency, quorum, success (lastReportWins) or operator.",
    ["namespace", "kind", "reason"],
)
PROBES = Counter(
    "detour_probes_total",
    "Probation probes (probeOnExpiry): sent (a select was given a broker whose window "
    "ended), passed (its success re-opened the broker to all), failed (it re-isolated it).",
    ["namespace", "outcome"],
)
DETECTIONS = Counter(
    "detour_detector_checks_total",
    "The active detector's TCP connects to avoided brokers, by result (reachable, "
    "unreachable); only the replica holding the namespace's detector lease checks.",
    ["namespace", "result"],
)
HTTP_DURATION = Histogram(
    "detour_http_request_duration_seconds",
    "Time to answer Detour's own endpoints.",
    ["route", "method", "status"],
    buckets=FAST_BUCKETS,
)
STORE_ERRORS = Counter("detour_store_errors_total", "Store calls that failed.", ["op"])
STORE_ROUNDTRIP = Histogram(
    "detour_store_roundtrip_seconds", "Store call round-trip time.", ["op"], buckets=FAST_BUCKETS
)
SHED = Counter(
    "detour_requests_shed_total",
    "Requests refused at once to bound the work in flight.",
    ["reason"],
)
RESYNCS = Counter("detour_view_resyncs_total", "Full resyncs of this replica's table copy.")
RESEEDS = Counter(
    "detour_store_reseeds_total",
    "Times this replica wrote its config and routes back to a Redis that had lost them.",
)
JOURNAL_SIZE = Gauge(
    "detour_journal_reports",
    "Reports accepted while Redis was unreachable, not yet replayed.",
    multiprocess_mode="livesum",
)
JOURNAL_DROPPED = Counter(
    "detour_journal_dropped_total",
    "Journaled reports dropped: reason=full (journal at its cap, oldest dropped), expired "
    "(older than an hour at replay) or table_full (a new broker with no room at replay).",
    ["reason"],
)
JOURNAL_REPLAYED = Counter(
    "detour_journal_replayed_total", "Journaled reports handed to Redis after an outage."
)

# Series that exist from the start, so rate() and increase() see their first event.
for _op in ("report", "set_entry", "snapshot", "fault_items", "sync"):
    STORE_ERRORS.labels(_op)
for _reason in ("full", "expired", "table_full"):
    JOURNAL_DROPPED.labels(_reason)
for _reason in ("in_flight", "turn_budget", "queue_wait"):
    SHED.labels(_reason)

_seen_brokers: set[str] = set()


def broker_label(broker: str) -> str:
    """The broker's own label while fewer than MAX_BROKER_SERIES names were seen."""
    if broker in _seen_brokers:
        return broker
    if len(_seen_brokers) < MAX_BROKER_SERIES:
        _seen_brokers.add(broker)
        return broker
    return OTHER_BROKER


_DECISIONS = ("available", "pick_one_at_least", "round_robin", "no_route")
_AVOIDANCE_OUTCOMES = ("enforced", "limited", "panic", "dry_run")
_PLACEMENTS = ("home", "wait", "remap")


def prepare_namespaces(namespaces: Iterable[str]) -> None:
    """Create each namespace's decision and refusal series, so rate() sees the first event."""
    for ns in namespaces:
        for d in _DECISIONS:
            SELECTS.labels(ns, d)
        SELECTS_AVOIDING.labels(ns)
        REPORTS_REFUSED.labels(ns, "table_full")
        EVICTED.labels(ns)
        for outcome in _AVOIDANCE_OUTCOMES:
            AVOIDANCE.labels(ns, outcome)
        for placement in _PLACEMENTS:
            ORDERED.labels(ns, placement)
        for outcome in ("sent", "passed", "failed"):
            PROBES.labels(ns, outcome)


#: (namespace, decision) -> its child series: ``labels()`` costs more than the increment,
#: and this runs on every select.
_select_series: dict[tuple[str, str], Counter] = {}


def _selects(namespace: str, decision: str) -> Counter:
    key = (namespace, decision)
    series = _select_series.get(key)
    if series is None:
        series = _select_series[key] = SELECTS.labels(namespace, decision)
    return series


def observe_select(namespace: str, selection: Selection | None) -> None:
    """Count one select; None when the topic had no route."""
    if selection is None:
        _selects(namespace, "no_route").inc()
        return
    _selects(namespace, selection.decision.value).inc()
    if selection.avoided_brokers or selection.decision is Decision.PICK_ONE_AT_LEAST:
        SELECTS_AVOIDING.labels(namespace).inc()
    for broker in selection.avoided_brokers:
        SELECT_AVOIDED.labels(namespace, broker_label(broker)).inc()


def observe_policy(namespace: str, choice: Choice) -> None:
    """Count what the policy did with the open windows a select met, and keyed placements."""
    av = choice.avoidance
    if av.detected:
        if av.dry_run:
            outcome = "dry_run"
        elif av.panic:
            outcome = "panic"
        elif av.unenforced:
            outcome = "limited"
        else:
            outcome = "enforced"
        AVOIDANCE.labels(namespace, outcome).inc()
    if choice.ordered is not None:
        ORDERED.labels(namespace, choice.ordered).inc()
    if choice.probe is not None:
        PROBES.labels(namespace, "sent").inc()


def observe_reports(namespace: str, outcomes: Sequence[ReportOutcome]) -> None:
    for o in outcomes:
        broker = broker_label(o.broker_name)
        if o.quorum is not None:
            QUORUM.labels(namespace, broker, o.quorum).inc()
        if o.probe is not None:
            PROBES.labels(namespace, o.probe).inc()
        event = window_event(o.change, o.isolation, o.quorum == "reached", o.probe)
        if event is not None:
            EVENTS.labels(namespace, *event).inc()
        REPORTS.labels(namespace, broker, "isolation" if o.isolation else "ok").inc()
        REPORTED_LATENCY.labels(namespace, broker).observe(o.latency_ms / 1000)
        if o.change is WindowChange.OPENED and o.tier_ms is not None:
            WINDOWS_OPENED.labels(namespace, broker, str(o.tier_ms)).inc()
        elif o.change is WindowChange.MOVED:
            WINDOWS_EXTENDED.labels(namespace, broker).inc()


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


_http_series: dict[tuple[str, str, int], Histogram] = {}


class RequestTimer:
    """Times every request into detour_http_request_duration_seconds, by route template."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            if template != "/fault-items/stream":  # endless by design
                key = (template, scope["method"], status)
                series = _http_series.get(key)
                if series is None:
                    # Bounded: route templates x methods x statuses.
                    series = _http_series[key] = HTTP_DURATION.labels(
                        template, scope["method"], str(status)
                    )
                series.observe(time.perf_counter() - start)
