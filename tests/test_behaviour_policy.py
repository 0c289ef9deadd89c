"""The behaviour suite for the policy beyond RocketMQ (docs/policy.md), on both stores."""

from __future__ import annotations

import re
import socketserver
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from detour import policy
from service.app import create_app
from service.auth import Role, TokenEntry, TokenTable, hash_token
from service.settings import Settings
from tests.asgi_client import TestClient
from tests.procs import free_port, wait_until
from tests.test_behaviour import DEFAULT_CONFIG, items, put_route, select

pytestmark = pytest.mark.integration


def configure(client: TestClient, **fields: Any) -> dict[str, Any]:
    r = client.patch("/config", json=fields)
    assert r.status_code == 200, r.text
    return dict(r.json())


def fail(client: TestClient, broker: str, producer: str | None = None,
         origin: str | None = None, latency: float = 0) -> Any:
    body: dict[str, Any] = {"brokerName": broker, "latencyMs": latency, "isolation": True}
    if producer:
        body["producer"] = producer
    if origin:
        body["origin"] = origin
    r = client.post("/report-latency", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def metric(client: TestClient, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` (any namespace)."""
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m is None:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_defaults_keep_the_select_answer_rocketmq(client: TestClient) -> None:
    put_route(client, "t", {"a": 2, "b": 2})
    fail(client, "a")
    s = select(client, "t")
    assert (s["brokerName"], s["panic"], s["dryRun"], s["unenforcedBrokers"], s["ordered"],
            s["probe"]) == ("b", False, False, [], None, False)
    assert client.get("/config").json() == DEFAULT_CONFIG


# -- ordered messages -------------------------------------------------------------


@pytest.mark.parametrize("fallback", ["wait", "remap"])
def test_sharding_key_keeps_a_key_on_one_queue(client: TestClient, fallback: str) -> None:
    configure(client, orderedFallback=fallback)
    put_route(client, "t", {"a": 2, "b": 2, "c": 2})
    queues = [(b, q) for b in "abc" for q in range(2)]
    home = queues[policy.shard_index("order-42", 6)]
    picks = {(s["brokerName"], s["queueId"], s["ordered"]) for s in
             (select(client, "t", shardingKey="order-42") for _ in range(6))}
    assert picks == {(*home, "home")}
    before = metric(client, "detour_ordered_selects_total", placement=fallback)
    fail(client, home[0])
    s = select(client, "t", shardingKey="order-42")
    if fallback == "wait":
        assert (s["brokerName"], s["queueId"], s["ordered"]) == (*home, "wait")
        assert s["decision"] == "pick_one_at_least"
    else:
        i = queues.index(home)
        nxt = next(queues[(i + k) % 6] for k in range(1, 6) if queues[(i + k) % 6][0] != home[0])
        assert (s["brokerName"], s["queueId"], s["ordered"]) == (*nxt, "remap")
        assert s["avoidedBrokers"] == [home[0]]
        # Stable: the same key keeps going to the same queue.
        assert {(x["brokerName"], x["queueId"]) for x in
                (select(client, "t", shardingKey="order-42") for _ in range(4))} == {nxt}
    assert metric(client, "detour_ordered_selects_total", placement=fallback) >= before + 1


# -- limits and panic ---------------------------------------------------------------


def test_panic_threshold_spreads_over_every_broker(client: TestClient) -> None:
    configure(client, panicThresholdPercent=60)
    put_route(client, "t", {"a": 1, "b": 1})
    fail(client, "a")
    before = metric(client, "detour_avoidance_selects_total", outcome="panic")
    picks = [select(client, "t") for _ in range(6)]
    assert {p["brokerName"] for p in picks} == {"a", "b"}
    assert all(p["panic"] and p["unenforcedBrokers"] == ["a"] for p in picks)
    assert metric(client, "detour_avoidance_selects_total", outcome="panic") == before + 6
    configure(client, panicThresholdPercent=50)  # 1 of 2 available is not below 50 %
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}


def test_max_avoided_percent_serves_the_least_bad(client: TestClient) -> None:
    configure(client, maxAvoidedPercent=50)
    put_route(client, "t", {"a": 1, "b": 1, "c": 1, "d": 1})
    for broker, latency in (("a", 50), ("b", 10), ("c", 90)):
        fail(client, broker, latency=latency)
    before = metric(client, "detour_avoidance_selects_total", outcome="limited")
    picks = [select(client, "t") for _ in range(8)]
    assert {p["brokerName"] for p in picks} == {"b", "d"}
    assert all(p["unenforcedBrokers"] == ["b"] for p in picks)
    assert metric(client, "detour_avoidance_selects_total", outcome="limited") == before + 8


# -- dry run ------------------------------------------------------------------------------


def test_enforcement_percent_zero_is_a_dry_run(client: TestClient) -> None:
    configure(client, enforcementPercent=0)
    put_route(client, "t", {"a": 1, "b": 1})
    fail(client, "a")
    assert items(client)["a"]["available"] is False  # the window is opened...
    before = metric(client, "detour_avoidance_selects_total", outcome="dry_run")
    picks = [select(client, "t") for _ in range(6)]
    assert {p["brokerName"] for p in picks} == {"a", "b"}  # ...but not enforced
    assert all(p["dryRun"] and p["unenforcedBrokers"] == ["a"] for p in picks)
    assert metric(client, "detour_avoidance_selects_total", outcome="dry_run") == before + 6
    configure(client, enforcementPercent=50)
    outcome = Counter(select(client, "t")["dryRun"] for _ in range(200))
    assert 40 <= outcome[True] <= 160


# -- p2c-ewma ------------------------------------------------------------------------------


def test_p2c_ewma_prefers_the_faster_broker(client: TestClient) -> None:
    configure(client, selection="p2c-ewma")
    put_route(client, "t", {"fast": 2, "slow": 2})
    for _ in range(3):
        for broker, latency in (("fast", 5), ("slow", 400)):
            r = client.post("/report-latency", json={"brokerName": broker, "latencyMs": latency})
            assert r.status_code == 200
    picks = Counter(select(client, "t")["brokerName"] for _ in range(200))
    # Only a draw of two slow queues (2 of 12 ordered pairs) picks slow.
    assert picks["fast"] > 140 and picks["slow"] > 0
    fail(client, "fast")
    assert {select(client, "t")["brokerName"] for _ in range(10)} == {"slow"}


# -- quorum and error origin -----------------------------------------------------------------


def test_quorum_isolates_only_when_enough_producers_agree(client: TestClient) -> None:
    configure(client, isolationQuorum=2)
    put_route(client, "t", {"a": 2, "b": 2})
    before = metric(client, "detour_quorum_reports_total", broker="a", outcome="suspected")
    out = fail(client, "a", producer="p1", origin="local")
    assert out["notAvailableDurationMs"] == 0
    assert items(client)["a"]["available"] is True
    assert metric(client, "detour_quorum_reports_total", broker="a",
                  outcome="suspected") == before + 1
    # p1 keeps away from a; p2 and anonymous selects still use it.
    assert {select(client, "t", producer="p1")["brokerName"] for _ in range(6)} == {"b"}
    # A window that ended at the report (no window) ends on Redis's clock; a replica's
    # estimate of it errs early by up to one sync round trip (long on a busy machine), so it
    # may avoid the broker that long: poll, bounded. A wrongly opened window lasts 600 s.
    wait_until(lambda: {select(client, "t", producer="p2")["brokerName"]
                        for _ in range(6)} == {"a", "b"}, 15, "p2 using a")
    assert {select(client, "t")["brokerName"] for _ in range(6)} == {"a", "b"}
    # The same producer again is still one voter.
    assert fail(client, "a", producer="p1")["notAvailableDurationMs"] == 0
    out = fail(client, "a", producer="p2")
    assert out["notAvailableDurationMs"] == 600000
    assert items(client)["a"]["available"] is False
    assert {select(client, "t", producer="p2")["brokerName"] for _ in range(6)} == {"b"}
    assert metric(client, "detour_quorum_reports_total", broker="a", outcome="reached") >= 1


def test_broker_origin_failures_isolate_at_once(client: TestClient) -> None:
    configure(client, isolationQuorum=3)
    put_route(client, "t", {"a": 1, "b": 1})
    assert fail(client, "a", producer="p1", origin="broker")["notAvailableDurationMs"] == 600000
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}
    # A slow success is the broker's answer: tiers apply at once whatever the quorum.
    r = client.post("/report-latency", json={"brokerName": "b", "latencyMs": 600})
    assert r.json()["notAvailableDurationMs"] == 30000


# -- backoff and jitter ---------------------------------------------------------------------


def test_repeat_offender_windows_grow_and_are_capped(client: TestClient) -> None:
    configure(client, latencyMax=[0], notAvailableDuration=[150], repeatMultiplier=True,
              maxIsolationMs=400, repeatDecayMs=600000)
    durations = []
    for _ in range(3):
        durations.append(fail(client, "a")["notAvailableDurationMs"])
        # Window expiry is a time event with nothing to await: poll it, bounded.
        wait_until(lambda: items(client)["a"]["available"], 15, "window end")
    assert durations == [150, 300, 400]
    assert metric(client, "detour_broker_isolations", broker="a") == 3


def test_jitter_lengthens_isolation_windows(client: TestClient) -> None:
    configure(client, jitterPercent=50)
    lengths = {fail(client, b)["notAvailableDurationMs"] for b in ("a", "b", "c", "d", "e")}
    assert all(600000 <= d <= 900000 for d in lengths)
    assert len(lengths) > 1


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("selection", "random"), ("orderedFallback", "drop"), ("maxAvoidedPercent", 101),
     ("panicThresholdPercent", -1), ("enforcementPercent", 99.5), ("isolationQuorum", 0),
     ("isolationQuorum", 65), ("quorumWindowMs", 0), ("repeatMultiplier", "yes"),
     ("maxIsolationMs", 86_400_001), ("repeatDecayMs", 0), ("jitterPercent", 101),
     ("probeOnExpiry", 1), ("probeTimeoutMs", 0), ("detectorEnable", "on"),
     ("detectIntervalMs", 99), ("detectTimeoutMs", 0), ("detectTimeoutMs", 60_001)],
)
def test_bad_policy_config_is_422_naming_the_field(
    client: TestClient, field: str, value: object
) -> None:
    r = client.patch("/config", json={field: value})
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert client.get("/config").json() == DEFAULT_CONFIG


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [("/select", {"topic": "t", "shardingKey": ""}, "shardingKey"),
     ("/select", {"topic": "t", "producer": "a b"}, "producer"),
     ("/report-latency", {"brokerName": "a", "latencyMs": 1, "origin": "remote"}, "origin")],
)
def test_bad_policy_requests_are_422(client: TestClient, path: str, body: Any, field: str) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 422 and r.json()["field"] == field, r.text


# -- event log -------------------------------------------------------------------------------


def events(client: TestClient, **params: Any) -> Any:
    r = client.get("/events", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_event_log_records_every_window_change(client: TestClient) -> None:
    assert events(client) == {"events": [], "next": None}
    fail(client, "a", producer="p1")  # opened: isolation
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 600})  # opened: latency
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 1200})  # extended
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 10})  # nothing
    assert client.delete("/fault-items/a").status_code == 204  # ended: operator
    configure(client, lastReportWins=True)
    client.post("/report-latency", json={"brokerName": "b", "latencyMs": 10})  # ended: success
    configure(client, isolationQuorum=2)
    fail(client, "c", producer="p1")  # suspected: no event
    fail(client, "c", producer="p2")  # quorum
    page = events(client)
    got = [(e["kind"], e["reason"], e["brokerName"], e["tierMs"], e["reporters"])
           for e in page["events"]]
    assert got == [
        ("opened", "isolation", "a", 15000, 1),
        ("opened", "latency", "b", 550, 1),
        ("extended", "latency", "b", 1000, 1),
        ("ended", "operator", "a", None, 0),
        ("ended", "success", "b", None, 1),
        ("quorum", "quorum", "c", 15000, 2),
    ]
    opened = page["events"][0]
    assert opened["availableAt"] == opened["at"] + 600000
    # Paging: since the last id there is nothing more.
    assert events(client, since=page["next"]) == {"events": [], "next": None}
    first = events(client, limit=1)
    assert first["events"] == page["events"][:1]
    assert events(client, since=first["next"], limit=2)["events"] == page["events"][1:3]
    assert events(client, latest="true", limit=2)["events"] == page["events"][-2:]
    assert client.get("/events", params={"since": "x"}).json()["field"] == "since"
    assert metric(client, "detour_window_events_total", kind="quorum", reason="quorum") >= 1


# -- probation probe --------------------------------------------------------------------------


def test_probe_on_expiry(client: TestClient) -> None:
    configure(client, latencyMax=[100], notAvailableDuration=[150], probeOnExpiry=True,
              probeTimeoutMs=60000)
    put_route(client, "t", {"a": 2, "b": 2})
    sent = metric(client, "detour_probes_total", outcome="sent")
    fail(client, "a")
    # Window expiry is a time event with nothing to await: poll it, bounded. The select
    # judges on the replica's clock, which may see the end a round trip after the store.
    probes: list[Any] = []
    wait_until(lambda: probes.append(select(client, "t")) or probes[-1]["probe"], 15, "probe")
    probe = probes[-1]
    assert all(p["brokerName"] == "b" for p in probes[:-1])
    assert (probe["brokerName"], probe["probe"], probe["decision"]) == ("a", True, "available")
    # One probe: until it is reported, the others keep away.
    picks = [select(client, "t") for _ in range(6)]
    assert {p["brokerName"] for p in picks} == {"b"} and not any(p["probe"] for p in picks)
    assert metric(client, "detour_probes_total", outcome="sent") == sent + 1
    # Its success re-opens the broker to all.
    r = client.post("/report-latency", json={"brokerName": "a", "latencyMs": 0})
    assert r.status_code == 200
    # The success sets the window end to the store's now; a replica whose clock runs a
    # round trip behind sees it end that much later: poll, bounded.
    wait_until(lambda: {select(client, "t")["brokerName"] for _ in range(6)} == {"a", "b"},
               15, "a re-opened to all")
    kinds = [(e["kind"], e["reason"]) for e in events(client)["events"]]
    assert kinds[-1] == ("ended", "probe")
    assert metric(client, "detour_probes_total", outcome="passed") >= 1


def test_failed_probe_re_isolates(client: TestClient) -> None:
    # 1 s windows: the second (2 s) outlasts the four selects below on a busy machine.
    configure(client, latencyMax=[100], notAvailableDuration=[1000], probeOnExpiry=True,
              repeatMultiplier=True)
    put_route(client, "t", {"a": 1, "b": 1})
    fail(client, "a")
    wait_until(lambda: select(client, "t")["probe"], 15, "probe")
    out = fail(client, "a")
    assert out["notAvailableDurationMs"] == 2000  # backoff: the second isolation
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}
    assert [(e["kind"], e["reason"]) for e in events(client)["events"]][-1] == ("opened", "probe")
    assert metric(client, "detour_probes_total", outcome="failed") >= 1


# -- active detector -----------------------------------------------------------------------


class _Accepting(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Hangup(socketserver.BaseRequestHandler):
    def handle(self) -> None:  # accept, then close: all a detector needs
        self.request.close()


@pytest.fixture
def live_broker() -> Iterator[str]:
    """A real TCP server on 127.0.0.1 that accepts connections: a reachable broker."""
    server = _Accepting(("127.0.0.1", 0), _Hangup)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_detector_records_reachability_and_pick_one_at_least_prefers_it(
    client: TestClient, live_broker: str
) -> None:
    dead = f"127.0.0.1:{free_port()}"  # bound and closed again: connects are refused
    r = client.put("/routes/t", json={"brokers": [
        {"brokerName": "up", "writeQueueNums": 2, "address": live_broker},
        {"brokerName": "down", "writeQueueNums": 2, "address": dead},
        {"brokerName": "nameless", "writeQueueNums": 1}]})
    assert r.status_code == 200
    # Every broker fails; "down" reports the lowest latency, so RocketMQ would pick it.
    for broker, latency in (("up", 900), ("down", 5), ("nameless", 950)):
        fail(client, broker, latency=latency)
    assert select(client, "t")["brokerName"] == "down"
    checks = metric(client, "detour_detector_checks_total")
    configure(client, detectorEnable=True, detectIntervalMs=100, detectTimeoutMs=3000)
    wait_until(lambda: {b: i["reachable"] for b, i in items(client).items()} == {
        "up": True, "down": False, "nameless": None}, 10, "detector readings")
    picks = [select(client, "t") for _ in range(4)]
    assert {(p["brokerName"], p["decision"]) for p in picks} == {("up", "pick_one_at_least")}
    assert metric(client, "detour_detector_checks_total", result="reachable") >= 1
    assert metric(client, "detour_detector_checks_total", result="unreachable") >= 1
    assert metric(client, "detour_detector_checks_total") > checks


# -- quorum with tokens: the token is the voter ------------------------------------------------


def test_with_tokens_the_quorum_counts_tokens_not_producer_ids(settings: Settings) -> None:
    tokens = {"admin": ("tok-admin", Role.ADMIN), "p1": ("tok-p1", Role.PRODUCER),
              "p2": ("tok-p2", Role.PRODUCER)}
    table = TokenTable([TokenEntry(name=n, sha256=hash_token(t), role=r, namespace="default")
                        for n, (t, r) in tokens.items()])

    def h(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[name][0]}"}

    def failure(name: str, producer: str) -> int:
        r = client.post("/report-latency", headers=h(name), json={
            "brokerName": "a", "latencyMs": 0, "isolation": True, "producer": producer})
        assert r.status_code == 200, r.text
        return int(r.json()["notAvailableDurationMs"])

    with TestClient(create_app(settings, table)) as client:
        assert client.patch("/config", headers=h("admin"), json={"isolationQuorum": 2}).is_success
        client.put("/routes/t", headers=h("admin"), json={"brokers": [
            {"brokerName": "a", "writeQueueNums": 1}, {"brokerName": "b", "writeQueueNums": 1}]})
        # One token cannot make a quorum by inventing producer ids...
        assert [failure("p1", f"exec-{i}") for i in range(3)] == [0, 0, 0]
        # ...and its own selects avoid the broker whatever producer id they give.
        picks = {client.post("/select", headers=h("p1"), json={"topic": "t", "producer": p})
                 .json()["brokerName"] for p in ("exec-0", "other", None) for _ in range(2)}
        assert picks == {"b"}
        # (No window on the store's clock: the replica may see its end a round trip late.)
        wait_until(lambda: {client.post("/select", headers=h("p2"), json={"topic": "t"})
                            .json()["brokerName"] for _ in range(4)} == {"a", "b"}, 15,
                   "another token using a")
        # A second token makes it.
        assert failure("p2", "exec-0") == 600000


def test_integer_valued_numbers_are_integers(client: TestClient) -> None:
    """``100.0`` is the integer 100, as JSON Schema's ``integer`` says; a fraction is not."""
    r = client.patch("/config", json={"enforcementPercent": 100.0, "isolationQuorum": 2.0,
                                    "latencyMax": [50.0, 100], "notAvailableDuration": [0, 1e3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["enforcementPercent"] == 100 and body["isolationQuorum"] == 2
    assert body["latencyMax"] == [50, 100] and body["notAvailableDuration"] == [0, 1000]
    assert isinstance(body["notAvailableDuration"][1], int)


def test_a_tier_list_of_another_length_than_the_default_windows_is_422(
    client: TestClient,
) -> None:
    r = client.patch("/config", json={"latencyMax": [39]})
    assert r.status_code == 422 and r.json()["field"] == "notAvailableDuration", r.text
    assert client.get("/config").json() == DEFAULT_CONFIG
