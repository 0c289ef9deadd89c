"""Late replies caused on purpose: a TCP proxy holds Redis's (or Detour's) reply past the
caller's timeout after the command ran, or a frozen Redis runs the call after its caller
gave up. After recovery every report is in the latency log exactly once, no window end has
moved, and each window ends when the producer was answered it would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from detour.client import DetourClient
from service.app import create_app
from service.settings import Settings
from service.store import codec
from tests import raw_table
from tests.asgi_client import TestClient
from tests.procs import RedisServer, ServiceProcess, wait_until
from tests.proxy import DelayProxy

pytestmark = [pytest.mark.integration]

PREFIX = "detour:{default}"
#: well past redis_call_timeout_s (0.05 s) and the SDK's timeout below, far below the
#: sync connections' timeout: only the calls meant to time out do
HOLD_S = 0.6


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis]:
    with server.client() as c:
        yield c


def logged(raw: redis.Redis, broker: str) -> int:
    return sum(1 for _, e in raw.xrange(f"{PREFIX}:latency-log") if e["b"] == broker)


def duplicates(c: TestClient) -> float:
    line = next(ln for ln in c.get("/metrics").text.splitlines()
                if ln.startswith("detour_reports_duplicate_total "))
    return float(line.split()[1])


def stored(raw: redis.Redis, broker: str) -> str | None:
    return raw.hget(f"{PREFIX}:faults", broker)  # type: ignore[return-value]


def stored_end(raw: redis.Redis, broker: str) -> int:
    value = stored(raw, broker)
    assert value is not None, broker
    return codec.decode_fault(broker, value).available_at


def logged_at(raw: redis.Redis, broker: str) -> list[int]:
    """When the latency log says each of ``broker``'s reports happened."""
    return [int(e["t"]) for _, e in raw.xrange(f"{PREFIX}:latency-log") if e["b"] == broker]


def late(server: RedisServer) -> tuple[DelayProxy, Settings]:
    proxy = DelayProxy(server.port)
    return proxy, Settings(redis_url=proxy.url, sync_interval_s=0.2, redis_timeout_s=5)


def warm(c: TestClient, broker: str = "warm") -> None:
    """A report answered by Redis on the fast connection first: the late reply must be a
    command's, not the connection handshake's (a handshake that times out never sends the
    command). On a busy machine the first call may itself miss the 50 ms call timeout
    (a new connection, through the proxy's thread): warm until one is answered in time,
    and until nothing of it waits in the journal.

    A report that timed out is journaled, and every report after it queues behind it in
    the journal without a call (``RedisStore.report_many``) until the journal is replayed:
    so each try waits for the replay first, and every try is a call to Redis."""
    for _ in range(20):
        r = c.post("/report-latency", json={"brokerName": broker, "latencyMs": 1})
        assert r.status_code == 200, r.text
        wait_until(lambda: c.get("/readyz").json()["degraded"] is False, 30, "warmed",
                   interval_s=0.05)
        if r.json()["degraded"] is False:
            return
    pytest.fail("no report of 20 was answered by Redis within the call timeout")


def recover(c: TestClient, proxy: DelayProxy) -> None:
    proxy.hold_s = 0
    wait_until(lambda: c.get("/readyz").json()["degraded"] is False, 30,
               "journal replayed", interval_s=0.05)


def test_the_warm_up_outlasts_its_own_first_report_timing_out(server: RedisServer) -> None:
    """What a busy machine does to the warm-up, caused on purpose: its first report's reply
    held past the call timeout. The tries after it wait for the replay, and one is answered
    in time."""
    proxy, settings = late(server)
    proxy.hold_reply_to, proxy.hold_reply_s = b"warm", HOLD_S
    try:
        with TestClient(create_app(settings)) as c:
            warm(c)
            assert proxy.held == 1
            # Reports reach Redis again: one of a few is answered within the 50 ms call
            # timeout (one try alone may miss it on a busy machine, as the warm-up's may).
            warm(c, "after")
            assert proxy.held == 1
    finally:
        proxy.close()


def test_a_report_whose_reply_came_late_is_applied_once(server: RedisServer,
                                                       raw: redis.Redis) -> None:
    proxy, settings = late(server)
    try:
        with TestClient(create_app(settings)) as c:
            warm(c)
            before = duplicates(c)
            proxy.hold_s = HOLD_S
            r = c.post("/report-latency",
                       json={"brokerName": "a", "latencyMs": 5, "isolation": True})
            assert r.status_code == 200 and r.json()["degraded"] is True  # timed out: journaled
            assert proxy.held > 0
            wait_until(lambda: stored(raw, "a") is not None, 10, "redis ran the report")
            first = stored(raw, "a")
            recover(c, proxy)
            assert logged(raw, "a") == 1
            assert stored(raw, "a") == first  # the window end did not move
            assert stored_end(raw, "a") == r.json()["availableAt"]  # the one answered
            assert duplicates(c) - before == 1
    finally:
        proxy.close()


