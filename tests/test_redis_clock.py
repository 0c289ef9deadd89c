"""A replica's estimate of Redis's clock. Windows are compared against it, so an estimate
that lags makes a window written a moment ago with no length (a fast report's item,
``availableAt`` = the write's time) look open: the broker is avoided, and a route whose
other brokers are avoided falls to pickOneAtLeast for no reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from detour.clock import mono_ms
from service.app import create_app
from service.settings import Settings
from service.store.follower import RedisClock
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer
from tests.proxy import DelayProxy


def offset(clock: RedisClock) -> float:
    """The clock's current offset from the local monotonic clock: read as held, not as
    now_ms() - mono_ms(), whose two clock reads a busy machine can put milliseconds apart."""
    return clock.offset_ms


@pytest.mark.unit
def test_a_poor_sample_does_not_move_the_estimate_back() -> None:
    clock = RedisClock()
    clock.observe(1_000_000, 100.0)  # offset 999,900
    clock.observe(1_000_000, 400.0)  # a reply that took 300 ms longer: offset 999,600
    assert offset(clock) == pytest.approx(999_900, abs=1)
    clock.observe(1_000_050, 100.0)  # a better bound moves it forward at once
    assert offset(clock) == pytest.approx(999_950, abs=1)


@pytest.mark.unit
def test_the_best_sample_is_kept_for_one_to_two_holds_then_the_recent_ones_rule() -> None:
    clock = RedisClock()
    hold = RedisClock.HOLD_MS
    clock.observe(1_000_000, 0.0)  # best: offset 1,000,000
    clock.observe(1_000_000 + hold, hold + 20)  # next bucket, 20 ms worse: kept below
    assert offset(clock) == pytest.approx(1_000_000, abs=1)
    clock.observe(1_000_000 + 2 * hold, 2 * hold + 20)  # the best one's bucket has gone
    assert offset(clock) == pytest.approx(999_980, abs=1)


@pytest.mark.unit
def test_a_clock_set_far_back_is_followed_at_once() -> None:
    clock = RedisClock()
    clock.observe(1_000_000, 0.0)
    back = 1_000_000 - int(RedisClock.STEP_MS) - 1_000
    reading = clock.now_ms()
    clock.observe(back, 10.0)
    assert offset(clock) == pytest.approx(back - 10, abs=1)
    assert clock.now_ms() < reading - RedisClock.STEP_MS  # readings follow it back too


@pytest.mark.unit
def test_readings_never_go_back_when_the_best_sample_ages_out() -> None:
    # The estimate drops 9 s (just short of a step) when the best sample's bucket ends:
    # a reading holds still instead, so a report accepted next is never dated before
    # one accepted earlier. A better sample moves the readings on at once.
    clock, hold, at = RedisClock(), RedisClock.HOLD_MS, mono_ms()
    clock.observe(10**12, at)
    first = clock.now_ms()
    drop = RedisClock.STEP_MS - 1_000
    clock.observe(int(10**12 + hold - drop), at + hold)
    clock.observe(int(10**12 + 2 * hold - drop), at + 2 * hold)
    assert offset(clock) == pytest.approx(10**12 - at - drop, abs=1)  # the estimate dropped
    # ... the readings did not: they hold at the highest reading the old estimate gave
    # when it dropped (``Readings.move``), which is ``first`` plus the time this test took
    # to get there (milliseconds on a busy machine), never below ``first``
    assert first <= clock.now_ms() <= first + (mono_ms() - at) + 1
    clock.observe(10**12 + 10_000, at)  # a better bound than ever, in this bucket
    assert clock.now_ms() >= first + 10_000


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


@pytest.mark.integration
def test_a_fast_first_report_leaves_its_broker_available_after_a_late_sync(
    server: RedisServer,
) -> None:
    # The replica's first sync reply is held 0.5 s on purpose: its estimate of Redis time
    # starts 0.5 s behind, and no poll improves it (one a minute). The report's own reply
    # carries Redis's clock: the item it creates must not look like an open window.
    proxy = DelayProxy(server.port)
    proxy.hold_s = 0.5
    settings = Settings(redis_url=proxy.url, sync_interval_s=60, redis_timeout_s=5,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    try:
        with TestClient(create_app(settings)) as c:
            assert proxy.held > 0  # the fault happened: the start-up replies came late
            proxy.hold_s = 0
            assert c.put("/routes/t", json={"brokers": [
                {"brokerName": "x", "writeQueueNums": 2}]}).status_code == 200
            assert c.post("/report-latency", json={"brokerName": "x", "latencyMs": 20}
                          ).json()["notAvailableDurationMs"] == 0
            picked = c.post("/select", json={"topic": "t"}).json()
            assert picked["brokerName"] == "x" and picked["decision"] == "available", picked
            items = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
            assert items["x"]["available"] is True, items
    finally:
        proxy.close()
