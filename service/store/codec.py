"""How config, routes and fault items are written as strings in Redis and in pushed changes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from detour.model import (
    CONFIG_FIELDS,
    BrokerRoute,
    Config,
    FaultItem,
    Route,
    Why,
    route_brokers,
)

#: report.lua's ARGV[6], in the order the script reads it: a Config field by name (a bool
#: as 0/1), or one of REPORT_POLICY_COMPUTED, which the store works out per call.
REPORT_POLICY = (
    "isolation_quorum",
    "quorum_window_ms",
    "keep_ms",
    "repeat_multiplier",
    "max_isolation_ms",
    "repeat_decay_ms",
    "jitter_percent",
    "jitter_scale",
    "max_suspects",
    "max_isolations",
    "event_log_cap",
    "probe_on_expiry",
    "latency_quorum",
    "early_recovery",
    "ramp_ms",
    "pending_quorum",
)
REPORT_POLICY_COMPUTED = frozenset(REPORT_POLICY) - {f.name for f in CONFIG_FIELDS}


def encode_config(c: Config) -> str:
    """The config as stored in Redis and pushed to replicas: its camelCase body."""
    return json.dumps(c.to_wire(), separators=(",", ":"))


def decode_config(raw: str) -> Config:
    """A stored config; an absent one ("") is the default config, and a field stored before
    it existed reads as its default."""
    if not raw:
        return Config()
    d: dict[str, Any] = json.loads(raw)
    return Config.from_wire(d)


def encode_report_policy(config: Config, computed: Mapping[str, int]) -> str:
    """report.lua's ARGV[6] from the config and the store's ``computed`` values (exactly
    REPORT_POLICY_COMPUTED; raises ValueError otherwise)."""
    if computed.keys() != REPORT_POLICY_COMPUTED:
        raise ValueError(f"report.lua's policy needs exactly {sorted(REPORT_POLICY_COMPUTED)}")
    return ",".join(
        str(int(computed[name] if name in computed else getattr(config, name)))
        for name in REPORT_POLICY
    )


def encode_route(route: Route) -> str:
    """A route's JSON body (set_entry.lua stores it behind its stamp: ``stamp|json``)."""
    return json.dumps(
        [[b.broker_name, b.write_queue_nums, b.address] for b in route_brokers(route)],
        separators=(",", ":"),
    )


def stamped_route(route: Route, stamp: int) -> str:
    """A route as stored: ``stamp|json``."""
    return f"{stamp}|{encode_route(route)}"


def route_stamp(raw: str) -> int:
    """The stamp of a stored route (0 for one stored before stamps, JSON alone)."""
    head, sep, _ = raw.partition("|")
    return int(head) if sep and head.isdigit() else 0


def decode_route(topic: str, raw: str) -> Route:
    """A stored route (``stamp|json``, or the JSON alone)."""
    head, sep, rest = raw.partition("|")
    body = rest if sep and head.isdigit() else raw
    brokers = (BrokerRoute(str(n), int(q), a) for n, q, a in json.loads(body))
    return Route.from_brokers(topic, brokers)


def encode_fault(item: FaultItem) -> str:
    """A fault item in the form lib/item.lua writes it (decode_fault's inverse): its stamp,
    then the fields past ``latencyMs,availableAt`` only as far as the item keeps more."""
    stamp = f"{item.stamp}@"
    w = item.why
    why = "" if w is None else f";!{w.reason}={w.since}={w.latency_ms}={w.by}"
    if (
        not item.isolations
        and not item.suspects
        and not item.slow
        and not item.pending
        and not item.probation
        and item.reachable is None
    ):
        return f"{stamp}{item.current_latency_ms},{item.available_at}{why}"
    head = f"{stamp}{item.current_latency_ms},{item.available_at},{item.isolations}"
    if item.reachable is not None:
        head += f",{int(item.probation)},{int(item.reachable)}"
    elif item.probation:
        head += ",1"
    votes = "".join(f";{p}={a}={e}" for p, a, e in item.slow)
    signals = "".join(f";~{p}={s}={a}" for p, s, a in item.pending)
    return head + "".join(f";{p}={a}" for p, a in item.suspects) + votes + signals + why


def item_stamp(raw: str) -> int:
    """The stamp of a stored item, without decoding the rest (0 before stamps existed)."""
    head, sep, _ = raw.partition("@")
    return int(head) if sep and head.isdigit() else 0


def decode_fault(broker: str, raw: str) -> FaultItem:
    """A fault item as lib/item.lua writes it: ``stamp@latencyMs,availableAt`` (no
    ``stamp@`` before stamps existed: stamp 0), then ``,isolations[,probation 1/0[,reachable
    1/0]]``, ``;producer=at`` per suspect and ``;producer=at=end`` per slow answer short of
    the latency quorum, ``;~producer=since=at`` per in-flight signal (pendingQuorum), only as
    far as the policy keeps more, and ``;!reason=since=latencyMs=by`` while a window is open
    (``Why``; producer ids cannot contain ``;``, ``=``, ``~`` or ``!``; ``@`` only appears
    after the head)."""
    head, *entries = raw.split(";")
    stamp = 0
    if "@" in head:
        mark, head = head.split("@", 1)
        stamp = int(mark)
    latency, end, *rest = head.split(",")
    why = None
    for e in entries:
        if e.startswith("!"):
            reason, since, measured, by = e[1:].split("=", 3)
            why = Why(reason, int(since), int(measured), by)
    split = [e.split("=") for e in entries if not e.startswith(("~", "!"))]
    pairs = tuple((v[0], int(v[1])) for v in split if len(v) == 2)
    slow = tuple((v[0], int(v[1]), int(v[2])) for v in split if len(v) == 3)
    signals = tuple(
        (v[0], int(v[1]), int(v[2]))
        for v in (e[1:].split("=") for e in entries if e.startswith("~"))
    )
    return FaultItem(
        broker,
        int(latency),
        int(end),
        int(rest[0]) if rest else 0,
        pairs,
        rest[1:2] == ["1"],
        None if len(rest) < 3 else rest[2] == "1",
        slow,
        signals,
        why,
        stamp,
    )


#: The field that carries the table's epoch in each hash of the table (lua/lib/item.lua
#: ``MARK``): never a name (NAME_PATTERN has no ``~``), so readers of a whole hash skip it.
MARK = "~epoch"


def pairs(flat: Sequence[str]) -> list[tuple[str, str]]:
    """Redis's flat ``HGETALL`` reply of a table hash as (field, value) pairs, without
    the table's mark."""
    return [(k, v) for k, v in zip(flat[::2], flat[1::2], strict=True) if k != MARK]
