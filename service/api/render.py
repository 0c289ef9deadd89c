"""Domain objects as API bodies, shared by the routers and the push stream."""

from __future__ import annotations

from detour.model import Config, FaultItem, Route, Why, route_brokers
from detour.profiles import profile_of
from service.schemas import BrokerSpec, ConfigBody, ReportResponse, RouteOut, WhyOut
from service.store import ReportOutcome


def config_out(c: Config) -> ConfigBody:
    return ConfigBody.model_validate({**c.to_wire(), "profile": profile_of(c)})


def config_in(body: ConfigBody) -> Config:
    return Config.from_wire(body.model_dump(by_alias=True))


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
        duplicate=out.duplicate,
        expired=out.expired,
    )


def fault_event(broker: str, item: FaultItem | None) -> dict[str, object]:
    """A fault item as the push stream sends it: everything a select reads of it, so a
    cached client decides as the service does (detour/client/wire.py reads it back)."""
    if item is None:
        return {"brokerName": broker, "deleted": True}
    return {
        "brokerName": broker,
        "currentLatencyMs": item.current_latency_ms,
        "availableAt": item.available_at,
        "isolations": item.isolations,
        "suspects": [[who, at] for who, at in item.suspects],
        "slow": [[who, at, end] for who, at, end in item.slow],
        "pending": [[who, since, at] for who, since, at in item.pending],
        "probation": item.probation,
        "reachable": item.reachable,
        "why": None if item.why is None else why_out(item.why).model_dump(mode="json"),
    }


def why_out(why: Why) -> WhyOut:
    return WhyOut.model_validate(
        {"reason": why.reason, "since": why.since, "latencyMs": why.latency_ms, "by": why.by}
    )
