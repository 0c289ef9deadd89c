"""Hostile and malformed input: every bad request is refused cleanly and changes nothing.

The contract under test, on both stores (the parametrized ``client`` fixture):

* an invalid request gets 422 ``VALIDATION_ERROR`` (413 ``PAYLOAD_TOO_LARGE`` for a body
  over ``max_body_bytes``, 64 KiB by default), never a 500;
* the body is exactly ``{"error": CODE, "message": str, "field": str | null}`` and ``field``
  names the offending field as a path (``brokers[1].writeQueueNums``), ``body`` for a
  malformed or missing body;
* the shared state (``GET /config``, ``GET /routes``, ``GET /fault-items`` minus ``now``)
  is the same after the bad request as before it.

Every test starts from ``seed`` (a non-default config, a route, one report that opens a
window) and checks the three reads against what the seed wrote after its bad request;
``test_batch_...`` replays every table on one app and compares before/after snapshots.

In the tables a ``Raw`` body is sent byte for byte as ``application/json``, ``None`` sends
no body, anything else is sent as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from httpx import Response

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient

pytestmark = pytest.mark.integration

JSON = {"content-type": "application/json"}
LIMIT = 64 * 1024  # the default max_body_bytes
BIG = 2 * 1024 * 1024
VE, NF, TL = "VALIDATION_ERROR", "NOT_FOUND", "PAYLOAD_TOO_LARGE"

from tests.test_behaviour import DEFAULT_CONFIG  # noqa: E402

TOPIC = "orders"
#: A non-default config: a 600 ms report on broker-a opens a 30 s window.
SEED_CONFIG: dict[str, Any] = {
    "sendLatencyFaultEnable": True,
    "latencyMax": [100, 500, 1000, 3000],
    "notAvailableDuration": [0, 30000, 60000, 120000],
    "isolationLatencyMs": 20000,
    "lastReportWins": True,
}
SEED_ROUTE: dict[str, Any] = {
    "brokers": [
        {"brokerName": "broker-a", "writeQueueNums": 4, "address": "10.0.0.5:10911"},
        {"brokerName": "broker-b", "writeQueueNums": 2, "address": None},
    ]
}


State = dict[str, Any]


@dataclass(frozen=True)
class Raw:
    """A body sent as these exact bytes with ``content-type: application/json``."""

    data: bytes


# ---------------------------------------------------------------- helpers


def send(client: TestClient, method: str, path: str, body: Any = None) -> Response:
    if isinstance(body, Raw):
        return client.request(method, path, content=body.data, headers=JSON)
    if body is None:
        return client.request(method, path)
    return client.request(method, path, json=body)


def assert_error(r: Response, status: int, code: str, field: str | None) -> None:
    """The response is the Error schema with this status, code and field."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert isinstance(body, dict) and set(body) == {"error", "message", "field"}, body
    assert body["error"] == code, body
    assert isinstance(body["message"], str) and body["message"], body
    assert body["field"] == field, body


def snapshot(client: TestClient) -> State:
    """The shared state as an operator sees it; ``now`` is dropped from the fault items."""
    out: dict[str, Any] = {}
    for name, path in (("config", "/config"), ("routes", "/routes"), ("faults", "/fault-items")):
        r = client.get(path)
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        out[name] = r.json()
    out["faults"].pop("now")
    return out


def seed(client: TestClient) -> State:
    """A non-default config, a route, and one report that opens a 30 s window on broker-a.

    Returns the state that must then read back (what ``snapshot`` gives): every test
    compares against it after its bad requests, so a change made by any of them shows.
    """
    assert client.put("/config", json={**DEFAULT_CONFIG, **SEED_CONFIG}).status_code == 200
    assert client.put(f"/routes/{TOPIC}", json=SEED_ROUTE).status_code == 200
    r = client.post("/report-latency", json={"brokerName": "broker-a", "latencyMs": 600})
    assert r.status_code == 200 and r.json()["notAvailableDurationMs"] == 30000, r.text
    # why the window is open: this report (its time is the store's, read back once)
    why = client.get("/fault-items").json()["items"][0]["why"]
    assert (why["reason"], why["latencyMs"], why["by"]) == ("latency", 600, "")
    item = {
        "brokerName": "broker-a",
        "currentLatencyMs": 600,
        "availableAt": r.json()["availableAt"],
        "available": False,
        "probation": False,
        "reachable": None,
        "why": why,
    }
    return {
        "config": {**DEFAULT_CONFIG, **SEED_CONFIG, "profile": None},
        "routes": {"routes": [{"topic": TOPIC, **SEED_ROUTE}]},
        "faults": {"items": [item]},
    }