def test_a_batch_retried_after_a_late_reply_is_applied_once(server: RedisServer,
                                                          raw: redis.Redis) -> None:
    batch: dict[str, Any] = {"reports": [
        {"brokerName": f"b{i}", "latencyMs": 700 * i, "isolation": i == 0, "reportId": f"r-{i}"}
        for i in range(5)]}
    proxy, settings = late(server)
    try:
        with TestClient(create_app(settings)) as c:
            warm(c)
            proxy.hold_s = HOLD_S
            first = c.post("/report-latency:batch", json=batch)
            assert first.status_code == 200
            assert all(x["degraded"] for x in first.json()["results"])
            wait_until(lambda: stored(raw, "b4") is not None, 10, "redis ran the batch")
            table = raw_table.fields(raw, f"{PREFIX}:faults")
            assert [x["availableAt"] for x in first.json()["results"]] == \
                [codec.decode_fault("", table[f"b{i}"]).available_at for i in range(5)]
            # The producer did not get its answer either and sends the batch again.
            again = c.post("/report-latency:batch", json=batch)
            assert again.status_code == 200
            recover(c, proxy)
            # And once more after recovery, straight to Redis. Beside a busy machine that
            # call may itself miss the 50 ms call timeout and be journaled: sent again
            # until Redis answers it in time (each one a duplicate by its reportIds).
            for _ in range(20):
                third = c.post("/report-latency:batch", json=batch).json()["results"]
                if not any(x["degraded"] for x in third):
                    break
                recover(c, proxy)
            assert [x["degraded"] for x in third] == [False] * 5
            assert [x["availableAt"] for x in third] == \
                [codec.decode_fault("", table[f"b{i}"]).available_at for i in range(5)]
            for i in range(5):
                assert logged(raw, f"b{i}") == 1
            # The batch's items are as the first run wrote them. (The warm-up broker's is
            # left out: its fast reports may be coalesced and written at a later flush.)
            now = raw_table.fields(raw, f"{PREFIX}:faults")
            assert [now[f"b{i}"] for i in range(5)] == [table[f"b{i}"] for i in range(5)]
    finally:
        proxy.close()


#: A single report, and a batch whose first report completed 2 s before it was sent (ageMs)
RUN_LATE = [
    ("/report-latency", {"brokerName": "a", "latencyMs": 5, "isolation": True}),
    ("/report-latency:batch", {"reports": [
        {"brokerName": "a", "latencyMs": 5, "isolation": True, "ageMs": 2000},
        {"brokerName": "b", "latencyMs": 700},
        {"brokerName": "c", "latencyMs": 2500, "reportId": "c-1"}]}),
]


@pytest.mark.parametrize(("path", "body"), RUN_LATE, ids=["single", "batch"])
def test_a_report_redis_runs_after_the_replica_gave_up_ends_where_it_was_answered(
        server: RedisServer, raw: redis.Redis, path: str, body: dict[str, Any]) -> None:
    """Redis is frozen while the report's call waits in its socket: the replica gives up
    after its call timeout, answers from its copy and journals the report; Redis then runs
    the call anyway, later. Both date each report when the replica accepted it
    (``ReportIn.dated``), so each window ends where the producer was told, to the
    millisecond, and each report is logged once, at that date."""
    settings = Settings(redis_url=server.url, sync_interval_s=0.2, redis_timeout_s=5)
    with TestClient(create_app(settings)) as c:
        warm(c)
        server.freeze()
        try:
            r = c.post(path, json=body)
        finally:
            server.thaw()
        assert r.status_code == 200, r.text
        answers = r.json()["results"] if "reports" in body else [r.json()]
        assert all(a["degraded"] for a in answers)  # the call timed out: answered locally
        wait_until(lambda: c.get("/readyz").json()["degraded"] is False, 30,
                   "journal replayed", interval_s=0.05)
        items = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
        for a in answers:
            b = a["brokerName"]
            assert stored_end(raw, b) == a["availableAt"], b
            assert items[b]["availableAt"] == a["availableAt"], b
            assert logged_at(raw, b) == [a["availableAt"] - a["notAvailableDurationMs"]], b


@pytest.mark.e2e
def test_the_sdk_replay_of_a_report_detour_applied_is_applied_once(
        server: RedisServer, raw: redis.Redis) -> None:
    """The late reply is Detour's own, to the SDK: it times out, queues the report and
    replays it with the same reportId."""
    with ServiceProcess(redis_url=server.url) as svc:
        proxy = DelayProxy(int(svc.url.rsplit(":", 1)[1]))
        client = DetourClient(f"http://127.0.0.1:{proxy.port}", decide_within=None, timeout=0.2,
                              retries=1, deadline=1.0)
        try:
            proxy.hold_s = HOLD_S
            client.report("sdk-a", 5, isolation=True)
            assert proxy.held > 0
            wait_until(lambda: stored(raw, "sdk-a") is not None, 10, "detour applied it")
            first = stored(raw, "sdk-a")
            assert client.stats().pending_reports >= 1  # the SDK did not hear back: queued
            proxy.hold_s = 0
            assert client.flush(20)
            assert logged(raw, "sdk-a") == 1
            assert stored(raw, "sdk-a") == first
            metrics = httpx.get(svc.url + "/metrics", timeout=10).text
            assert "detour_reports_duplicate_total 0.0" not in metrics
        finally:
            client.close()
            proxy.close()
