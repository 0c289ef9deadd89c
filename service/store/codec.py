"""How config, routes and fault items are written as strings in Redis and in pushed changes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service.model import BrokerRoute, Config, FaultItem, Route, route_brokers


def encode_config(c: Config) -> str:
    return json.dumps(
        {
            "sendLatencyFaultEnable": c.send_latency_fault_enable,
            "latencyMax": list(c.latency_max),
            "notAvailableDuration": list(c.not_available_duration),
            "isolationLatencyMs": c.isolation_latency_ms,
            "lastReportWins": c.last_report_wins,
        },
        separators=(",", ":"),
    )


def decode_config(raw: str) -> Config:
    """A stored config; an absent one ("") is the default config."""
    if not raw:
        return Config()
    d: dict[str, Any] = json.loads(raw)
    return Config(
        send_latency_fault_enable=bool(d["sendLatencyFaultEnable"]),
        latency_max=tuple(int(x) for x in d["latencyMax"]),
        not_available_duration=tuple(int(x) for x in d["notAvailableDuration"]),
        isolation_latency_ms=int(d["isolationLatencyMs"]),
        last_report_wins=bool(d["lastReportWins"]),
    )


def encode_route(route: Route) -> str:
    return json.dumps(
        [[b.broker_name, b.write_queue_nums, b.address] for b in route_brokers(route)],
        separators=(",", ":"),
    )


def decode_route(topic: str, raw: str) -> Route:
    brokers = (BrokerRoute(str(n), int(q), a) for n, q, a in json.loads(raw))
    return Route.from_brokers(topic, brokers)


def encode_fault(latency_ms: int, available_at: int) -> str:
    return f"{latency_ms},{available_at}"


def decode_fault(broker: str, raw: str) -> FaultItem:
    latency, _, end = raw.partition(",")
    return FaultItem(broker, int(latency), int(end))


def pairs(flat: Sequence[str]) -> list[tuple[str, str]]:
    """Redis's flat ``HGETALL`` reply as (field, value) pairs."""
    return list(zip(flat[::2], flat[1::2], strict=True))
