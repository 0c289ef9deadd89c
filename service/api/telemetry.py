"""What the API counts as it serves: selects, reports, request times, by bounded labels."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from detour.policy import Choice, window_event
from detour.strategy import Decision, Selection, WindowChange
from service.metrics import (
    AVOIDANCE,
    EVENTS,
    EVICTED,
    HTTP_DURATION,
    ISOLATION_WINDOWS,
    MAX_BROKER_SERIES,
    ORDERED,
    OTHER_BROKER,
    PROBES,
    QUORUM,
    REPORTED_LATENCY,
    REPORTS,
    REPORTS_REFUSED,
    SELECT_AVOIDED,
    SELECTS,
    SELECTS_AVOIDING,
    WINDOWS_EXTENDED,
    WINDOWS_OPENED,
)
from service.store.base import ReportOutcome

_seen_brokers: set[str] = set()
#: Broker names with series of their own (``metrics_max_brokers``); the first ones seen.
_broker_cap = MAX_BROKER_SERIES


def set_broker_series_cap(cap: int) -> None:
    """How many broker names get series of their own (first come): a series, once
    exported, stays until the process ends, so a cap is what bounds them.

    Called once per app built, and the count starts over: a process serves one app, so
    this changes nothing in service, and an app built after others in one process (the
    test suite builds hundreds) gets its own names' series rather than ``_other``.
    """
    global _broker_cap
    _broker_cap = cap
    _seen_brokers.clear()


def broker_label(broker: str) -> str:
    """The broker's own label while fewer than the cap's names were seen, else _other."""
    if broker in _seen_brokers:
        return broker
    if len(_seen_brokers) < _broker_cap:
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


#: namespace -> its reported-latency histogram (one per namespace, not per broker: 17
#: series a broker did not earn; a broker's latency is detour_broker_current_latency_seconds).
_latency_series: dict[str, Histogram] = {}


def _reported_latency(namespace: str) -> Histogram:
    series = _latency_series.get(namespace)
    if series is None:
        series = _latency_series[namespace] = REPORTED_LATENCY.labels(namespace)
    return series


def observe_reports(namespace: str, outcomes: Sequence[ReportOutcome]) -> None:
    for o in outcomes:
        broker = broker_label(o.broker_name)
        if o.quorum is not None:
            QUORUM.labels(namespace, broker, o.quorum).inc()
        if o.probe is not None:
            PROBES.labels(namespace, o.probe).inc()
        event = window_event(o.change, o.isolation, o.quorum == "reached", o.probe, o.pending)
        if event is not None:
            EVENTS.labels(namespace, *event).inc()
            if _isolating(event, o.isolation):
                ISOLATION_WINDOWS.labels(namespace, broker, event[1]).inc()
        outcome = "pending" if o.pending else "isolation" if o.isolation else "ok"
        REPORTS.labels(namespace, broker, outcome).inc()
        if not o.pending:
            _reported_latency(namespace).observe(o.latency_ms / 1000)
        if o.change is WindowChange.OPENED and o.tier_ms is not None:
            WINDOWS_OPENED.labels(namespace, broker, str(o.tier_ms)).inc()
        elif o.change is WindowChange.MOVED:
            WINDOWS_EXTENDED.labels(namespace, broker).inc()


#: Event reasons that mean the broker failed (a hang included), not that it was slow.
_FAILURE_REASONS = frozenset({"isolation", "probe", "pending"})


def _isolating(event: tuple[str, str], isolation: bool) -> bool:
    """Whether a window event was opened or moved by a failure: a failed send, a failed
    probe, a hang's in-flight signals, or a quorum of failed sends (a quorum of slow
    answers is a latency window, not an isolation)."""
    kind, reason = event
    if kind == "ended":
        return False
    return reason in _FAILURE_REASONS or (reason == "quorum" and isolation)


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
            observe_request(scope, status, start)


def observe_request(scope: Scope, status: int, start: float) -> None:
    """One request's duration since ``start`` (``perf_counter``), by route template,
    method and status (the direct lane, service/edge/direct.py, times its requests with it)."""
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