@pytest.fixture
def seeded_state(client: TestClient) -> State:
    return seed(client)


@pytest.fixture
def seeded(client: TestClient, seeded_state: State) -> TestClient:
    """The ``client`` after ``seed``; ``seeded_state`` is what it must still read back."""
    return client


@pytest.fixture
def roomy_client(settings: Settings) -> Iterator[TestClient]:
    """The app on the parametrized store with a 1 MiB body limit, for list-length limits."""
    roomy = settings.model_copy(update={"max_body_bytes": 1024 * 1024})
    with TestClient(create_app(roomy)) as c:
        seed(c)
        yield c


def padded_report(size: int) -> bytes:
    """A valid report for broker-c padded with whitespace to exactly ``size`` bytes.

    Were it accepted it would add a fault item, which the state snapshot would show.
    """
    head, tail = b'{"brokerName":"broker-c","latencyMs":5000', b"}"
    return head + b" " * (size - len(head) - len(tail)) + tail


def chunks(data: bytes, size: int = 16 * 1024) -> Iterator[bytes]:
    """A generator body: the TestClient streams it chunked, without Content-Length."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


# ---------------------------------------------------------------- tables


def report(**fields: Any) -> dict[str, Any]:
    return {"brokerName": "broker-a", "latencyMs": 120, **fields}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def nan_report(token: str) -> Raw:
    return Raw(b'{"brokerName":"a","latencyMs":' + token.encode() + b"}")


REPORT_CASES = [
    # latencyMs
    pytest.param(report(latencyMs=-1), "latencyMs", id="latency-negative"),
    pytest.param(report(latencyMs="120"), "latencyMs", id="latency-string"),
    pytest.param(report(latencyMs=None), "latencyMs", id="latency-null"),
    pytest.param(report(latencyMs=True), "latencyMs", id="latency-true"),
    pytest.param(report(latencyMs=[120]), "latencyMs", id="latency-list"),
    pytest.param(nan_report("NaN"), "latencyMs", id="latency-NaN"),
    pytest.param(nan_report("Infinity"), "latencyMs", id="latency-Infinity"),
    pytest.param(nan_report("-Infinity"), "latencyMs", id="latency-minus-Infinity"),
    pytest.param(nan_report("1e400"), "latencyMs", id="latency-1e400"),
    pytest.param(nan_report("1" + "0" * 400), "latencyMs", id="latency-401-digit-int"),
    pytest.param(report(latencyMs=3_600_001), "latencyMs", id="latency-3600001"),
    pytest.param(report(latencyMs=3_600_000.5), "latencyMs", id="latency-3600000.5"),
    pytest.param(report(latencyMs=10**30), "latencyMs", id="latency-1e30-int"),
    pytest.param(without(report(), "latencyMs"), "latencyMs", id="latency-missing"),
    # brokerName
    pytest.param(report(brokerName=""), "brokerName", id="broker-empty"),
    pytest.param(report(brokerName="b" * 10_000), "brokerName", id="broker-10000"),
    pytest.param(report(brokerName="b" * 128), "brokerName", id="broker-128"),
    pytest.param(report(brokerName="broker a"), "brokerName", id="broker-space"),
    pytest.param(report(brokerName="broker/a"), "brokerName", id="broker-slash"),
    pytest.param(report(brokerName="bröker-ä"), "brokerName", id="broker-unicode"),
    pytest.param(report(brokerName="broker-a\n"), "brokerName", id="broker-newline"),
    pytest.param(report(brokerName="a\u0000b"), "brokerName", id="broker-nul"),
    pytest.param(report(brokerName="a:b*"), "brokerName", id="broker-redis-glob"),
    # A lone surrogate is not Unicode text: decoded as FastAPI decodes every body (both
    # ways in), it is a string the model refuses, by name.
    pytest.param(
        Raw(b'{"brokerName":"\\ud800","latencyMs":1}'), "brokerName",
        id="broker-lone-surrogate",
    ),
    pytest.param(report(brokerName=123), "brokerName", id="broker-number"),
    pytest.param(report(brokerName=None), "brokerName", id="broker-null"),
    pytest.param(without(report(), "brokerName"), "brokerName", id="broker-missing"),
    # isolation and the rest of the body
    pytest.param(report(isolation="yes"), "isolation", id="isolation-yes"),
    pytest.param(report(isolation=1), "isolation", id="isolation-1"),
    pytest.param(report(isolation=None), "isolation", id="isolation-null"),
    pytest.param(report(extra=1), "extra", id="unknown-field"),
]

SELECT_QUEUES_4097 = [{"brokerName": "broker-a", "queueId": i % 1024} for i in range(4097)]


def sel(**fields: Any) -> dict[str, Any]:
    return {"topic": TOPIC, **fields}


def q(broker: str = "broker-a", queue_id: Any = 0) -> dict[str, Any]:
    return {"brokerName": broker, "queueId": queue_id}


SELECT_CASES = [
    pytest.param({}, 422, VE, "topic", id="topic-missing"),
    pytest.param(sel(topic=None), 422, VE, "topic", id="topic-null"),
    pytest.param(sel(topic=""), 422, VE, "topic", id="topic-empty"),
    pytest.param(sel(topic="t" * 128), 422, VE, "topic", id="topic-128"),
    pytest.param(sel(topic="t" * 10_000), 422, VE, "topic", id="topic-10000"),
    pytest.param(sel(topic="my topic"), 422, VE, "topic", id="topic-space"),
    pytest.param(sel(topic="a/b"), 422, VE, "topic", id="topic-slash"),
    pytest.param(sel(topic="tópico"), 422, VE, "topic", id="topic-unicode"),
    pytest.param(sel(topic=7), 422, VE, "topic", id="topic-number"),
    pytest.param(
        sel(lastBrokerName="b" * 10_000), 422, VE, "lastBrokerName", id="last-broker-10000"
    ),
    pytest.param(sel(lastBrokerName="a b"), 422, VE, "lastBrokerName", id="last-broker-space"),
    pytest.param(sel(queues=[]), 422, VE, "queues", id="queues-empty"),
    pytest.param(sel(queues="broker-a:0"), 422, VE, "queues", id="queues-string"),
    pytest.param(
        sel(queues=[q(queue_id=-1)]), 422, VE, "queues[0].queueId", id="queue-id-negative"
    ),
    pytest.param(
        sel(queues=[q(), q(queue_id=1024)]), 422, VE, "queues[1].queueId", id="queue-id-1024"
    ),
    pytest.param(sel(queues=[q(queue_id="0")]), 422, VE, "queues[0].queueId", id="queue-id-string"),
    pytest.param(sel(queues=[q(queue_id=0.5)]), 422, VE, "queues[0].queueId", id="queue-id-float"),
    pytest.param(
        sel(queues=[q(broker="")]), 422, VE, "queues[0].brokerName", id="queue-broker-empty"
    ),
    pytest.param(
        sel(queues=[{**q(), "address": "h:1"}]),
        422,
        VE,
        "queues[0].address",
        id="queue-unknown-field",
    ),
    pytest.param(sel(queues=SELECT_QUEUES_4097), 413, TL, "body", id="queues-4097-over-64KiB"),
    pytest.param(sel(weight=1), 422, VE, "weight", id="unknown-field"),
    pytest.param(sel(topic="no-such-topic"), 404, NF, "topic", id="unknown-topic-404"),
]


def broker(name: str = "broker-b", nums: Any = 2, **fields: Any) -> dict[str, Any]:
    return {"brokerName": name, "writeQueueNums": nums, **fields}


def route(*second: dict[str, Any]) -> dict[str, Any]:
    """A route whose first broker is valid, so the bad one is at index 1."""
    return {"brokers": [broker("broker-a", 4), *second]}


ROUTE_BODY_CASES = [
    pytest.param(route(broker(nums=0)), "brokers[1].writeQueueNums", id="wqn-0"),
    pytest.param(route(broker(nums=1025)), "brokers[1].writeQueueNums", id="wqn-1025"),
    pytest.param(route(broker(nums=-1)), "brokers[1].writeQueueNums", id="wqn-negative"),
    pytest.param(route(broker(nums=2.5)), "brokers[1].writeQueueNums", id="wqn-2.5"),
    pytest.param(route(broker(nums="4")), "brokers[1].writeQueueNums", id="wqn-string"),
    pytest.param(route(broker(nums=None)), "brokers[1].writeQueueNums", id="wqn-null"),
    pytest.param(route(broker(nums=10**30)), "brokers[1].writeQueueNums", id="wqn-1e30"),
    pytest.param(route({"brokerName": "broker-b"}), "brokers[1].writeQueueNums", id="wqn-missing"),
    pytest.param(route(broker(name="")), "brokers[1].brokerName", id="broker-empty"),
    pytest.param(route(broker(name="b" * 128)), "brokers[1].brokerName", id="broker-128"),
    pytest.param(route(broker(name="b c")), "brokers[1].brokerName", id="broker-space"),
    pytest.param(route(broker(address="nohost")), "brokers[1].address", id="address-no-port"),
    pytest.param(
        route(broker(address="a:99999999")), "brokers[1].address", id="address-8-digit-port"
    ),
    pytest.param(
        route(broker(address="h" * 296 + ":9876")), "brokers[1].address", id="address-300-chars"
    ),
    pytest.param(route(broker(address="http://a:1")), "brokers[1].address", id="address-url"),
    pytest.param(route(broker(address=10911)), "brokers[1].address", id="address-number"),
    pytest.param(
        route(broker(address="a:99999")), "brokers[1].address", id="address-port-over-65535"
    ),
    pytest.param(route(broker(extra=True)), "brokers[1].extra", id="broker-unknown-field"),
    pytest.param(route(broker("broker-a", 1)), "brokers", id="duplicate-broker"),
    pytest.param({"brokers": []}, "brokers", id="brokers-empty"),
    pytest.param(
        {"brokers": [broker(f"b{i}", 1) for i in range(257)]}, "brokers", id="brokers-257"
    ),
    pytest.param({"brokers": broker()}, "brokers", id="brokers-object"),
    pytest.param({}, "brokers", id="brokers-missing"),
    pytest.param({**route(), "topic": "other"}, "topic", id="unknown-field-topic"),
]

ROUTE_PATH_CASES = [
    pytest.param("t" * 10_000, id="topic-10000"),
    pytest.param("t" * 128, id="topic-128"),
    pytest.param("a%20b", id="topic-space"),
    pytest.param("%E2%82%AC", id="topic-euro"),
    pytest.param("a%00b", id="topic-nul"),
    pytest.param("a:b", id="topic-colon"),
    pytest.param("*", id="topic-star"),
]

ROUTE_PATH_METHOD_CASES = [
    *(pytest.param("PUT", p.values[0], id=f"PUT-{p.id}") for p in ROUTE_PATH_CASES),
    *(
        pytest.param(m, p.values[0], id=f"{m}-{p.id}")
        for m in ("GET", "DELETE")
        for p in ROUTE_PATH_CASES[:3]
    ),
]


def cfg(**fields: Any) -> dict[str, Any]:
    """A whole config (PUT takes no less) with ``fields`` changed."""
    return {**DEFAULT_CONFIG, **SEED_CONFIG, **fields}


def tiers(lm: list[Any], nad: list[Any] | None = None) -> dict[str, Any]:
    return cfg(latencyMax=lm, notAvailableDuration=nad if nad is not None else [0] * len(lm))


CONFIG_CASES = [
    pytest.param(tiers([50, 100, 550], [0, 0]), "notAvailableDuration", id="lengths-3-vs-2"),
    pytest.param(tiers([50, 100], [0, 0, 30000]), "notAvailableDuration", id="lengths-2-vs-3"),
    pytest.param(
        cfg(notAvailableDuration=[0]), "notAvailableDuration", id="lengths-seeded-latency-max"
    ),
    pytest.param(tiers([100, 100]), "latencyMax", id="latency-max-equal"),
    pytest.param(tiers([50, 550, 100]), "latencyMax", id="latency-max-decreasing"),
    pytest.param(tiers([], []), "latencyMax", id="latency-max-empty"),
    pytest.param(tiers([50], []), "notAvailableDuration", id="nad-empty"),
    pytest.param(tiers(list(range(33))), "latencyMax", id="33-tiers"),
    pytest.param(tiers([-1, 100]), "latencyMax[0]", id="latency-max-negative"),
    pytest.param(tiers([50, 100], [0, -5]), "notAvailableDuration[1]", id="nad-negative"),
    pytest.param(tiers([50, 3_600_001]), "latencyMax[1]", id="latency-max-over-hour"),
    pytest.param(tiers([50, 100], [0, 86_400_001]), "notAvailableDuration[1]", id="nad-over-day"),
    pytest.param(tiers([50.5, 100]), "latencyMax[0]", id="latency-max-float"),
    pytest.param(tiers([50, 100], [0, 1.5]), "notAvailableDuration[1]", id="nad-float"),
    pytest.param(tiers(["50", "100"]), "latencyMax[0]", id="latency-max-strings"),
    pytest.param(cfg(latencyMax="50,100"), "latencyMax", id="latency-max-string"),
    pytest.param(cfg(isolationLatencyMs=-1), "isolationLatencyMs", id="isolation-negative"),
    pytest.param(cfg(isolationLatencyMs=3_600_001), "isolationLatencyMs", id="isolation-over-hour"),
    pytest.param(cfg(isolationLatencyMs="30000"), "isolationLatencyMs", id="isolation-string"),
    pytest.param(cfg(isolationLatencyMs=1.5), "isolationLatencyMs", id="isolation-float"),
    pytest.param(cfg(latencymax=[50]), "latencymax", id="unknown-field-typo"),
    pytest.param(
        cfg(sendLatencyFaultEnable="true"), "sendLatencyFaultEnable", id="enable-string-true"
    ),
    pytest.param(cfg(sendLatencyFaultEnable=1), "sendLatencyFaultEnable", id="enable-1"),
    pytest.param(cfg(lastReportWins="false"), "lastReportWins", id="last-wins-string"),
]

BODY_ENDPOINTS = {
    "report": ("POST", "/report-latency"),
    "select": ("POST", "/select"),
    "route": ("PUT", f"/routes/{TOPIC}"),
    "config": ("PUT", "/config"),
}

#: Bodies wrong as a whole: field ``body``.
MALFORMED_BODIES: dict[str, Any] = {
    "empty": Raw(b""),
    "truncated": Raw(b'{"brokerName":"broker-a","latencyMs":1'),
    "trailing-comma": Raw(b'{"brokerName":"broker-a","latencyMs":1,}'),
    "single-quotes": Raw(b"{'brokerName': 'broker-a'}"),
    "not-utf8": Raw(b"\xff\xfe\x00{"),
    "whitespace": Raw(b"   "),
    "null": Raw(b"null"),
    "array": [{"brokerName": "broker-a", "latencyMs": 1}],
    "string": "broker-a",
    "number": 42,
    "true": True,
    "nested-20000-deep": Raw(b"[" * 20_000 + b"]" * 20_000),
    "5000-digit-int": Raw(b"1" * 5000),
}
#: Every malformed body on /report-latency; these on every other endpoint with a body.
MALFORMED_EVERYWHERE = ("empty", "truncated", "array", "nested-20000-deep", "5000-digit-int")
MALFORMED_CASES = [
    pytest.param(*BODY_ENDPOINTS[ep], body, id=f"{ep}-{name}")
    for ep in BODY_ENDPOINTS
    for name, body in MALFORMED_BODIES.items()
    if ep == "report" or name in MALFORMED_EVERYWHERE
]

#: Over the 64 KiB limit: just over on /report-latency, 2 MiB everywhere.
OVERSIZE_CASES = [
    pytest.param(*BODY_ENDPOINTS["report"], LIMIT + 1, id="report-64KiB+1"),
    *(pytest.param(*BODY_ENDPOINTS[ep], BIG, id=f"{ep}-2MiB") for ep in BODY_ENDPOINTS),
]

MISC_CASES = [
    pytest.param("GET", "/no-such-path", 404, NF, id="unknown-path"),
    # %2F is decoded before routing: /routes/a/b is simply an unknown path.
    pytest.param("PUT", "/routes/a%2Fb", 404, NF, id="route-encoded-slash"),
    pytest.param("POST", "/routes", 405, "METHOD_NOT_ALLOWED", id="post-routes"),
    pytest.param("GET", "/select", 405, "METHOD_NOT_ALLOWED", id="get-select"),
    pytest.param("POST", "/config", 405, "METHOD_NOT_ALLOWED", id="post-config"),
    pytest.param("DELETE", "/config", 405, "METHOD_NOT_ALLOWED", id="delete-config"),
    pytest.param("PATCH", f"/routes/{TOPIC}", 405, "METHOD_NOT_ALLOWED", id="patch-route"),
]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(("body", "field"), REPORT_CASES)
def test_report_latency_rejects(
    seeded: TestClient, seeded_state: State, body: Any, field: str
) -> None:
    assert_error(send(seeded, "POST", "/report-latency", body), 422, VE, field)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("body", "status", "code", "field"), SELECT_CASES)
def test_select_rejects(
    seeded: TestClient, seeded_state: State, body: Any, status: int, code: str, field: str
) -> None:
    assert_error(send(seeded, "POST", "/select", body), status, code, field)
    assert snapshot(seeded) == seeded_state


def test_select_4097_inline_queues_is_a_validation_error(roomy_client: TestClient) -> None:
    """Under a body limit that lets it through, the list length itself is refused."""
    before = snapshot(roomy_client)
    r = roomy_client.post("/select", json=sel(queues=SELECT_QUEUES_4097))
    assert_error(r, 422, VE, "queues")
    assert snapshot(roomy_client) == before
    ok = roomy_client.post("/select", json=sel(queues=SELECT_QUEUES_4097[:4096]))
    assert ok.status_code == 200, ok.text[:300]


@pytest.mark.parametrize(("body", "field"), ROUTE_BODY_CASES)
def test_put_route_rejects_body(
    seeded: TestClient, seeded_state: State, body: Any, field: str
) -> None:
    assert_error(send(seeded, "PUT", f"/routes/{TOPIC}", body), 422, VE, field)
    assert_error(send(seeded, "PUT", "/routes/fresh-topic", body), 422, VE, field)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("method", "topic"), ROUTE_PATH_METHOD_CASES)
def test_route_rejects_topic_path(
    seeded: TestClient, seeded_state: State, method: str, topic: str
) -> None:
    body = SEED_ROUTE if method == "PUT" else None
    assert_error(send(seeded, method, f"/routes/{topic}", body), 422, VE, "topic")
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_unknown_topic_is_not_found(seeded: TestClient, seeded_state: State, method: str) -> None:
    assert_error(send(seeded, method, "/routes/no-such-topic"), 404, NF, "topic")
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(
    ("name", "status", "code"),
    [
        pytest.param("no-such-broker", 404, NF, id="unknown-broker"),
        pytest.param("b" * 128, 422, VE, id="broker-128"),
        pytest.param("b" * 10_000, 422, VE, id="broker-10000"),
        pytest.param("a%20b", 422, VE, id="broker-space"),
        pytest.param("%C3%A4", 422, VE, id="broker-unicode"),
    ],
)
def test_delete_fault_item_rejects(
    seeded: TestClient, seeded_state: State, name: str, status: int, code: str
) -> None:
    assert_error(send(seeded, "DELETE", f"/fault-items/{name}"), status, code, "brokerName")
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("body", "field"), CONFIG_CASES)
def test_put_config_rejects(seeded: TestClient, seeded_state: State, body: Any, field: str) -> None:
    assert_error(send(seeded, "PUT", "/config", body), 422, VE, field)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("body", "field"), CONFIG_CASES)
def test_patch_config_rejects(
    seeded: TestClient, seeded_state: State, body: Any, field: str
) -> None:
    """The same bad values, as merge patches naming just them (and a field a patch must not
    name: an unknown one)."""
    whole = cfg()
    named = {k: v for k, v in body.items()
             if k not in whole or json.dumps(v) != json.dumps(whole[k]) or k in field}
    assert_error(send(seeded, "PATCH", "/config", named), 422, VE, field)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize("left_out", [["rampMs"], ["latencyMax", "notAvailableDuration"],
                                      [k for k in DEFAULT_CONFIG if k != "profile"]])
def test_put_config_that_leaves_fields_out_is_refused_naming_them(
    seeded: TestClient, seeded_state: State, left_out: list[str]
) -> None:
    """A PUT is a whole config: one that leaves fields out would put them back to their
    defaults, so it is refused, naming every one."""
    body = {k: v for k, v in cfg().items() if k not in left_out}
    r = send(seeded, "PUT", "/config", body)
    assert_error(r, 422, VE, left_out[0])
    assert all(name in r.json()["message"] for name in left_out)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("method", "path", "body"), MALFORMED_CASES)
def test_malformed_body_rejects(
    seeded: TestClient, seeded_state: State, method: str, path: str, body: Any
) -> None:
    assert_error(send(seeded, method, path, body), 422, VE, "body")
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(("method", "path", "status", "code"), MISC_CASES)
def test_unknown_path_and_wrong_method(
    seeded: TestClient, seeded_state: State, method: str, path: str, status: int, code: str
) -> None:
    assert_error(send(seeded, method, path, {"topic": TOPIC}), status, code, None)
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("method", "path", "size"), OVERSIZE_CASES)
def test_oversized_body_is_413(
    seeded: TestClient, seeded_state: State, method: str, path: str, size: int, chunked: bool
) -> None:
    """Refused up front by Content-Length, or while streaming when there is none.

    The body is a valid report padded with whitespace: accepting it would add broker-c.
    """
    data = padded_report(size)
    r = seeded.request(method, path, content=chunks(data) if chunked else data, headers=JSON)
    if chunked:
        assert "content-length" not in r.request.headers
        assert r.request.headers["transfer-encoding"] == "chunked"
    else:
        assert r.request.headers["content-length"] == str(size)
    assert_error(r, 413, TL, "body")
    assert snapshot(seeded) == seeded_state


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("POST", "/report-latency", report(brokerName="b" * 127), id="broker-127"),
        pytest.param("POST", "/report-latency", report(latencyMs=3_600_000), id="latency-hour"),
        pytest.param("POST", "/report-latency", report(latencyMs=0), id="latency-0"),
        pytest.param("POST", "/report-latency", Raw(padded_report(LIMIT)), id="body-64KiB"),
        pytest.param(
            "POST",
            "/select",
            sel(topic="t" * 127, queues=[q(queue_id=1023)]),
            id="topic-127-queue-1023",
        ),
        pytest.param(
            "PUT",
            "/routes/" + "t" * 127,
            {"brokers": [broker(f"b{i}", 1024 if i == 0 else 1) for i in range(256)]},
            id="route-256-brokers-one-with-1024-queues",
        ),
        pytest.param(
            "PUT", "/config", tiers(list(range(32)), [86_400_000] * 32), id="config-32-tiers"
        ),
    ],
)
def test_limits_themselves_are_accepted(
    client: TestClient, method: str, path: str, body: Any
) -> None:
    """The boundaries above are exact: the largest valid value still passes."""
    r = send(client, method, path, body)
    assert r.status_code == 200, r.text[:300]


def _all_bad_requests() -> list[tuple[str, str, Any]]:
    """Every table-driven bad request (the chunked ones are sent separately)."""
    out: list[tuple[str, str, Any]] = []
    out += [("POST", "/report-latency", p.values[0]) for p in REPORT_CASES]
    out += [("POST", "/select", p.values[0]) for p in SELECT_CASES]
    for path in (f"/routes/{TOPIC}", "/routes/fresh-topic"):
        out += [("PUT", path, p.values[0]) for p in ROUTE_BODY_CASES]
    out += [
        (m, f"/routes/{t}", SEED_ROUTE if m == "PUT" else None)
        for m, t in (p.values for p in ROUTE_PATH_METHOD_CASES)
    ]
    out += [("DELETE", "/routes/no-such-topic", None), ("GET", "/routes/no-such-topic", None)]
    out += [("DELETE", f"/fault-items/{n}", None) for n in ("zz", "a%20b", "b" * 128)]
    out += [("PUT", "/config", p.values[0]) for p in CONFIG_CASES]
    out += [tuple(p.values) for p in MALFORMED_CASES]
    out += [
        (m, path, Raw(padded_report(size))) for m, path, size in (p.values for p in OVERSIZE_CASES)
    ]
    out += [(m, path, {"topic": TOPIC}) for m, path, *_ in (p.values for p in MISC_CASES)]
    return out


def test_batch_of_bad_requests_changes_nothing_and_service_still_works(
    seeded: TestClient, seeded_state: State
) -> None:
    """All of the above in a row on one app: none is a 5xx or a success, nothing changes,
    and the service still takes a valid report and select afterwards."""
    before = snapshot(seeded)
    assert before == seeded_state
    wrong: list[tuple[str, str, int, str]] = []

    def check(method: str, path: str, r: Response) -> None:
        ok = 400 <= r.status_code < 500
        try:
            ok = ok and set(r.json()) == {"error", "message", "field"}
        except ValueError:
            ok = False
        if not ok:
            wrong.append((method, path[:60], r.status_code, r.text[:160]))

    requests = _all_bad_requests()
    assert len(requests) > 150
    for method, path, body in requests:
        check(method, path, send(seeded, method, path, body))
    for method, path, size in (p.values for p in OVERSIZE_CASES):
        r = seeded.request(method, path, content=chunks(padded_report(size)), headers=JSON)
        check(method, path, r)
    after = snapshot(seeded)

    # Not wedged: a valid report and select still work and see the seeded state.
    r = seeded.post("/report-latency", json={"brokerName": "broker-b", "latencyMs": 700})
    assert r.status_code == 200, r.text
    assert r.json()["notAvailableDurationMs"] == 30000
    r = seeded.post("/select", json={"topic": TOPIC})
    assert r.status_code == 200, r.text
    assert r.json()["decision"] == "pick_one_at_least"
    items = {i["brokerName"]: i for i in seeded.get("/fault-items").json()["items"]}
    assert items["broker-b"]["currentLatencyMs"] == 700 and not items["broker-b"]["available"]
    assert seeded.get("/readyz").status_code == 200

    assert after == before, f"state changed; bad requests not refused with a 4xx: {wrong}"
    assert wrong == [], "bad requests not refused with a 4xx Error body"


#: Nesting depth: every accepted body is at most 4 levels deep (no schema has a free-form
#: object and unknown fields are refused); the JSON parsers refuse documents past 200
#: levels before validation. Either way 422, never a 500 or a stack overflow.
DEPTH_CASES = [
    pytest.param(method, path, depth, id=f"{path}-depth-{depth}")
    for method, path in (*BODY_ENDPOINTS.values(), ("POST", "/report-latency:batch"))
    for depth in (40, 250, 20_000)
]


@pytest.mark.parametrize(("method", "path", "depth"), DEPTH_CASES)
def test_deeply_nested_json_is_refused(
    seeded: TestClient, seeded_state: State, method: str, path: str, depth: int
) -> None:
    nested = "[" * depth + "]" * depth
    whole = send(seeded, method, path, Raw(nested.encode()))
    assert_error(whole, 422, VE, "body")
    inside = send(seeded, method, path, Raw(('{"x":' + nested + "}").encode()))
    assert inside.status_code == 422 and inside.json()["error"] == VE
    assert snapshot(seeded) == seeded_state
