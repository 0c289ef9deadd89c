"""latencyQuorum: a slow answer opens its tier's window for the reporting producer alone
until enough distinct producers agree (docs/policy.md, "Local noise: latencyQuorum").

Pure properties first (the rule and the select), then the API on both stores.
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detour import policy
from detour.apply import Effect
from detour.client import DetourClient
from detour.decide import Ask, Table, decide
from detour.model import BrokerRoute, Config, FaultItem, Route
from service.store import codec
from tests.asgi_client import TestClient
from tests.budget import examples
from tests.procs import ServiceProcess, wait_until
from tests.rule import applied
from tests.test_behaviour import items, put_route, select
from tests.test_behaviour_policy import configure, metric

NOW = 1_764_000_000_000
ROUTE = Route.from_brokers("t", [BrokerRoute(b, 2, None) for b in ("a", "b", "c", "d")])


def slow(config: Config, old: FaultItem | None, producer: str, latency: int = 795,
         at: int = NOW, origin: str | None = None) -> Effect:
    return applied(old, "d", latency, False, origin, producer, at, at, config)


# -- pure ---------------------------------------------------------------------------------


@settings(max_examples=examples(), deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(("p1", "p2", "p3", "")), st.integers(0, 9_000)),
             min_size=1, max_size=8),
    st.sampled_from((551, 795, 1200, 2500)),
)
def test_quorum_one_is_rocketmq(reports: list[tuple[str, int]], latency: int) -> None:
    """latencyQuorum 1 (the default): every slow answer opens its tier's window for all,
    exactly as without the field; nothing is kept per producer."""
    item: FaultItem | None = None
    plain: FaultItem | None = None
    for producer, dt in reports:
        out = slow(Config(), item, producer, latency, NOW + dt)
        ref = applied(plain, "d", latency, False, None, producer, NOW + dt, NOW + dt,
                           Config(isolation_quorum=1))
        assert out == ref
        assert not out.suspected and out.item.slow == ()
        assert out.duration_ms > 0
        item = plain = out.item


@settings(max_examples=examples(), deadline=None)
@given(
    st.integers(2, 4),
    st.lists(st.tuples(st.sampled_from(("p1", "p2", "p3", "p4")), st.integers(0, 5_000)),
             min_size=1, max_size=10),
)
def test_window_opens_for_all_exactly_when_the_quorum_agrees(
    quorum: int, reports: list[tuple[str, int]]
) -> None:
    """Short of the quorum the shared window stays shut and each reporter avoids the broker
    alone; the report that brings the distinct voters to the quorum opens it for all."""
    config = Config(latency_quorum=quorum)
    item: FaultItem | None = None
    voters: set[str] = set()
    t = NOW
    for producer, dt in reports:
        t += dt
        out = slow(config, item, producer, at=t)
        voters.add(producer)
        if len(voters) >= quorum:
            assert out.quorum_reached and out.reporters == len(voters)
            assert out.item.available_at == t + 30_000 and out.item.slow == ()
            return
        assert out.suspected and out.duration_ms == 0
        assert out.item.available_at <= t  # nothing shared
        local = policy.producer_windows({"d": out.item}, producer, config)
        assert local == {"d": max(e for p, _, e in out.item.slow if p == producer)}
        assert local["d"] >= t + 30_000
        for other in {"p1", "p2", "p3", "p4"} - voters:
            assert policy.producer_windows({"d": out.item}, other, config) == {}
        # the stored form carries the votes: a replica and the SDK read them back
        assert codec.decode_fault("d", codec.encode_fault(out.item)) == out.item
        item = out.item


@settings(max_examples=examples(), deadline=None)
@given(
    st.integers(2, 4),
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 40_000), st.sampled_from((0, 80, 600, 1500, 2500, 20_000)),
                       st.booleans()), min_size=1, max_size=10),
)
def test_a_single_producer_decides_as_with_rocketmqs_table(
    quorum: int, last_report_wins: bool, reports: list[tuple[int, int, bool]]
) -> None:
    """One producer alone: whatever latencyQuorum is, its selects pick what they pick with
    the quorum at 1 (RocketMQ's own table, fed by its own reports), after every report,
    under either update rule."""
    rocketmq = Config(last_report_wins=last_report_wins)
    mine = Config(last_report_wins=last_report_wins, latency_quorum=quorum)
    ref: FaultItem | None = None
    item: FaultItem | None = None
    t = NOW
    for dt, latency, isolation in reports:
        t += dt
        ref = applied(ref, "d", latency, isolation, None, "p1", t, t, rocketmq).item
        item = applied(item, "d", latency, isolation, None, "p1", t, t, mine).item
        for later in (t, t + 29_999, t + 30_001):
            for counter in range(8):
                a = decide(Table(ROUTE, rocketmq, {"d": ref}, counter, later), Ask(producer="p1"))
                b = decide(Table(ROUTE, mine, {"d": item}, counter, later), Ask(producer="p1"))
                assert a.selection.queue == b.selection.queue, (later - t, counter)
                assert a.selection.next_counter == b.selection.next_counter


def test_votes_older_than_the_quorum_window_do_not_count() -> None:
    config = Config(latency_quorum=2, quorum_window_ms=10_000)
    first = slow(config, None, "p1")
    late = slow(config, first.item, "p2", at=NOW + 10_001)
    assert late.suspected and late.item.available_at <= NOW + 10_001
    # p1's own window (30 s) still lasts, so its entry is kept for its selects
    assert {p for p, _, _ in late.item.slow} == {"p1", "p2"}
    soon = slow(config, first.item, "p2", at=NOW + 9_999)
    assert soon.quorum_reached and soon.item.available_at == NOW + 9_999 + 30_000


def test_broker_origin_and_failures_do_not_wait_for_the_latency_quorum() -> None:
    config = Config(latency_quorum=3)
    assert slow(config, None, "p1", origin="broker").item.available_at == NOW + 30_000
    failure = applied(None, "d", 0, True, None, "p1", NOW, NOW, config)
    assert failure.item.available_at == NOW + 600_000
    fast = slow(config, None, "p1", latency=80)  # below every tier with a window
    assert not fast.suspected and fast.item.slow == ()


def test_votes_are_bounded() -> None:
    """Entries outlive their vote while their producer's window lasts: at most
    MAX_SUSPECTS of the newest are kept."""
    config = Config(latency_quorum=2, quorum_window_ms=1)
    item: FaultItem | None = None
    for i in range(policy.MAX_SUSPECTS + 40):
        item = slow(config, item, f"p{i}", latency=20_000, at=NOW + 2 * i).item
    assert item is not None and len(item.slow) == policy.MAX_SUSPECTS


def test_the_select_avoids_the_slow_broker_for_its_reporter_only() -> None:
    """decide(): the reporter keeps away from d; every other producer (and an anonymous
    select) still gets it: the cold send starves no one else."""
    config = Config(latency_quorum=2)
    item = slow(config, None, "p1").item
    table = Table(ROUTE, config, {"d": item}, 0, NOW + 1)
    for producer, expect in (("p1", {"a", "b", "c"}), ("p2", {"a", "b", "c", "d"}),
                             (None, {"a", "b", "c", "d"})):
        seen = set()
        counter = 0
        for _ in range(8):
            choice = decide(table._replace(counter=counter), Ask(producer=producer))
            seen.add(choice.selection.queue.broker_name)
            counter = choice.selection.next_counter
        assert seen == expect, producer
    # after its own window, p1 gets d again
    later = Table(ROUTE, config, {"d": item}, 0, NOW + 30_001)
    got = {decide(later._replace(counter=c), Ask(producer="p1")).selection.queue.broker_name
           for c in range(8)}
    assert "d" in got


# -- API, both stores ------------------------------------------------------------------------


def report(client: TestClient, broker: str, latency: int, producer: str) -> dict[str, object]:
    r = client.post("/report-latency",
                    json={"brokerName": broker, "latencyMs": latency, "producer": producer})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.integration
def test_a_cold_send_starves_no_other_producer(client: TestClient) -> None:
    configure(client, latencyQuorum=2)
    put_route(client, "t", {"a": 2, "b": 2, "c": 2, "d": 2})
    before = metric(client, "detour_quorum_reports_total", broker="d", outcome="suspected")
    out = report(client, "d", 795, "p1")
    assert out["notAvailableDurationMs"] == 0
    assert items(client)["d"]["available"] is True
    assert metric(client, "detour_quorum_reports_total", broker="d",
                  outcome="suspected") == before + 1
    assert {select(client, "t", producer="p1")["brokerName"] for _ in range(8)} == {"a", "b", "c"}
    assert {select(client, "t", producer="p2")["brokerName"] for _ in range(8)} == {
        "a", "b", "c", "d"}
    # p1 again is still one voter; a second producer makes the quorum
    assert report(client, "d", 700, "p1")["notAvailableDurationMs"] == 0
    assert report(client, "d", 600, "p2")["notAvailableDurationMs"] == 30000
    assert items(client)["d"]["available"] is False
    assert {select(client, "t", producer="p3")["brokerName"] for _ in range(8)} == {"a", "b", "c"}
    events = client.get("/events").json()["events"]
    assert any(e["kind"] == "quorum" and e["brokerName"] == "d" and e["reporters"] == 2
               for e in events)


@pytest.mark.integration
def test_default_quorum_keeps_rocketmq_for_one_producer(client: TestClient) -> None:
    assert client.get("/config").json()["latencyQuorum"] == 1
    put_route(client, "t", {"a": 2, "d": 2})
    assert report(client, "d", 795, "p1")["notAvailableDurationMs"] == 30000
    assert items(client)["d"]["available"] is False
    assert {select(client, "t", producer="p2")["brokerName"] for _ in range(4)} == {"a"}


@pytest.mark.integration
def test_latency_quorum_bounds_are_422_naming_the_field(client: TestClient) -> None:
    for bad in (0, 65, "two"):
        r = client.patch("/config", json={"latencyQuorum": bad})
        assert r.status_code == 422, r.text
        assert "latencyQuorum" in r.text


# -- live: a service process, cached SDK clients --------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_live_a_cold_send_is_avoided_by_its_producer_alone(
    store: str, request: pytest.FixtureRequest
) -> None:
    """A real service (memory or Redis store) and cached clients: p1's cold 795 ms send to
    d keeps p1 away from d (its own report, then the pushed item), while p2 decides with
    d in rotation in-process and at /select; p2's slow answer then opens d's window for
    all, and a third producer's cached client learns it from the stream."""
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    with ServiceProcess(url) as svc, httpx.Client(base_url=svc.url, timeout=10) as admin:
        admin.patch("/config", json={"latencyQuorum": 2}).raise_for_status()
        body = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in "abcd"]}
        admin.put("/routes/t", json=body).raise_for_status()
        clients = [DetourClient(svc.url, mode="cached", timeout=2.0, producer=p)
                   for p in ("p1", "p2", "p3")]
        try:
            for c in clients:
                assert c.wait_ready(10), "the cached client's stream never delivered a snapshot"
            p1, p2, p3 = clients
            p1.report("d", 795)
            assert {p1.select("t").broker_name for _ in range(16)} == {"a", "b", "c"}
            wait_until(
                lambda: all(admin.post("/select", json={"topic": "t", "producer": "p1"})
                            .json()["brokerName"] != "d" for _ in range(8)),
                10,
                "Detour avoids d for p1",
            )
            # the pushed item (the service's copy of p1's vote) keeps p1's own decision
            assert {p1.select("t").broker_name for _ in range(16)} == {"a", "b", "c"}
            assert {p2.select("t").broker_name for _ in range(16)} == {"a", "b", "c", "d"}
            served = {admin.post("/select", json={"topic": "t", "producer": "p2"})
                      .json()["brokerName"] for _ in range(16)}
            assert served == {"a", "b", "c", "d"}
            assert all(i["available"] for i in admin.get("/fault-items").json()["items"])

            p2.report("d", 640)
            wait_until(
                lambda: not {i["brokerName"]: i for i in admin.get("/fault-items")
                             .json()["items"]}["d"]["available"],
                10,
                "the quorum opens d's window for everyone",
            )
            wait_until(
                lambda: all(p3.select("t").broker_name != "d" for _ in range(16)),
                10,
                "p3's cached client avoids d",
            )
        finally:
            for c in clients:
                c.close()
