"""How config, routes and fault items are written as strings in Redis and in pushed changes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from service.model import BrokerRoute, Config, FaultItem, Route, route_brokers

#: Config fields beyond RocketMQ's, stored under their API (camelCase) names; a config
#: stored before a field existed reads as that field's default.
_POLICY_FIELDS = {
    "selection": "selection",
    "ordered_fallback": "orderedFallback",
    "max_avoided_percent": "maxAvoidedPercent",
    "panic_threshold_percent": "panicThresholdPercent",
    "enforcement_percent": "enforcementPercent",
    "isolation_quorum": "isolationQuorum",
    "quorum_window_ms": "quorumWindowMs",
    "repeat_multiplier": "repeatMultiplier",
    "max_isolation_ms": "maxIsolationMs",
    "repeat_decay_ms": "repeatDecayMs",
    "jitter_percent": "jitterPercent",
    "probe_on_expiry": "probeOnExpiry",
    "probe_timeout_ms": "probeTimeoutMs",
    "detector_enable": "detectorEnable",
    "detect_interval_ms": "detectIntervalMs",
    "detect_timeout_ms": "detectTimeoutMs",
}


def encode_config(c: Config) -> str:
    return json.dumps(
        {
            "sendLatencyFaultEnable": c.send_latency_fault_enable,
            "latencyMax": list(c.latency_max),
            "notAvailableDuration": list(c.not_available_duration),
            "isolationLatencyMs": c.isolation_latency_ms,
            "lastReportWins": c.last_report_wins,
            **{name: getattr(c, attr) for attr, name in _POLICY_FIELDS.items()},
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
        **{attr: d[name] for attr, name in _POLICY_FIELDS.items() if name in d},
    )


def encode_route(route: Route) -> str:
    return json.dumps(
        [[b.broker_name, b.write_queue_nums, b.address] for b in route_brokers(route)],
        separators=(",", ":"),
    )


def decode_route(topic: str, raw: str) -> Route:
    brokers = (BrokerRoute(str(n), int(q), a) for n, q, a in json.loads(raw))
    return Route.from_brokers(topic, brokers)


def encode_fault(
    latency_ms: int,
    available_at: int,
    isolations: int = 0,
    suspects: Sequence[tuple[str, int]] = (),
    probation: bool = False,
    reachable: bool | None = None,
) -> str:
    """``latencyMs,availableAt``, then ``,isolations[,probation 1/0[,reachable 1/0]]`` and
    ``;producer=at`` per suspect, only as far as the policy keeps more (report.lua and
    reach.lua write the same; producer ids cannot contain ``;`` or ``=``)."""
    if not isolations and not suspects and not probation and reachable is None:
        return f"{latency_ms},{available_at}"
    head = f"{latency_ms},{available_at},{isolations}"
    if reachable is not None:
        head += f",{int(probation)},{int(reachable)}"
    elif probation:
        head += ",1"
    return head + "".join(f";{p}={a}" for p, a in suspects)


def encode_item(item: FaultItem) -> str:
    return encode_fault(
        item.current_latency_ms,
        item.available_at,
        item.isolations,
        item.suspects,
        item.probation,
        item.reachable,
    )


def decode_fault(broker: str, raw: str) -> FaultItem:
    head, *suspects = raw.split(";")
    latency, end, *rest = head.split(",")
    pairs = tuple((p, int(a)) for p, _, a in (s.partition("=") for s in suspects))
    return FaultItem(
        broker,
        int(latency),
        int(end),
        int(rest[0]) if rest else 0,
        pairs,
        rest[1:2] == ["1"],
        None if len(rest) < 3 else rest[2] == "1",
    )


def pairs(flat: Sequence[str]) -> list[tuple[str, str]]:
    """Redis's flat ``HGETALL`` reply as (field, value) pairs."""
    return list(zip(flat[::2], flat[1::2], strict=True))
