"""Recovery (issue 19): the staggered return (``rampMs``) and early recovery
(``earlyRecovery``), pure, on both stores, and with real broker processes.

docs/policy.md, "Staggered return" and "Early recovery", says what each pins.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from detour import policy, strategy
from detour.model import BrokerRoute, Config, FaultItem, Route
from detour.policy import Draws
from pipeline.brokers import Broker, stream_key
from tests.asgi_client import TestClient
from tests.procs import free_port, wait_until
from tests.rule import applied
from tests.test_behaviour import DEFAULT_CONFIG, items, put_route, select
from tests.test_behaviour_policy import _Accepting, _Hangup, configure, events, fail

NOW = 1_764_000_000_000
ROUTE = Route.from_brokers("t", [BrokerRoute(b, 2) for b in ("a", "b", "c", "d")])


# -- the staggered return, pure ---------------------------------------------------------------


@pytest.mark.unit
def test_ramp_share_starts_at_a_64th_and_doubles_six_times() -> None:
    config = Config(ramp_ms=3000)
    ended = FaultItem("a", 3, NOW)
    shares = [policy.ramp_share(ended, NOW + ms, config)
              for ms in (-1, 0, 499, 500, 1000, 1500, 2000, 2499, 2500, 2999, 3000)]
    assert shares == [1.0, 1 / 64, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 4, 1 / 2, 1 / 2, 1.0]
    assert policy.ramp_share(ended, NOW, Config()) == 1.0  # off
    assert policy.ramp_share(FaultItem("a", 3, 0), NOW, config) == 1.0  # never had a window


@pytest.mark.unit
def test_a_ramping_broker_gets_its_share_of_the_selects_that_would_pick_it() -> None:
    config = Config(ramp_ms=3000)
    faults = {"c": FaultItem("c", 3, NOW - 1600)}  # step 3: an eighth
    rolls = [i / 256 for i in range(256)]
    picks = Counter(
        policy.choose(ROUTE, 4, faults, NOW, None, config, Draws(ramp=r)).selection
        .queue.broker_name for r in rolls
    )
    assert picks["c"] == 32 and picks["d"] == 256 - 32  # the losers skip c as avoided
    skipped = policy.choose(ROUTE, 4, faults, NOW, None, config, Draws(ramp=0.5))
    assert skipped.selection.avoided_brokers == ("c",)
    assert skipped.avoidance.enforced == frozenset({"c"})
    # the window itself still decides inside it, and a ramp over is no ramp
    assert policy.choose(ROUTE, 4, {"c": FaultItem("c", 3, NOW + 1)}, NOW, None, config,
                         Draws()).selection.queue.broker_name == "d"
    done = {"c": FaultItem("c", 3, NOW - 3000)}
    assert policy.choose(ROUTE, 4, done, NOW, None, config, Draws(ramp=0.99)).selection \
        == strategy.select(ROUTE, 4, done, NOW, None, True)


@pytest.mark.unit
@pytest.mark.parametrize("last_report_wins", [False, True])
def test_under_the_ramp_a_healthy_report_keeps_the_last_window_end(
    last_report_wins: bool,
) -> None:
    config = Config(ramp_ms=3000, last_report_wins=last_report_wins)
    ended = FaultItem("a", 700, NOW - 100)
    after = applied(ended, "a", 3, False, None, "p", NOW, NOW, config).item
    assert after.available_at == NOW - 100  # the ramp goes on counting from the window's end
    assert applied(None, "a", 3, False, None, "p", NOW, NOW, config).item.available_at == 0
    # a slow answer still opens a window; inside a window the rule is RocketMQ's
    assert applied(ended, "a", 700, False, None, "p", NOW, NOW, config).item.available_at \
        == NOW + 30_000
    open_ = FaultItem("a", 700, NOW + 100)
    inside = applied(open_, "a", 3, False, None, "p", NOW, NOW, config).item
    assert inside.available_at == (NOW if last_report_wins else NOW + 100)
    # without the ramp a healthy report moves an ended window's end to its time (RocketMQ)
    assert applied(ended, "a", 3, False, None, "p", NOW, NOW, Config(
        last_report_wins=last_report_wins)).item.available_at == NOW


# -- early recovery, pure ---------------------------------------------------------------------


EARLY = Config(early_recovery=True, detector_enable=True)


@pytest.mark.unit
def test_refused_then_reachable_ends_an_open_window_on_probation() -> None:
    down = FaultItem("a", 30000, NOW + 600_000, reachable=False)
    back = policy.reach(down, True, NOW, EARLY)
    assert (back.available_at, back.probation, back.reachable) == (NOW, True, True)
    assert policy.on_probation(back, NOW, EARLY)
    # no evidence: a first reading (a hung or slow process accepts connections too), a
    # refusal, a window already over; a repeat offender; the mechanism off, avoidance off
    for item, reading, config in (
        (dataclasses.replace(down, reachable=None), True, EARLY),
        (dataclasses.replace(down, reachable=True), True, EARLY),
        (down, False, EARLY),
        (dataclasses.replace(down, available_at=NOW), True, EARLY),
        (dataclasses.replace(down, isolations=2), True, EARLY),  # a repeat offender
        (down, True, Config(detector_enable=True)),
        (down, True, dataclasses.replace(EARLY, send_latency_fault_enable=False)),
    ):
        after = policy.reach(item, reading, NOW, config)
        assert after == dataclasses.replace(item, reachable=reading)


@pytest.mark.unit
def test_the_early_probe_decides_pass_or_reisolate_with_backoff() -> None:
    config = dataclasses.replace(EARLY, repeat_multiplier=True)
    down = FaultItem("a", 30000, NOW + 600_000, isolations=1, reachable=False)
    back = policy.reach(down, True, NOW, config)
    # the next select probes it, before any other broker
    choice = policy.choose(ROUTE, 2, {"a": back}, NOW + 5, None, config, probes=("a",))
    assert (choice.probe, choice.selection.queue.broker_name) == ("a", "a")
    # the others keep away until the probe is decided
    other = policy.choose(ROUTE, 0, {"a": back}, NOW + 5, None, config)
    assert other.selection.queue.broker_name == "b" and other.probe is None
    passed = applied(back, "a", 4, False, None, "p", NOW + 10, NOW + 10, config)
    assert passed.probe == "passed" and not passed.item.probation
    assert passed.item.available_at == NOW + 10  # back in full rotation, ~600 s early
    assert policy.window_event(strategy.WindowChange.NONE, False, False, passed.probe) == (
        "ended", "probe")
    failed = applied(back, "a", 0, True, None, "p", NOW + 10, NOW + 10, config)
    assert failed.probe == "failed" and failed.item.isolations == 2
    assert failed.duration_ms == 1_200_000  # a repeat offender: twice the window
    assert not failed.item.probation  # without probeOnExpiry its window's end returns it
    with_probe = dataclasses.replace(config, probe_on_expiry=True)
    assert applied(back, "a", 0, True, None, "p", NOW + 10, NOW + 10,
                        with_probe).item.probation


@pytest.mark.unit
def test_defaults_keep_recovery_off() -> None:
    c = Config()
    assert (c.ramp_ms, c.early_recovery) == (0, False)
    assert not policy.probation_on(c)


# -- both stores, over HTTP -------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("rampMs", -1), ("rampMs", 86_400_001), ("rampMs", 1.5), ("earlyRecovery", "yes")])
def test_bad_recovery_config_is_422_naming_the_field(
    client: TestClient, field: str, value: object
) -> None:
    r = client.patch("/config", json={field: value})
    assert r.status_code == 422 and r.json()["field"] == field, r.text
    assert client.get("/config").json() == DEFAULT_CONFIG


def test_a_broker_whose_slow_window_ended_gets_a_small_share_at_first(
    client: TestClient,
) -> None:
    # the 550 ms tier's window lasts 1 ms; the ramp a long time, so it stays at a 64th
    configure(client, rampMs=600_000, notAvailableDuration=[0, 0, 1, 60000, 120000, 180000,
                                                           600000])
    put_route(client, "t", {"a": 1, "b": 1})
    client.post("/report-latency", json={"brokerName": "a", "latencyMs": 700})
    wait_until(lambda: items(client)["a"]["availableAt"] <= int(time.time() * 1000) - 5, 10,
               "the 1 ms window over")
    picks = Counter(select(client, "t")["brokerName"] for _ in range(128))
    assert picks["a"] < 16, picks  # a 64th of those that would pick it: about one
    # a healthy report does not restart the ramp (nor end it)
    end = items(client)["a"]["availableAt"]
    client.post("/report-latency", json={"brokerName": "a", "latencyMs": 3})
    assert items(client)["a"]["availableAt"] == end


@pytest.fixture
def listener() -> Iterator[list[_Accepting]]:
    """Servers a test starts; shut down on the way out."""
    started: list[_Accepting] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def _listen(port: int, started: list[_Accepting]) -> None:
    server = _Accepting(("127.0.0.1", port), _Hangup)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started.append(server)


def test_the_detector_finding_a_refusing_broker_back_starts_its_probe(
    client: TestClient, listener: list[_Accepting]
) -> None:
    port = free_port()  # bound and closed again: connects are refused
    client.put("/routes/t", json={"brokers": [
        {"brokerName": "a", "writeQueueNums": 1, "address": f"127.0.0.1:{port}"},
        {"brokerName": "b", "writeQueueNums": 1}]})
    configure(client, detectorEnable=True, detectIntervalMs=100, detectTimeoutMs=1000,
              earlyRecovery=True, repeatMultiplier=True)
    fail(client, "a")
    wait_until(lambda: items(client)["a"]["reachable"] is False, 10, "a refused")
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}
    _listen(port, listener)  # the broker answers again
    wait_until(lambda: items(client)["a"]["probation"], 10, "early probation")
    assert items(client)["a"]["availableAt"] < int(time.time() * 1000) + 1000  # 600 s early
    probes: list[Any] = []  # the replica's copy may get the push a moment later

    def probed() -> bool:
        s = select(client, "t")
        if s["probe"]:
            probes.append(s)
        else:
            assert s["brokerName"] == "b"
        return bool(probes)

    wait_until(probed, 10, "the probe")
    assert probes[0]["brokerName"] == "a"
    assert {select(client, "t")["brokerName"] for _ in range(2)} == {"b"}  # others wait
    # the probe fails: re-isolated, twice the window (a repeat offender)
    out = fail(client, "a")
    assert out["notAvailableDurationMs"] == 1_200_000
    assert [(e["kind"], e["reason"]) for e in events(client)["events"]][-1] == ("opened", "probe")
    assert not items(client)["a"]["probation"]
    # no new evidence while it stays reachable: it waits out its window
    assert {select(client, "t")["brokerName"] for _ in range(4)} == {"b"}


# -- real broker processes --------------------------------------------------------------------


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[dict[str, Broker]]:
    fleet = {n: Broker(n, 2, tmp_path) for n in ("broker-a", "broker-b")}
    try:
        for b in fleet.values():
            b.start()
        yield fleet
    finally:
        for b in fleet.values():
            b.close()


def _send(client: TestClient, conns: dict[str, redis.Redis]) -> tuple[str, bool]:
    """One attempt as a producer makes it: select, XADD to the chosen stand-in broker, report."""
    s = select(client, "t")
    broker, started = s["brokerName"], time.monotonic()
    try:
        conns[broker].xadd(stream_key("t", s["queueId"]), {"m": "x"})
        ok = True
    except redis.RedisError:
        ok = False
    body: dict[str, Any] = {"brokerName": broker, "isolation": not ok,
                            "latencyMs": round((time.monotonic() - started) * 1000, 3)}
    assert client.post("/report-latency", json=body).status_code == 200
    return broker, ok


@pytest.mark.e2e
@pytest.mark.parametrize("ramp_ms", [0, 3000])
def test_a_restarted_broker_is_back_within_two_seconds_of_answering(
    client: TestClient, brokers: dict[str, Broker], ramp_ms: int
) -> None:
    """A crashed stand-in broker (a real redis-server, SIGKILL) restarted on its port: its
    first good send comes within 2 s of its answering again, not after its 600 s window."""
    client.put("/routes/t", json={"brokers": [
        {"brokerName": n, "writeQueueNums": 2, "address": b.address} for n, b in brokers.items()]})
    configure(client, detectorEnable=True, detectIntervalMs=500, earlyRecovery=True,
              rampMs=ramp_ms)
    conns = {n: b.client(0.5) for n, b in brokers.items()}
    try:
        brokers["broker-a"].kill()
        for _ in range(10):  # the crash is met once and reported
            if _send(client, conns) == ("broker-a", False):
                break
        else:
            pytest.fail("no send met the dead broker")
        assert items(client)["broker-a"]["availableAt"] > time.time() * 1000 + 500_000
        wait_until(lambda: items(client)["broker-a"]["reachable"] is False, 10,
                   "the detector finds it refusing")
        brokers["broker-a"].start()  # returns once it answers (READY=1)
        answering = time.monotonic()
        bad = 0
        deadline = answering + 10
        while time.monotonic() < deadline:
            broker, ok = _send(client, conns)
            if broker == "broker-a":
                if ok:
                    break
                bad += 1
            time.sleep(0.01)  # a producer's pace (20 ms per send with the round trips)
        else:
            pytest.fail("the restarted broker never got a good send")
        back = time.monotonic() - answering
        assert back < 2.0, f"first good send {back:.2f} s after the broker answered"
        assert bad == 0
        assert not items(client)["broker-a"]["probation"]
    finally:
        for c in conns.values():
            c.close()


# -- the benchmarks' recovery arms ------------------------------------------------------------


@pytest.mark.unit
def test_simulated_recovery_brings_a_crashed_broker_back_at_once() -> None:
    from bench import simulate

    world = simulate.World(brokers=20, queues=4, duration_s=600, seed=3)
    by_name = {a.name: a for a in simulate.arms()}
    plain = simulate.simulate(world, by_name["detour-100ms"], 100)
    recover = simulate.simulate(world, by_name["detour-recover-100ms"], 100)
    assert recover.kinds["crash"]["per_fault"] <= plain.kinds["crash"]["per_fault"] + 1
    assert recover.kinds["crash"]["to_traffic_s"] < 5  # the detector's round, the probe
    assert not plain.kinds["crash"]["to_traffic_s"] < 5  # the 600 s window
    assert recover.kinds["slow"]["per_fault"] <= plain.kinds["slow"]["per_fault"]
    # deterministic for a seed, like the other arms
    again = simulate.simulate(world, by_name["detour-recover-100ms"], 100)
    assert dataclasses.replace(again, wall_s=0) == dataclasses.replace(recover, wall_s=0)


@pytest.mark.unit
def test_simulated_recommended_settings_combine_both_gains() -> None:
    """detour-all (recovery and in-flight signals at once): a crashed broker is back at
    once as with detour-recover, hangs cost as little as with detour-pending, and slow
    brokers less than with either alone (the signals stop the first wave, the ramp the
    wave at each window's end)."""
    from bench import simulate

    world = simulate.World(brokers=20, queues=4, duration_s=600, seed=3, rate=5.0)
    by_name = {a.name: a for a in simulate.arms()}
    assert by_name["detour-all"].recover and by_name["detour-all"].pending
    plain = simulate.simulate(world, by_name["detour-100ms"], 50)
    both = simulate.simulate(world, by_name["detour-all"], 50)
    pend = simulate.simulate(world, by_name["detour-pending"], 50)
    assert both.kinds["crash"]["to_traffic_s"] < 5
    assert not plain.kinds["crash"]["to_traffic_s"] < 5
    assert both.kinds["crash"]["per_fault"] <= plain.kinds["crash"]["per_fault"] + 1
    assert both.kinds["hang"]["per_fault"] * 4 <= plain.kinds["hang"]["per_fault"]
    assert both.kinds["slow"]["per_fault"] < pend.kinds["slow"]["per_fault"]
