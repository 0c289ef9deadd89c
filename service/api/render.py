"""Domain objects as API bodies, shared by the routers and the push stream."""

from __future__ import annotations

from service.model import Config, FaultItem, Route, route_brokers
from service.schemas import BrokerSpec, ConfigBody, ReportResponse, RouteOut
from service.store import ReportOutcome


def config_out(c: Config) -> ConfigBody:
    return ConfigBody(
        send_latency_fault_enable=c.send_latency_fault_enable,
        latency_max=list(c.latency_max),
        not_available_duration=list(c.not_available_duration),
        isolation_latency_ms=c.isolation_latency_ms,
        last_report_wins=c.last_report_wins,
        selection=c.selection,  # type: ignore[arg-type]
        ordered_fallback=c.ordered_fallback,  # type: ignore[arg-type]
        max_avoided_percent=c.max_avoided_percent,
        panic_threshold_percent=c.panic_threshold_percent,
        enforcement_percent=c.enforcement_percent,
        isolation_quorum=c.isolation_quorum,
        quorum_window_ms=c.quorum_window_ms,
        repeat_multiplier=c.repeat_multiplier,
        max_isolation_ms=c.max_isolation_ms,
        repeat_decay_ms=c.repeat_decay_ms,
        jitter_percent=c.jitter_percent,
        probe_on_expiry=c.probe_on_expiry,
        probe_timeout_ms=c.probe_timeout_ms,
        detector_enable=c.detector_enable,
        detect_interval_ms=c.detect_interval_ms,
        detect_timeout_ms=c.detect_timeout_ms,
    )


def config_in(body: ConfigBody) -> Config:
    return Config(
        send_latency_fault_enable=body.send_latency_fault_enable,
        latency_max=tuple(body.latency_max),
        not_available_duration=tuple(body.not_available_duration),
        isolation_latency_ms=body.isolation_latency_ms,
        last_report_wins=body.last_report_wins,
        selection=body.selection,
        ordered_fallback=body.ordered_fallback,
        max_avoided_percent=body.max_avoided_percent,
        panic_threshold_percent=body.panic_threshold_percent,
        enforcement_percent=body.enforcement_percent,
        isolation_quorum=body.isolation_quorum,
        quorum_window_ms=body.quorum_window_ms,
        repeat_multiplier=body.repeat_multiplier,
        max_isolation_ms=body.max_isolation_ms,
        repeat_decay_ms=body.repeat_decay_ms,
        jitter_percent=body.jitter_percent,
        probe_on_expiry=body.probe_on_expiry,
        probe_timeout_ms=body.probe_timeout_ms,
        detector_enable=body.detector_enable,
        detect_interval_ms=body.detect_interval_ms,
        detect_timeout_ms=body.detect_timeout_ms,
    )


def route_out(route: Route) -> RouteOut:
    return RouteOut(
        topic=route.topic,
        brokers=[
            BrokerSpec(
                broker_name=b.broker_name, write_queue_nums=b.write_queue_nums, address=b.address
            )
            for b in route_brokers(route)
        ],
    )


def report_out(out: ReportOutcome) -> ReportResponse:
    return ReportResponse(
        broker_name=out.broker_name,
        latency_ms=out.latency_ms,
        not_available_duration_ms=out.not_available_duration_ms,
        available_at=out.available_at,
        degraded=out.degraded,
    )


def fault_event(broker: str, item: FaultItem | None) -> dict[str, object]:
    if item is None:
        return {"brokerName": broker, "deleted": True}
    return {
        "brokerName": broker,
        "currentLatencyMs": item.current_latency_ms,
        "availableAt": item.available_at,
    }
