"""pendingQuorum: in-flight signals avoid a hung broker before any timeout fires
(docs/policy.md, "Hangs: pendingQuorum").

Pure rule first, report.lua against it, then the API on both stores, the SDK's in-flight
tracker, and real processes: a SIGSTOPped stand-in broker avoided before the send timeout.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from detour import policy, strategy
from detour.apply import Effect
from detour.model import Config, FaultItem
from service.store import codec
from tests.asgi_client import TestClient
from tests.procs import wait_until
from tests.rule import applied
from tests.test_behaviour import items, put_route, select
from tests.test_behaviour_policy import configure, metric

NOW = 1_764_000_000_000
ON = Config(pending_quorum=2)


def signal(config: Config, old: FaultItem | None, producer: str, outstanding: int = 60,
           at: int = NOW) -> Effect:
    return applied(old, "c", outstanding, False, None, producer, at, at, config,
                        pending=True)


def done(config: Config, old: FaultItem | None, producer: str, latency: int = 3,
         at: int = NOW, isolation: bool = False) -> Effect:
    return applied(old, "c", latency, isolation, None, producer, at, at, config)


# -- pure -----------------------------------------------------------------------------------


def test_off_by_default_a_pending_report_changes_nothing() -> None:
    assert Config().pending_quorum == 0
    out = signal(Config(), None, "p1")
    assert out.duration_ms == 0 and not out.suspected and not out.quorum_reached
    old = FaultItem("c", 4, NOW - 10)
    for who in ("p1", "p2", "p3"):
        assert signal(Config(), old, who, 5000).item == old


def test_pending_tier_is_the_latencys_or_the_first_with_a_window() -> None:
    c = Config()
    assert policy.pending_tier(c, 60) == 2 and policy.pending_duration(c, 60) == 30_000
    assert policy.pending_tier(c, 1200) == 3 and policy.pending_duration(c, 1200) == 60_000
    none = Config(latency_max=(0, 100), not_available_duration=(0, 0))
    assert policy.pending_tier(none, 500) is None and policy.pending_duration(none, 500) == 0
    assert signal(Config(pending_quorum=1, latency_max=(0, 100),
                         not_available_duration=(0, 0)), None, "p1").duration_ms == 0


def test_a_quorum_of_producers_opens_the_window_one_producer_never_does() -> None:
    item = signal(ON, None, "p1").item
    # one producer's burst of signals (re-signals) stays one voter
    for dt in (10, 50, 150):
        out = signal(ON, item, "p1", 60 + dt, NOW + dt)
        assert out.suspected and not out.quorum_reached and out.duration_ms == 0
        assert out.item.available_at <= NOW + dt
        item = out.item
    assert [e[0] for e in item.pending] == ["p1"]
    assert item.pending[0][1] == NOW - 60  # the send's start stays the first signal's
    out = signal(ON, item, "p2", 55, NOW + 200)
    assert out.quorum_reached and out.reporters == 2 and out.duration_ms == 30_000
    assert out.item.available_at == NOW + 200 + 30_000
    assert policy.live_signals(out.item.pending, NOW + 200, ON) == {"p1", "p2"}
    assert policy.held_until(out.item.pending) == NOW + 200 + 30_000
    assert policy.window_event(strategy.window_change(
        item.available_at, out.item.available_at, NOW + 200), False, True, None, True) == (
        "opened", "pending")


def test_a_completed_send_withdraws_its_signal() -> None:
    item = signal(ON, None, "p1").item
    item = done(ON, item, "p1", 80, NOW + 20).item
    assert item.pending == (("p1", NOW + 20, 0),)
    out = signal(ON, item, "p2", 60, NOW + 30)
    assert out.suspected and not out.quorum_reached
    # a failed send withdraws too (its own isolation report decides instead)
    item = done(ON, out.item, "p2", 1000, NOW + 40, isolation=True).item
    assert ("p2", NOW + 40, 0) in item.pending
    assert policy.live_signals(item.pending, NOW + 40, ON) == set()


def test_a_window_the_signals_hold_ends_when_their_sends_complete() -> None:
    """A slow-but-alive broker (every producer's send stalled for a moment, then answered):
    the window the signals opened ends with the first completion that leaves the live
    signals short of the quorum."""
    item = signal(ON, signal(ON, None, "p1").item, "p2", 60, NOW + 5).item
    assert item.available_at == NOW + 5 + 30_000
    out = done(ON, item, "p1", 90, NOW + 30)
    assert out.item.available_at == NOW + 30
    assert policy.held_until(out.item.pending) == 0
    assert strategy.window_change(item.available_at, out.item.available_at,
                                         NOW + 30) is strategy.WindowChange.CLEARED


def test_a_timeout_or_a_longer_window_keeps_the_window() -> None:
    held = signal(ON, signal(ON, None, "p1").item, "p2", 60, NOW + 5).item
    # the hung send times out: the failure's own window, never an early end
    out = done(ON, held, "p1", 1000, NOW + 1000, isolation=True)
    assert out.item.available_at == NOW + 1000 + 600_000
    assert done(ON, out.item, "p2", 3, NOW + 1100).item.available_at == NOW + 601_000
    # a slow answer moved the window: it is that report's now
    out = done(ON, held, "p3", 1200, NOW + 10)
    assert out.item.available_at == NOW + 10 + 60_000
    assert done(ON, out.item, "p1", 3, NOW + 20).item.available_at == NOW + 60_010
    # three producers: one completion leaves two live signals, the quorum still holds it
    three = signal(ON, held, "p3", 60, NOW + 7).item
    assert done(ON, three, "p1", 3, NOW + 8).item.available_at == three.available_at


def test_a_late_signal_for_a_completed_send_is_ignored() -> None:
    """Remote mode: the signal's post may land after the completion's. The signal's send
    started before that completion: it is stale, and it neither votes nor changes the item."""
    item = signal(ON, None, "p1", 60, NOW).item
    item = done(ON, item, "p2", 5, NOW + 1).item  # p2 has no signal: nothing added
    assert [e[0] for e in item.pending] == ["p1"]
    item = done(ON, item, "p2", 5, NOW + 2).item
    item = signal(ON, done(ON, item, "p1", 70, NOW + 10).item, "p1", 65, NOW + 15).item
    assert item.pending == (("p1", NOW + 10, 0),)  # started at NOW - 50: before the completion
    out = signal(ON, item, "p2", 60, NOW + 16)
    assert out.suspected and not out.quorum_reached
    # a new send of p1 (started after its completion) signals again
    out = signal(ON, out.item, "p1", 60, NOW + 80)
    assert out.quorum_reached


def test_signals_expire_after_the_quorum_window() -> None:
    config = Config(pending_quorum=2, quorum_window_ms=1000)
    item = signal(config, None, "p1").item
    out = signal(config, item, "p2", 60, NOW + 1001)
    assert out.suspected and [e[0] for e in out.item.pending] == ["p2"]


def test_signals_are_bounded() -> None:
    config = Config(pending_quorum=64)
    item: FaultItem | None = None
    for i in range(200):
        # each producer signals, and all but the last 10 complete (their entries stay)
        item = signal(config, item, f"p{i}", 60, NOW + i).item
        if i < 190:
            item = done(config, item, f"p{i}", 70, NOW + i).item
    assert item is not None and len(item.pending) == policy.MAX_SUSPECTS
    assert item.pending[-1][0] == "p199"


def test_a_signal_never_shortens_a_window_even_under_last_report_wins() -> None:
    config = Config(pending_quorum=1, last_report_wins=True)
    old = FaultItem("c", 5, NOW + 500_000)
    out = signal(config, old, "p1")
    assert out.quorum_reached and out.item.available_at == NOW + 500_000
    assert out.item.current_latency_ms == 5


def test_reports_for_a_broker_with_open_signals_are_not_kept_local() -> None:
    item = signal(ON, FaultItem("c", 3, NOW - 1), "p1").item
    assert not policy.quiet(item, 3, False, NOW, ON)
    assert not policy.quiet(FaultItem("c", 3, NOW - 1), 3, False, NOW, ON, pending=True)
    assert policy.quiet(done(ON, item, "p1").item, 3, False, NOW, ON)


def test_codec_round_trips_signals() -> None:
    item = FaultItem("c", 3, NOW, pending=(("p1", NOW - 60, NOW), ("p2", NOW - 5, 0)))
    raw = codec.encode_fault(item)
    assert raw == f"0@3,{NOW},0;~p1={NOW - 60}={NOW};~p2={NOW - 5}=0"
    assert codec.decode_fault("c", raw) == item
    both = FaultItem("c", 3, NOW, 2, (("p3", NOW),), True, True, (("p4", NOW, NOW + 9),),
                     item.pending)
    assert codec.decode_fault("c", codec.encode_fault(both)) == both


# -- report.lua against the policy -------------------------------------------------------------


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield c
    finally:
        c.close()


PREFIX = "detour:{default}"
KEYS = tuple(f"{PREFIX}:{k}" for k in (
    "faults", "meta", "latency-log", "events", "ends", "writers", "writers-seen", "report-ids"))


# -- API, both stores --------------------------------------------------------------------------


def pending(client: TestClient, broker: str, outstanding: int, producer: str,
            **extra: Any) -> dict[str, Any]:
    r = client.post("/report-latency", json={
        "brokerName": broker, "latencyMs": outstanding, "producer": producer, "pending": True,
        **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


def completed(client: TestClient, broker: str, latency: int, producer: str) -> dict[str, Any]:
    r = client.post("/report-latency",
                    json={"brokerName": broker, "latencyMs": latency, "producer": producer})
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.integration
def test_a_quorum_of_signals_avoids_the_broker_for_everyone(client: TestClient) -> None:
    configure(client, pendingQuorum=2)
    put_route(client, "t", {"a": 2, "b": 2, "c": 2})
    before = metric(client, "detour_reports_total", broker="c", outcome="pending")
    assert pending(client, "c", 60, "p1")["notAvailableDurationMs"] == 0
    assert items(client)["c"]["available"] is True
    assert {select(client, "t", producer="p3")["brokerName"] for _ in range(6)} == {"a", "b", "c"}
    # p1 again: still one voter
    assert pending(client, "c", 120, "p1")["notAvailableDurationMs"] == 0
    assert items(client)["c"]["available"] is True
    out = pending(client, "c", 55, "p2", isolation=True)  # isolation ignored, not refused
    assert out["notAvailableDurationMs"] == 30000
    assert items(client)["c"]["available"] is False
    assert {select(client, "t", producer="p3")["brokerName"] for _ in range(6)} == {"a", "b"}
    assert metric(client, "detour_reports_total", broker="c",
                  outcome="pending") == before + 3
    events = client.get("/events").json()["events"]
    assert any(e["reason"] == "pending" and e["kind"] == "opened" and e["brokerName"] == "c"
               and e["reporters"] == 2 for e in events)
    # no pending report reached the latency log
    log = client.get("/latency-log").json()["entries"]
    assert not any(e["brokerName"] == "c" for e in log)


@pytest.mark.integration
def test_a_signal_sent_twice_is_applied_once(client: TestClient) -> None:
    """A retried batch (or a journal replay) carrying a signal: its reportId makes it
    apply once, so a replay can neither refresh a withdrawn signal nor count again."""
    configure(client, pendingQuorum=2)
    put_route(client, "t", {"a": 2, "c": 2})
    before = metric(client, "detour_reports_duplicate_total")
    body = {"reports": [{"brokerName": "c", "latencyMs": 60, "producer": "p1",
                         "pending": True, "reportId": "p1-7"}]}
    assert client.post("/report-latency:batch", json=body).status_code == 200
    completed(client, "c", 70, "p1")  # withdraws p1's signal
    assert client.post("/report-latency:batch", json=body).status_code == 200  # the replay
    assert metric(client, "detour_reports_duplicate_total") == before + 1
    # p1's signal stays withdrawn: p2's alone is short of the quorum
    assert pending(client, "c", 60, "p2")["notAvailableDurationMs"] == 0
    assert items(client)["c"]["available"] is True


@pytest.mark.integration
def test_completed_sends_keep_a_slow_but_alive_broker_in_rotation(client: TestClient) -> None:
    configure(client, pendingQuorum=2)
    put_route(client, "t", {"a": 2, "c": 2})
    pending(client, "c", 60, "p1")
    completed(client, "c", 80, "p1")
    pending(client, "c", 60, "p2")
    completed(client, "c", 90, "p2")
    pending(client, "c", 60, "p3")
    assert items(client)["c"]["available"] is True
    # (a completed send moves the item's end to its own time; this replica's clock errs a
    # round trip behind the store's, so it may see that end as open for that long)
    wait_until(lambda: {select(client, "t")["brokerName"] for _ in range(4)} == {"a", "c"},
               5, "c in rotation")


@pytest.mark.integration
def test_pending_defaults_to_false_and_is_off_by_default(client: TestClient) -> None:
    assert client.get("/config").json()["pendingQuorum"] == 0
    put_route(client, "t", {"a": 2, "c": 2})
    for p in ("p1", "p2", "p3"):
        assert pending(client, "c", 5000, p)["notAvailableDurationMs"] == 0
    assert "c" not in items(client) or items(client)["c"]["available"] is True
    # without the field a report is a completed send, as always
    assert completed(client, "c", 700, "p1")["notAvailableDurationMs"] == 30000


@pytest.mark.integration
def test_pending_quorum_bounds_are_422_naming_the_field(client: TestClient) -> None:
    for bad in (-1, 65, "two"):
        r = client.patch("/config", json={"pendingQuorum": bad})
        assert r.status_code == 422, r.text
        assert "pendingQuorum" in r.text
    r = client.post("/report-latency", json={"brokerName": "c", "latencyMs": 1, "pending": 3})
    assert r.status_code == 422 and "pending" in r.text


# -- the SDK's in-flight tracker ----------------------------------------------------------------


def test_inflight_threshold_is_k_times_p99_with_a_floor_and_a_cold_start() -> None:
    from detour.client.inflight import COLD_MS, MIN_SAMPLES, InFlight

    f = InFlight(factor=4, floor_ms=50)
    assert f.threshold_ms("a") == COLD_MS
    for _ in range(MIN_SAMPLES):
        f.end(f.begin("a", 0), 2.0)
    assert f.threshold_ms("a") == 50  # 4 x 2 ms is under the floor
    for _ in range(100):
        f.end(f.begin("a", 0), 30.0)
    assert f.threshold_ms("a") == 120
    # a failed send is no sample of the broker's latency
    for _ in range(200):
        f.end(f.begin("b", 0), None)
    # a broker not known yet borrows the p99 of every broker's recent sends
    assert f.threshold_ms("b") == 120
    assert InFlight().threshold_ms("b") == COLD_MS
    assert InFlight(factor=0).begin("a", 0) == 0 and not InFlight(factor=0).enabled
    with pytest.raises(ValueError):
        InFlight(factor=-1)


def test_inflight_signals_once_then_when_the_outstanding_time_doubles() -> None:
    from detour.client.inflight import InFlight

    f = InFlight(factor=4, floor_ms=50)
    for _ in range(8):
        f.end(f.begin("a", 0), 1.0)
    token = f.begin("a", 1000)
    done_token = f.begin("a", 1000)
    f.end(done_token, 3.0)  # a completed send signals nothing
    assert f.next_due_ms() == 1050
    assert f.due(1049) == []
    assert f.due(1060) == [("a", 60)]
    assert f.due(1100) == []  # next at twice 60 ms outstanding
    assert f.next_due_ms() == 1120
    assert f.due(1125) == [("a", 125)]
    f.end(token, None)
    assert f.due(5000) == [] and f.next_due_ms() is None and f.outstanding() == 0


def test_pending_reports_are_urgent_and_never_applied_to_the_local_table() -> None:
    from detour.client.core import ClientCore
    from detour.clock import mono_ms

    core = ClientCore("cached", timeout=1, retries=0, deadline=1, max_pending=10,
                      backoff_initial=0.1, backoff_max=1, producer="p1")
    assert not core.tracking()  # the service's config has pendingQuorum 0
    core.table.set_config(Config(pending_quorum=2))
    assert core.tracking()
    core.inflight.begin("c", mono_ms() - 300)
    items = core.due_signals(mono_ms())
    assert [(p.broker_name, p.pending) for p in items] == [("c", True)]
    core.pending.add(items)
    assert core.pending.urgent
    core.apply(items)
    assert core.table.fault("c") is None
    body = json.loads(core.batch_body(items))["reports"][0]
    assert body["pending"] is True and body["producer"] == "p1" and body["reportId"]


# -- real processes: a SIGSTOPped broker avoided before the send timeout -------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["cached", "remote"])
def test_a_hung_broker_is_avoided_before_the_send_timeout(mode: str) -> None:
    """Stand-in brokers (redis-server) and Detour as processes. The route's broker-b is
    SIGSTOPped; two producers' sends to it hang (5 s timeout). Their SDKs signal after
    ~50 ms outstanding, the pending quorum (2) opens b's window, and a third producer's
    cached client avoids b while both sends are still outstanding."""
    import threading
    import time

    import httpx

    from detour.client import DetourClient
    from pipeline.brokers import Fleet
    from pipeline.produce import Deliverer
    from tests.procs import ServiceProcess, wait_until

    timeout_s = 5.0
    with ServiceProcess() as svc, Fleet(3, "hang", 2, persist=False) as fleet, \
            httpx.Client(base_url=svc.url, timeout=10) as admin:
        admin.patch("/config", json={"pendingQuorum": 2}).raise_for_status()
        fleet.register(svc.url)
        senders = [DetourClient(svc.url, decide_within=None, mode=mode, timeout=2.0, producer=p,
                                deadline=30, retries=0) for p in ("p1", "p2")]
        watcher = DetourClient(svc.url, mode="cached", timeout=2.0, producer="p3")
        deliverers = [Deliverer("hang", timeout_s) for _ in senders]
        hung: list[float] = []
        try:
            for c in (*senders, watcher):
                assert c.wait_ready(10)
            for c, d in zip(senders, deliverers, strict=True):
                for k in range(12):  # warm: each broker's p99 known, threshold at the floor
                    c.send("hang", (f"w{k}", "x"), d)
            # (remote mode reads the config on its first select)
            wait_until(lambda: all(c._core.tracking() for c in senders), 10,
                       "the clients read pendingQuorum")
            for c, d in zip(senders, deliverers, strict=True):
                for k in range(12):
                    c.send("hang", (f"v{k}", "x"), d)
            fleet.brokers["broker-b"].stop()

            def produce(c: DetourClient, d: Deliverer) -> None:
                # send until one attempt lands on the hung broker (and hangs for timeout_s)
                for k in range(60):
                    start = time.monotonic()
                    try:
                        c.send("hang", (f"h{k}", "x"), d)
                    except Exception:  # noqa: BLE001 - the hung send times out
                        hung.append(time.monotonic() - start)
                        return

            threads = [threading.Thread(target=produce, args=(c, d), daemon=True)
                       for c, d in zip(senders, deliverers, strict=True)]
            for t in threads:
                t.start()
            started = time.monotonic()
            wait_until(
                lambda: not {i["brokerName"]: i for i in admin.get("/fault-items")
                             .json()["items"]}.get("broker-b", {"available": True})["available"],
                timeout_s - 1, "the pending quorum opens broker-b's window")
            wait_until(lambda: all(watcher.select("hang").broker_name != "broker-b"
                                   for _ in range(12)), 2, "p3 avoids broker-b")
            # both hung sends are still outstanding: no timeout has fired yet
            assert hung == [] and time.monotonic() - started < timeout_s
            events = admin.get("/events").json()["events"]
            assert any(e["reason"] == "pending" and e["brokerName"] == "broker-b"
                       for e in events)
        finally:
            fleet.brokers["broker-b"].cont()
            for t in threads if "threads" in dir() else ():
                t.join(timeout_s + 2)
            for d in deliverers:
                d.close()
            for c in (*senders, watcher):
                c.close(flush_timeout=2.0)


@pytest.mark.e2e
def test_the_async_client_signals_a_hung_send() -> None:
    """The asyncio client, remote mode, against Detour as a process: a deliver that never
    completes (cut at the deadline) sends a pending report after the cold threshold;
    Detour records it (one producer: short of pendingQuorum 2)."""
    import asyncio

    import httpx

    from detour.client import AsyncDetourClient
    from detour.client.inflight import COLD_MS
    from detour.client.values import SelectedQueue
    from tests.procs import ServiceProcess

    async def hang(q: SelectedQueue, payload: str) -> str:
        await asyncio.sleep(30)
        return payload

    async def fast(q: SelectedQueue, payload: str) -> str:
        return payload

    async def scenario(url: str) -> None:
        async with AsyncDetourClient(url, decide_within=None, mode="remote", timeout=2.0,
                                     producer="p1", retries=0,
                                     deadline=COLD_MS * 3 / 1000) as c:
            await c.send("t", "warm", fast)  # reads the config
            assert c._core.tracking()
            with pytest.raises(Exception):  # noqa: B017 - the deadline cuts it
                await c.send("t", "x", hang)
            assert c._core.inflight.signals >= 1
            await c.flush(5.0)

    with ServiceProcess() as svc, httpx.Client(base_url=svc.url, timeout=10) as admin:
        admin.patch("/config", json={"pendingQuorum": 2}).raise_for_status()
        admin.put("/routes/t", json={"brokers": [{"brokerName": "c", "writeQueueNums": 1}]}
                  ).raise_for_status()
        asyncio.run(scenario(svc.url))
        text = admin.get("/metrics").text
        m = re.search(r'detour_reports_total\{[^}]*broker="c"[^}]*outcome="pending"\} (\S+)', text)
        assert m is not None and float(m.group(1)) >= 1
        # one producer: short of the quorum (the window is the failed send's own isolation)
        assert 'outcome="reached"' not in text


@pytest.mark.unit
def test_the_simulations_pending_arm_avoids_hangs_before_the_timeout() -> None:
    """bench/simulate.py's detour-pending arm (every report through policy.apply, the SDK's
    signal rule): hangs cost far fewer bad attempts than the same shared table without."""
    from bench import simulate

    world = simulate.World(brokers=20, queues=4, duration_s=600, seed=3, rate=5.0)
    arms = {a.name: a for a in simulate.arms()}
    base = simulate.simulate(world, arms["detour-100ms"], 50)
    pend = simulate.simulate(world, arms["detour-pending"], 50)
    assert pend.kinds["hang"]["per_fault"] * 4 <= base.kinds["hang"]["per_fault"]
    assert pend.kinds["slow"]["per_fault"] <= base.kinds["slow"]["per_fault"]


def test_inflight_track_ends_a_send_with_or_without_a_sample() -> None:
    from detour.client.inflight import InFlight

    f = InFlight(factor=4, floor_ms=50)
    now = [1000.0]
    woken: list[float] = []
    with f.track("a", lambda: now[0], woken.append):
        assert f.outstanding() == 1
        now[0] += 7
    assert woken == [1200.0] and f.outstanding() == 0
    with pytest.raises(TimeoutError), f.track("a", lambda: now[0], woken.append):
        raise TimeoutError
    assert f.outstanding() == 0
    assert f._latencies["a"] == deque([7.0])


@pytest.mark.unit
def test_efficacy_counts_how_long_healthy_brokers_were_avoided() -> None:
    from bench import efficacy

    events = [
        {"kind": "opened", "brokerName": "h", "at": 100, "availableAt": 850},
        {"kind": "extended", "brokerName": "h", "at": 120, "availableAt": 870},
        {"kind": "ended", "brokerName": "h", "at": 260, "availableAt": 260},
        {"kind": "opened", "brokerName": "e", "at": 1000, "availableAt": 1750},
    ]
    assert efficacy.avoided_ms(events) == 160 + 750
