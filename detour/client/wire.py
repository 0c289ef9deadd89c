"""Detour's JSON bodies to and from the pure model, with no HTTP library in sight.

The service validates with pydantic; the SDK must not import it, so the few
shapes it reads (select answers, routes, fault items) are mapped by hand here,
once, for the sync and async clients alike; the config's mapping comes with its
declaration (``Config.from_wire``). Reports are checked before
they are queued: a batch is atomic, so one bad report would sink 999 good ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from detour.client.values import SelectedQueue
from detour.model import (
    MAX_LATENCY_MS,
    BrokerRoute,
    Config,
    FaultItem,
    Route,
    Why,
)
from detour.model import (
    MAX_REPORT_AGE_MS as MAX_AGE_MS,
)
from detour.strategy import Decision

#: The service's name rule (topics and brokers).
NAME = re.compile(r"[A-Za-z0-9_.%|-]{1,127}")
#: Most reports in one ``POST /report-latency:batch``.
MAX_BATCH = 1000

Json = dict[str, Any]


def check_name(what: str, value: str) -> None:
    """Raises ValueError unless ``value`` is a valid topic or broker name."""
    if not isinstance(value, str) or NAME.fullmatch(value) is None:
        raise ValueError(f"{what} must be 1..127 of A-Za-z0-9_.%|-, got {value!r}")


def check_report(broker_name: str, latency_ms: float, age_ms: int = 0) -> None:
    """Raises ValueError unless Detour would accept the report (ms, 0..3,600,000)."""
    check_name("broker_name", broker_name)
    if isinstance(latency_ms, bool) or not isinstance(latency_ms, int | float):
        raise ValueError(f"latency_ms must be a number of ms, got {latency_ms!r}")
    if not math.isfinite(latency_ms) or not 0 <= latency_ms <= MAX_LATENCY_MS:
        raise ValueError(f"latency_ms must be 0..{MAX_LATENCY_MS} ms, got {latency_ms!r}")
    if isinstance(age_ms, bool) or not isinstance(age_ms, int) or not 0 <= age_ms <= MAX_AGE_MS:
        raise ValueError(f"age_ms must be an int of ms, 0..{MAX_AGE_MS}, got {age_ms!r}")


def select_body(
    topic: str,
    last_broker: str | None,
    producer: str | None = None,
    sharding_key: str | None = None,
) -> Json:
    """``POST /select``'s body; ``producer`` so Detour avoids this producer's own windows."""
    body: Json = {"topic": topic, "lastBrokerName": last_broker}
    if producer is not None:
        body["producer"] = producer
    if sharding_key is not None:
        body["shardingKey"] = sharding_key
    return body


#: The longest sharding key Detour accepts (characters).
MAX_SHARDING_KEY = 1024


def check_sharding_key(key: str | None) -> None:
    """Raises ValueError unless Detour would accept ``key`` (1..1024 characters)."""
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= MAX_SHARDING_KEY):
        raise ValueError(f"sharding_key must be 1..{MAX_SHARDING_KEY} characters, got {key!r}")


#: The service's rule for a producer id.
PRODUCER = re.compile(r"[A-Za-z0-9_.:@%|/-]{1,128}")


def check_producer(producer: str | None) -> None:
    if producer is not None and (
        not isinstance(producer, str) or PRODUCER.fullmatch(producer) is None
    ):
        raise ValueError(f"producer must be 1..128 of A-Za-z0-9_.:@%|/-, got {producer!r}")


def report_body(
    broker_name: str,
    latency_ms: float,
    isolation: bool,
    producer: str | None = None,
    report_id: str | None = None,
) -> Json:
    body: Json = {"brokerName": broker_name, "latencyMs": latency_ms, "isolation": isolation}
    if producer is not None:
        body["producer"] = producer
    if report_id is not None:
        body["reportId"] = report_id
    return body


def batch_head(
    broker_name: str,
    latency_ms: float,
    isolation: bool,
    producer: str | None = None,
    report_id: str | None = None,
    pending: bool = False,
) -> str:
    """A batch entry as JSON text without its age and closing brace: made once, when the
    report is queued, so that building a batch body is a join (``batch_text``). The
    flusher shares its process's GIL with the producer's sending threads; encoding 1,000
    entries at flush time held it for milliseconds at a time.

    Written directly: the names were checked on the way in (``check_report``,
    ``check_producer``: letters, digits and ``_.:@%|/-``, nothing JSON escapes), the report
    id is this client's, and a latency is a finite int or float, written as ``json`` writes
    it (``float.__repr__`` also for a float subclass such as numpy's)."""
    latency = float.__repr__(latency_ms) if isinstance(latency_ms, float) else int(latency_ms)
    head = (
        f'{{"brokerName":"{broker_name}","latencyMs":{latency},'
        f'"isolation":{"true" if isolation else "false"}'
    )
    if producer is not None:
        head += f',"producer":"{producer}"'
    if report_id is not None:
        head += f',"reportId":"{report_id}"'
    if pending:
        head += ',"pending":true'
    return head + ',"ageMs":'


def batch_text(entries: Iterable[tuple[str, int]]) -> bytes:
    """``POST /report-latency:batch``'s body from ``(batch_head, age_ms)`` pairs (a head
    ends where the age goes).

    The queue drops reports past Detour's age limit (a day) before they get here; the
    clamp only guards the boundary (a report that turned too old on the way)."""
    return (
        '{"reports":['
        + ",".join(f"{head}{min(max(0, age), MAX_AGE_MS)}}}" for head, age in entries)
        + "]}"
    ).encode()


def route(body: Mapping[str, Any]) -> Route:
    """A ``Route`` from ``{"topic", "brokers": [{"brokerName", "writeQueueNums", "address"}]}``."""
    return Route.from_brokers(
        str(body["topic"]),
        (
            BrokerRoute(str(b["brokerName"]), int(b["writeQueueNums"]), b.get("address"))
            for b in body["brokers"]
        ),
    )


def config(body: Mapping[str, Any]) -> Config:
    """A ``Config`` from the camelCase body; omitted fields take their defaults.

    Every field is read (local selects decide with the whole policy). Lenient: a field
    this SDK's rules refuse (a newer service's bounds or choices) takes its default
    rather than failing the whole config, so a newer service does not stop the cached
    client.
    """
    return Config.from_wire(body, lenient=True)


def fault(body: Mapping[str, Any]) -> FaultItem | None:
    """A fault item from a stream entry, or None for ``{"brokerName", "deleted": true}``.

    Besides the window, what a select reads of it: ``probation`` (probeOnExpiry),
    ``reachable`` (the active detector) and ``suspects`` (``[[producer, ms], ...]``,
    failures short of the isolation quorum) and ``slow`` (``[[producer, ms, window end
    ms], ...]``, slow answers short of the latency quorum), and ``pending`` (``[[producer,
    since ms, at ms], ...]``, in-flight signals short of the pending quorum), and ``why``
    (the report that set the window's end); a service that does not send them has none of
    them set.
    """
    if body.get("deleted"):
        return None
    reachable = body.get("reachable")
    if reachable is not None and not isinstance(reachable, bool):
        raise TypeError(f"reachable must be a boolean or null, got {reachable!r}")
    return FaultItem(
        str(body["brokerName"]),
        int(body["currentLatencyMs"]),
        int(body["availableAt"]),
        int(body.get("isolations", 0)),
        tuple((str(who), int(at)) for who, at in body.get("suspects", ())),
        bool(body.get("probation", False)),
        reachable,
        tuple((str(who), int(at), int(end)) for who, at, end in body.get("slow", ())),
        tuple((str(who), int(s), int(at)) for who, s, at in body.get("pending", ())),
        why(body.get("why")),
    )


def why(body: Any) -> Why | None:
    """Why a window is open (``{"reason", "since", "latencyMs", "by"}``), or None; a service
    that does not send it has none."""
    if body is None:
        return None
    if not isinstance(body, Mapping):
        raise TypeError(f"why must be an object or null, got {body!r}")
    return Why(str(body["reason"]), int(body["since"]), int(body["latencyMs"]), str(body["by"]))


def selected(body: Mapping[str, Any], topic: str | None = None) -> SelectedQueue:
    """``POST /select``'s answer (decided by Detour, so ``local`` is False).

    Strict, because a producer sends to whatever this returns: raises KeyError,
    TypeError or ValueError for anything but the answer Detour sends (for
    ``topic``, when given), and the client then treats Detour as unavailable.
    """
    answered_topic, broker, queue_id = body["topic"], body["brokerName"], body["queueId"]
    if topic is not None and answered_topic != topic:
        raise ValueError(f"answer for topic {answered_topic!r}, asked for {topic!r}")
    check_name("brokerName", broker)
    if isinstance(queue_id, bool) or not isinstance(queue_id, int) or queue_id < 0:
        raise ValueError(f"queueId must be an int >= 0, got {queue_id!r}")
    address = body.get("address")
    if address is not None and not isinstance(address, str):
        raise TypeError(f"address must be a string or null, got {address!r}")
    ordered = body.get("ordered")
    if ordered not in (None, "home", "wait", "remap"):
        raise ValueError(f"ordered must be home, wait, remap or null, got {ordered!r}")
    return SelectedQueue(
        topic=str(answered_topic),
        broker_name=broker,
        queue_id=queue_id,
        address=address,
        decision=Decision(body["decision"]),
        avoided_brokers=_names(body, "avoidedBrokers"),
        local=False,
        panic=_flag(body, "panic"),
        dry_run=_flag(body, "dryRun"),
        unenforced_brokers=_names(body, "unenforcedBrokers"),
        ordered=ordered,
        probe=_flag(body, "probe"),
    )


def _names(body: Mapping[str, Any], key: str) -> tuple[str, ...]:
    names = body.get(key, [])
    if not isinstance(names, list) or not all(isinstance(b, str) for b in names):
        raise TypeError(f"{key} must be a list of names, got {names!r}")
    return tuple(names)


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be a boolean, got {value!r}")
    return value


#: Detour's error codes: upper-case words joined by ``_`` (``NOT_FOUND``, ``SYSTEM_BUSY``).
ERROR_CODE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")


def is_error_body(body: object) -> bool:
    """Whether ``body`` is Detour's Error shape exactly: ``{"error": CODE, "message": str,
    "field": str | null}`` and nothing else. A proxy or gateway in front of Detour answers
    its own 4xx (``{"error": "Not Found"}``, an HTML page); only Detour's are raised."""
    return (
        isinstance(body, Mapping)
        and set(body) == {"error", "message", "field"}
        and isinstance(body["error"], str)
        and ERROR_CODE.fullmatch(body["error"]) is not None
        and isinstance(body["message"], str)
        and (body["field"] is None or isinstance(body["field"], str))
    )


def error_fields(body: object) -> tuple[str, str, str | None]:
    """(code, message, field) of an error body, tolerant of a proxy's non-JSON answer."""
    if isinstance(body, Mapping):
        field = body.get("field")
        return (
            str(body.get("error", "HTTP_ERROR")),
            str(body.get("message", "")),
            field if isinstance(field, str) else None,
        )
    return "HTTP_ERROR", str(body)[:200], None


#: A report's answer (openapi ``ReportResponse``): the fields it must have, and their types.
_REPORT_FIELDS: tuple[tuple[str, type], ...] = (
    ("latencyMs", int),
    ("notAvailableDurationMs", int),
    ("availableAt", int),
    ("degraded", bool),
)


def report_result(body: Any, broker_name: str) -> bool:
    """Checks one report's result is Detour's for a report of ``broker_name``; returns
    whether Detour declined it as ``expired`` (an id'd report it can no longer prove it
    has not applied: optional, absent is False).

    Raises KeyError, TypeError or ValueError for anything else: a gateway's ``200
    {"status": "ok"}`` is not Detour having applied the report, and a report counted as
    sent that never arrived is lost without a trace. Extra fields are accepted."""
    if not isinstance(body, Mapping):
        raise TypeError(f"a report's result must be an object, got {type(body).__name__}")
    if body["brokerName"] != broker_name:
        raise ValueError(f"a result for {str(body['brokerName'])[:130]!r}, not {broker_name!r}")
    for key, kind in _REPORT_FIELDS:
        value = body[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TypeError(f"{key} must be {kind.__name__}, got {value!r}")
    return _flag(body, "expired")


def batch_result(body: Any, broker_names: Sequence[str]) -> list[bool]:
    """Checks a batch's answer (``{"results": [...]}``): one result per report sent, in
    order, each ``report_result``'s; returns each one's ``expired``. Raises as it does."""
    results = json_mapping(body)["results"]
    if not isinstance(results, list) or len(results) != len(broker_names):
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise ValueError(f"{got} results for {len(broker_names)} reports")
    return [report_result(r, b) for r, b in zip(results, broker_names, strict=True)]


def json_mapping(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    return body
