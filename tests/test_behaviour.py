"""The behaviour suite: the HTTP contract, run against both stores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.app import create_app
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import wait_until

pytestmark = pytest.mark.integration

DEFAULT_CONFIG = {
    # The suite's tables start as exact RocketMQ 4.x (tests/conftest.py): GET /config
    # names the profile (a PUT may send it back; it is read only).
    "profile": "rocketmq-4",
    "sendLatencyFaultEnable": True,
    "latencyMax": [50, 100, 550, 1000, 2000, 3000, 15000],
    "notAvailableDuration": [0, 0, 30000, 60000, 120000, 180000, 600000],
    "isolationLatencyMs": 30000,
    "lastReportWins": False,
    # Policy beyond RocketMQ (docs/policy.md): every default is RocketMQ's behaviour.
    "selection": "round_robin",
    "orderedFallback": "wait",
    "maxAvoidedPercent": 100,
    "panicThresholdPercent": 0,
    "enforcementPercent": 100,
    "isolationQuorum": 1,
    "quorumWindowMs": 60000,
    "latencyQuorum": 1,
    "repeatMultiplier": False,
    "maxIsolationMs": 3600000,
    "repeatDecayMs": 600000,
    "jitterPercent": 0,
    "probeOnExpiry": False,
    "probeTimeoutMs": 10000,
    "detectorEnable": False,
    "detectIntervalMs": 2000,
    "detectTimeoutMs": 200,
    "rampMs": 0,
    "earlyRecovery": False,
    "pendingQuorum": 0,
}


def put_route(client: TestClient, topic: str, brokers: dict[str, int]) -> dict[str, Any]:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": n} for b, n in brokers.items()]}
    r = client.put(f"/routes/{topic}", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def report(client: TestClient, broker: str, latency: float, isolation: bool = False) -> Any:
    r = client.post(
        "/report-latency", json={"brokerName": broker, "latencyMs": latency, "isolation": isolation}
    )
    assert r.status_code == 200, r.text
    return r.json()


def select(client: TestClient, topic: str, last: str | None = None, **extra: Any) -> Any:
    r = client.post("/select", json={"topic": topic, "lastBrokerName": last, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def store_now(client: TestClient) -> int:
    """The table's clock now (Redis's own, for a Redis store): a bound for what came before."""
    return int(client.get("/fault-items").json()["now"])


def window_floor(client: TestClient) -> int:
    """The earliest a report sent next may be dated. A Redis store dates a report when it
    accepts it, on its estimate of Redis's clock: a lower bound that never goes back
    (``RedisClock``), so a reading taken now bounds the date from below, where Redis's
    own clock, read a moment earlier, can be a few ms ahead of that estimate."""
    return min(store_now(client), client.app_state["store"].view.now_ms())


def items(client: TestClient) -> dict[str, Any]:
    return {i["brokerName"]: i for i in client.get("/fault-items").json()["items"]}


# -- routes -------------------------------------------------------------------


def test_route_crud_and_ordering(client: TestClient) -> None:
    out = client.put(
        "/routes/orders",
        json={"brokers": [
            {"brokerName": "broker-b", "writeQueueNums": 2},
            {"brokerName": "broker-a", "writeQueueNums": 3, "address": "10.0.0.5:10911"},
        ]},
    ).json()
    assert out == {
        "topic": "orders",
        "brokers": [
            {"brokerName": "broker-a", "writeQueueNums": 3, "address": "10.0.0.5:10911"},
            {"brokerName": "broker-b", "writeQueueNums": 2, "address": None},
        ],
    }
    assert client.get("/routes/orders").json() == out
    put_route(client, "audit", {"broker-c": 1})
    assert [r["topic"] for r in client.get("/routes").json()["routes"]] == ["audit", "orders"]
    # The queue order is brokerName, then queueId: consecutive selects walk it cyclically.
    order = [("broker-a", 0), ("broker-a", 1), ("broker-a", 2), ("broker-b", 0), ("broker-b", 1)]
    seen = [(s["brokerName"], s["queueId"]) for s in (select(client, "orders") for _ in range(10))]
    first = order.index(seen[0])
    assert seen == [order[(first + i) % 5] for i in range(10)]
    picks = [select(client, "orders") for _ in range(5)]
    addresses = {s["brokerName"]: s["address"] for s in picks}
    assert addresses == {"broker-a": "10.0.0.5:10911", "broker-b": None}

    assert client.delete("/routes/audit").status_code == 204
    assert client.get("/routes/audit").status_code == 404
    r = client.delete("/routes/audit")
    assert r.status_code == 404 and r.json()["error"] == "NOT_FOUND"


def test_put_route_replaces(client: TestClient) -> None:
    put_route(client, "t", {"a": 4, "b": 4})
    put_route(client, "t", {"c": 1})
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"c"}


def test_unknown_topic_is_404(client: TestClient) -> None:
    r = client.post("/select", json={"topic": "nope"})
    assert r.status_code == 404
    assert r.json() == {"error": "NOT_FOUND", "message": "no route for topic 'nope'",
                        "field": "topic"}


def test_inline_queues_need_no_route(client: TestClient) -> None:
    queues = [{"brokerName": "x", "queueId": 1}, {"brokerName": "w", "queueId": 0},
              {"brokerName": "x", "queueId": 1}]
    picks = {(s["brokerName"], s["queueId"]) for s in
             (select(client, "adhoc", queues=queues) for _ in range(4))}
    assert picks == {("w", 0), ("x", 1)}
    report(client, "x", 0, isolation=True)
    assert {select(client, "adhoc", queues=queues)["brokerName"] for _ in range(4)} == {"w"}


# -- reports and tiers ----------------------------------------------------------


@pytest.mark.parametrize(
    ("latency", "isolation", "duration"),
    [(0, False, 0), (49, False, 0), (100, False, 0), (549, False, 0), (549.9, False, 0),
     (550, False, 30000), (999, False, 30000), (1000, False, 60000), (2000, False, 120000),
     (3000, False, 180000), (14999, False, 180000), (15000, False, 600000),
     (3_600_000, False, 600000), (5, True, 600000)],
)
def test_report_tiers(client: TestClient, latency: float, isolation: bool, duration: int) -> None:
    before = window_floor(client)
    out = report(client, "broker-a", latency, isolation)
    after = store_now(client)
    assert out["brokerName"] == "broker-a"
    assert out["latencyMs"] == int(latency)
    assert out["notAvailableDurationMs"] == duration
    assert before + duration <= out["availableAt"] <= after + duration
    item = items(client)["broker-a"]
    assert item["currentLatencyMs"] == int(latency)
    assert item["availableAt"] == out["availableAt"]
    assert item["available"] is (duration == 0)


def test_extend_rule_keeps_an_isolation(client: TestClient) -> None:
    end = report(client, "a", 10, isolation=True)["availableAt"]
    out = report(client, "a", 10)
    assert out["notAvailableDurationMs"] == 0
    assert out["availableAt"] == end
    item = items(client)["a"]
    why = item.pop("why")  # the isolation's: a later fast report leaves it
    assert (why["reason"], why["latencyMs"]) == ("isolation", 10)
    assert item == {"brokerName": "a", "currentLatencyMs": 10, "availableAt": end,
                    "available": False, "probation": False, "reachable": None}
    # A shorter window never shortens a longer one; a longer one extends it.
    assert report(client, "a", 600)["availableAt"] == end
    assert report(client, "a", 10, isolation=True)["availableAt"] >= end


def test_last_report_wins_clears_an_isolation(client: TestClient) -> None:
    assert client.patch("/config", json={"lastReportWins": True}).status_code == 200
    report(client, "a", 10, isolation=True)
    before = window_floor(client)
    out = report(client, "a", 10)
    assert before <= out["availableAt"] <= store_now(client)
    assert items(client)["a"]["available"] is True


def test_window_ends_and_broker_returns(client: TestClient) -> None:
    # 2 s: long enough that the four selects below come before the end on a busy machine.
    client.patch("/config", json={"latencyMax": [0, 100], "notAvailableDuration": [0, 2000]})
    put_route(client, "t", {"a": 1, "b": 1})
    report(client, "a", 150)
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}
    # Window expiry is a time event with nothing to await: poll it, bounded.
    wait_until(lambda: select(client, "t", last="b")["brokerName"] == "a", 15, "window end")
    assert items(client)["a"]["available"] is True


# -- select -----------------------------------------------------------------------


def test_avoided_broker_is_skipped_and_listed(client: TestClient) -> None:
    put_route(client, "t", {"a": 4, "b": 4})
    report(client, "a", 0, isolation=True)
    picks = [select(client, "t") for _ in range(40)]
    assert {p["brokerName"] for p in picks} == {"b"}
    assert all(p["decision"] == "available" for p in picks)
    # Each walk that met broker a says so; the spread over b's queues stays even.
    assert any(p["avoidedBrokers"] == ["a"] for p in picks)
    assert all(p["avoidedBrokers"] in ([], ["a"]) for p in picks)
    counts = {q: sum(1 for p in picks if p["queueId"] == q) for q in range(4)}
    assert counts == {0: 10, 1: 10, 2: 10, 3: 10}


def test_retry_avoids_last_broker(client: TestClient) -> None:
    put_route(client, "t", {"a": 2, "b": 2, "c": 2})
    for _ in range(12):
        assert select(client, "t", last="b")["brokerName"] != "b"


def test_retry_falls_back_to_last_broker_when_it_is_the_only_available(
    client: TestClient,
) -> None:
    put_route(client, "t", {"a": 2, "b": 2})
    report(client, "b", 0, isolation=True)
    for _ in range(4):
        s = select(client, "t", last="a")
        assert (s["brokerName"], s["decision"]) == ("a", "available")


def test_pick_one_at_least_uses_the_better_half(client: TestClient) -> None:
    put_route(client, "t", {"a": 2, "b": 2, "c": 2, "d": 2})
    for broker, latency in (("c", 30), ("a", 40), ("d", 10), ("b", 20)):
        report(client, broker, latency, isolation=True)
    picks = [select(client, "t") for _ in range(16)]
    assert {p["decision"] for p in picks} == {"pick_one_at_least"}
    # Ranked by latency: d(10), b(20) | c, a. The better half shares the picks evenly,
    # over every one of their queues.
    pairs = [(p["brokerName"], p["queueId"]) for p in picks]
    assert {b for b, _ in pairs} == {"b", "d"}
    assert {pair: pairs.count(pair) for pair in set(pairs)} == {
        ("b", 0): 4, ("b", 1): 4, ("d", 0): 4, ("d", 1): 4}
    for p in picks:
        assert sorted(p["avoidedBrokers"]) == sorted({"a", "b", "c", "d"} - {p["brokerName"]})


def test_single_broker_all_avoided_still_answers(client: TestClient) -> None:
    put_route(client, "t", {"only": 3})
    report(client, "only", 0, isolation=True)
    s = select(client, "t", last="only")
    assert (s["brokerName"], s["decision"], s["avoidedBrokers"]) == (
        "only", "pick_one_at_least", [])


def test_avoidance_off_is_plain_round_robin(client: TestClient) -> None:
    put_route(client, "t", {"a": 2, "b": 2})
    end = report(client, "a", 0, isolation=True)["availableAt"]
    assert client.patch("/config", json={"sendLatencyFaultEnable": False}).status_code == 200
    picks = [select(client, "t") for _ in range(8)]
    assert {p["decision"] for p in picks} == {"round_robin"}
    assert {p["brokerName"] for p in picks} == {"a", "b"}
    assert all(p["avoidedBrokers"] == [] for p in picks)
    for _ in range(4):
        assert select(client, "t", last="a")["brokerName"] == "b"
    # Reports are accepted but change no window.
    out = report(client, "b", 0, isolation=True)
    assert out["notAvailableDurationMs"] == 0
    assert "b" not in items(client)
    assert report(client, "a", 5)["availableAt"] == end
    assert items(client)["a"]["currentLatencyMs"] == 0


# -- config and fault items --------------------------------------------------------


def test_config_defaults_patch_and_replace(client: TestClient) -> None:
    assert client.get("/config").json() == DEFAULT_CONFIG
    custom = {"latencyMax": [10, 20], "notAvailableDuration": [5, 6], "isolationLatencyMs": 25}
    out = client.patch("/config", json=custom).json()
    assert out == {**DEFAULT_CONFIG, **custom, "profile": None}
    assert client.get("/config").json() == out
    assert report(client, "a", 0, isolation=True)["notAvailableDurationMs"] == 6
    # PATCH changes what it names, nothing else; null puts a field back to its default
    merge_patch = {"Content-Type": "application/merge-patch+json"}
    after = client.patch("/config", json={"lastReportWins": True, "isolationLatencyMs": None},
                         headers=merge_patch).json()
    assert after == {**out, "lastReportWins": True, "isolationLatencyMs": 30000}
    # PUT replaces the whole config, and takes nothing less
    assert client.put("/config", json={"lastReportWins": False}).status_code == 422
    assert client.get("/config").json() == after
    assert client.put("/config", json=DEFAULT_CONFIG).json() == DEFAULT_CONFIG


def test_operator_restores_a_broker(client: TestClient) -> None:
    put_route(client, "t", {"a": 1, "b": 1})
    report(client, "a", 0, isolation=True)
    report(client, "b", 20)
    listed = client.get("/fault-items").json()["items"]
    assert [i["brokerName"] for i in listed] == ["a", "b"]
    assert [i["available"] for i in listed] == [False, True]
    assert client.delete("/fault-items/a").status_code == 204
    assert "a" not in items(client)
    # A window that ended at the report (no window) ends on Redis's clock; a replica's
    # estimate of it errs early by up to one sync round trip (long on a busy machine), so it
    # may avoid the broker that long: poll, bounded. A wrongly opened window lasts 600 s.
    wait_until(lambda: {select(client, "t")["brokerName"] for _ in range(4)} == {"a", "b"}, 15,
               "both brokers in use")
    r = client.delete("/fault-items/a")
    assert r.status_code == 404 and r.json()["field"] == "brokerName"


def test_health(client: TestClient, store_kind: str) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "store": store_kind,
                                             "degraded": False}
    assert client.get("/readyz").json() == {"status": "ready", "store": store_kind,
                                            "degraded": False}


# -- batch reports ---------------------------------------------------------------


def test_batch_applies_in_order(client: TestClient) -> None:
    before = window_floor(client)
    r = client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "a", "latencyMs": 600},
        {"brokerName": "b", "latencyMs": 10},
        {"brokerName": "a", "latencyMs": 20, "isolation": True},
    ]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [(x["brokerName"], x["latencyMs"], x["notAvailableDurationMs"]) for x in results] == [
        ("a", 600, 30000), ("b", 10, 0), ("a", 20, 600000)]
    assert results[2]["availableAt"] >= before + 600000
    table = items(client)
    assert table["a"]["currentLatencyMs"] == 20 and table["a"]["available"] is False
    assert table["b"]["available"] is True


def test_batch_age_dates_the_window_from_the_send(client: TestClient) -> None:
    now = window_floor(client)
    r = client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "a", "latencyMs": 0, "isolation": True, "ageMs": 590000},
        {"brokerName": "b", "latencyMs": 0, "isolation": True, "ageMs": 700000},
    ]}).json()["results"]
    # a failed 590 s ago: 10 s of its 600 s window are left. b's window is over already.
    assert now + 10000 <= r[0]["availableAt"] <= store_now(client) + 10000
    assert r[1]["availableAt"] <= store_now(client)
    assert items(client)["b"]["available"] is True


def test_batch_takes_a_larger_body_and_caps_the_count(client: TestClient) -> None:
    name = "b" * 120
    reports = [{"brokerName": f"{name}{i % 7}", "latencyMs": i % 500} for i in range(1000)]
    r = client.post("/report-latency:batch", json={"reports": reports})
    assert r.status_code == 200, r.text[:200]
    assert len(r.json()["results"]) == 1000
    r = client.post("/report-latency:batch", json={"reports": reports + reports[:1]})
    assert r.status_code == 422 and r.json()["field"] == "reports"
    assert client.post("/report-latency:batch", json={"reports": []}).json()["field"] == "reports"


# -- latency log -------------------------------------------------------------------


@pytest.fixture
def every_report(settings: Settings) -> Iterator[TestClient]:
    """The app writing every report at once (``report_flush_ms`` 0): the per-report log."""
    with TestClient(create_app(settings.model_copy(update={"report_flush_ms": 0}))) as c:
        yield c


def test_latency_log_records_every_report_in_order(every_report: TestClient) -> None:
    client = every_report
    before = window_floor(client)
    client.post("/report-latency", json={"brokerName": "a", "latencyMs": 12.7,
                                         "producer": "exec-1"})
    client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "b", "latencyMs": 30, "isolation": True, "ageMs": 5000},
        {"brokerName": "a", "latencyMs": 40},
    ]})
    client.patch("/config", json={"sendLatencyFaultEnable": False})
    client.post("/report-latency", json={"brokerName": "c", "latencyMs": 1})
    page = client.get("/latency-log", params={"limit": 2}).json()
    rest = client.get("/latency-log", params={"after": page["next"]}).json()
    entries = page["entries"] + rest["entries"]
    assert [(e["brokerName"], e["latencyMs"], e["isolation"], e["producer"]) for e in entries] == [
        ("a", 12, False, "exec-1"), ("b", 30, True, ""), ("a", 40, False, ""), ("c", 1, False, "")]
    assert before - 5000 <= entries[1]["at"] <= store_now(client) - 5000
    assert all(before <= e["at"] <= store_now(client) for e in entries if e["brokerName"] != "b")
    last = client.get("/latency-log", params={"after": rest["next"]}).json()
    assert last == {"entries": [], "next": None}
    bad = client.get("/latency-log", params={"after": "x"})
    assert bad.status_code == 422 and bad.json()["field"] == "after"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON"])
def test_json_bodies_are_served(client: TestClient, content_type: str) -> None:
    headers = {"content-type": content_type}
    r = client.put("/routes/t", content=b'{"brokers":[{"brokerName":"a","writeQueueNums":1}]}',
                   headers=headers)
    assert r.status_code == 200, r.text
    r = client.post("/report-latency", content=b'{"brokerName":"a","latencyMs":1}',
                    headers=headers)
    assert r.status_code == 200, r.text
    r = client.post("/select", content=b'{"topic":"t"}', headers=headers)
    assert r.status_code == 200 and r.json()["brokerName"] == "a"


def test_avoided_brokers_names_what_this_select_crossed_not_every_avoided_broker(
    client: TestClient,
) -> None:
    """`avoidedBrokers` flips between [] and ["broker-a"] while broker-a stays avoided: a
    select lists it only when its walk crosses broker-a's queues, and the crossing moves the
    counter past them. 4 brokers of 4 queues, one avoided: exactly one select in every 12
    (openapi.yaml and docs/clients.md say so)."""
    put_route(client, "flip", {f"broker-{c}": 4 for c in "abcd"})
    report(client, "broker-a", 0, isolation=True)
    answers = [select(client, "flip") for _ in range(120)]
    assert all(a["brokerName"] != "broker-a" for a in answers)
    lists = [a["avoidedBrokers"] for a in answers]
    assert {tuple(x) for x in lists} == {(), ("broker-a",)}
    # exactly one in every 12: crossings 12 selects apart (9 or 10 of 120, by where the
    # topic's random starting counter put the first one)
    crossings = [i for i, x in enumerate(lists) if x == ["broker-a"]]
    assert len(crossings) in (9, 10) and crossings[0] <= 12
    assert {b - a for a, b in zip(crossings, crossings[1:], strict=False)} == {12}
    assert items(client)["broker-a"]["available"] is False  # where every window is listed
    doc = client.get("/openapi.json").json()["components"]["schemas"]["SelectResponse"]
    assert "one select in 12" in doc["properties"]["avoidedBrokers"]["description"]
