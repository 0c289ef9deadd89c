"""State integrity with real redis-server processes: an empty restart, a flush or a late reply
never loses a route or a window, and no report is applied twice (docs/reliability.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.settings import Settings
from service.store import codec
from service.store.merge import Candidates, calls
from tests import lua, raw_table
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer, ServiceProcess, wait_until
from tests.proxy import DelayProxy

pytestmark = [pytest.mark.integration]

ROUTE = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in "abc"]}
ISOLATE_A = {"brokerName": "a", "latencyMs": 5, "isolation": True}
FAST_SYNC = {"DETOUR_SYNC_INTERVAL_S": "0.2"}
PREFIX = "detour:{default}"


def metric(url: str, line_start: str) -> float:
    """The value of the one sample whose line starts with ``line_start``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = [ln for ln in text.splitlines() if ln.startswith(line_start + " ")]
    assert len(found) == 1, line_start
    return float(found[0].rsplit(" ", 1)[1])


def reseed_count(url: str) -> float:
    return sum(metric(url, f'detour_store_reseeds_total{{cause="{c}"}}')
               for c in ("empty", "epoch", "behind", "restart", "failover", "merge"))


def table(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/fault-items", timeout=10)
    assert r.status_code == 200, r.text
    return {i["brokerName"]: i for i in r.json()["items"]}


def store_state(url: str) -> list[str]:
    """The replica's store series (errors, resyncs, re-seeds, journal): what a failure
    should show of why it read degraded."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return [line for line in text.splitlines()
            if line.startswith(("detour_store_", "detour_view_resyncs", "detour_journal_"))
            and "_bucket" not in line]


def recovered(url: str) -> bool:
    body = httpx.get(url + "/readyz", timeout=5).json()
    return body["degraded"] is False


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


def kill_and_report_while_down(server: RedisServer, urls: list[str]) -> dict[str, int]:
    """The issue's steps 4 and 5: SIGKILL, then ten isolations y1..y10 journaled; each
    one's answered window end."""
    server.kill()
    answered: dict[str, int] = {}
    with httpx.Client(timeout=10) as c:
        for i in range(1, 11):
            url = urls[i % len(urls)]
            r = c.post(url + "/report-latency",
                       json={"brokerName": f"y{i}", "latencyMs": 5, "isolation": True})
            assert r.status_code == 200 and r.json()["degraded"] is True, r.text
            answered[f"y{i}"] = r.json()["availableAt"]
        for url in urls:  # honest health: ready (it serves from its copy) but degraded
            ready = c.get(url + "/readyz")
            assert ready.status_code == 200 and ready.json()["degraded"] is True
    return answered


@pytest.mark.e2e
@pytest.mark.parametrize("replicas", [1, 2])
def test_empty_restart_keeps_routes_windows_and_config(server: RedisServer,
                                                       replicas: int) -> None:
    """The issue's scenario exactly: route, a 600 s window, SIGKILL, ten journaled
    isolations, an empty restart on the same port. Every replica re-seeds once."""
    svcs = [ServiceProcess(redis_url=server.url, env=FAST_SYNC) for _ in range(replicas)]
    restarted: RedisServer | None = None
    try:
        urls = [s.url for s in svcs]
        with httpx.Client(base_url=urls[0], timeout=10) as c:
            assert c.put("/routes/t", json=ROUTE).status_code == 200
            assert c.patch("/config", json={"maxAvoidedPercent": 90}).status_code == 200
            r = c.post("/report-latency", json=ISOLATE_A)
            assert r.status_code == 200 and r.json()["notAvailableDurationMs"] == 600_000
            a_end = r.json()["availableAt"]
        for url in urls:  # every replica holds a's window and the route before the crash
            wait_until(lambda u=url: "a" in table(u), 10, "window in the table")
            wait_until(lambda u=url: httpx.get(u + "/routes/t", timeout=5).status_code == 200,
                       10, "route pushed")
        journaled = kill_and_report_while_down(server, urls)
        restarted = RedisServer(port=server.port)  # no persistence: an empty Redis
        for url in urls:
            wait_until(lambda u=url: recovered(u), 30, "recovered", interval_s=0.05)
        raw = restarted.client()
        for url in urls:
            r = httpx.post(url + "/select", json={"topic": "t"}, timeout=5)
            assert r.status_code == 200, r.text
            assert r.json()["brokerName"] != "a"
            items = table(url)
            assert {f"y{i}" for i in range(1, 11)} | {"a"} <= items.keys()
            assert items["a"]["availableAt"] == a_end  # not a millisecond shorter or longer
            assert items["a"]["available"] is False
            # each journaled window ends where it was answered, replayed on another clock
            assert {b: items[b]["availableAt"] for b in journaled} == journaled
        # Routes and config are back in Redis itself: a fresh replica sees them.
        assert raw.hget(f"{PREFIX}:routes", "t") is not None
        with ServiceProcess(redis_url=restarted.url) as fresh:
            assert httpx.get(fresh.url + "/routes/t", timeout=5).status_code == 200
            assert httpx.get(fresh.url + "/config", timeout=5).json()["maxAvoidedPercent"] \
                == 90
            assert table(fresh.url)["a"]["availableAt"] == a_end
        # Each journaled report is in the new latency log once.
        logged = [e["b"] for _, e in raw.xrange(f"{PREFIX}:latency-log")]
        assert sorted(logged) == sorted(f"y{i}" for i in range(1, 11))
        # The re-seed is counted and in the event log.
        reseeds = [reseed_count(u) for u in urls]
        assert all(1 <= n <= 2 for n in reseeds), reseeds
        events = [e for _, e in raw.xrange(f"{PREFIX}:events") if e["r"] == "recovery"]
        assert "a" in {e["b"] for e in events}
        # No flapping: several poll intervals later nobody re-seeded again.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for u in urls:  # (a failure says which of the reasons for degraded it was)
                assert recovered(u), (u, reseeds, store_state(u))
            time.sleep(0.1)  # watching that nothing happens over a span of time
        assert [reseed_count(u) for u in urls] == reseeds
    finally:
        for s in svcs:
            s.stop()
        if restarted is not None:
            restarted.stop()


@pytest.mark.e2e
def test_a_replica_that_never_polled_the_epoch_still_reseeds(server: RedisServer) -> None:
    """A replica that synced while the table was new holds the table only through pushes.
    Its poll is a minute away, so the only way it can know the table's epoch before Redis
    is emptied is from the pushes themselves. Then the other replica (the table's writer)
    stops: this one alone holds the route and the window, and must put them back."""
    writer = ServiceProcess(redis_url=server.url, env=FAST_SYNC)
    follower = ServiceProcess(redis_url=server.url, env={"DETOUR_SYNC_INTERVAL_S": "60"})
    restarted: RedisServer | None = None
    try:
        with httpx.Client(base_url=writer.url, timeout=10) as c:
            assert c.put("/routes/t", json=ROUTE).status_code == 200
            a_end = c.post("/report-latency", json=ISOLATE_A).json()["availableAt"]
        wait_until(lambda: "a" in table(follower.url), 10, "window pushed")
        wait_until(lambda: httpx.get(follower.url + "/routes/t", timeout=5).status_code == 200,
                   10, "route pushed")
        writer.stop()
        server.kill()
        restarted = RedisServer(port=server.port)  # no persistence: an empty Redis
        wait_until(lambda: recovered(follower.url) and reseed_count(follower.url) >= 1, 30,
                   "the follower re-seeded", interval_s=0.05)
        r = httpx.post(follower.url + "/select", json={"topic": "t"}, timeout=5)
        assert r.status_code == 200 and r.json()["brokerName"] != "a", r.text
        raw = restarted.client()
        assert raw.hget(f"{PREFIX}:routes", "t") is not None
        assert codec.decode_fault("a", raw.hget(f"{PREFIX}:faults", "a")).available_at == a_end
    finally:
        writer.stop()
        follower.stop()
        if restarted is not None:
            restarted.stop()


def test_a_flush_is_noticed_by_the_first_write_after_it(redis_url: str,
                                                         redis_server: RedisServer) -> None:
    """FLUSHALL, then a report before any poll: the write reply carries the loss, the
    replica re-seeds first (route, config, the open window) and only then writes."""
    # no poll in this test; a call timeout a busy machine does not reach (the write must go
    # to Redis, not to the journal)
    settings = Settings(redis_url=redis_url, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    raw = redis_server.client()
    with TestClient(create_app(settings)) as c:
        c.put("/routes/t", json=ROUTE)
        c.patch("/config", json={"maxAvoidedPercent": 90})
        a_end = c.post("/report-latency", json=ISOLATE_A).json()["availableAt"]
        raw.flushall()
        r = c.post("/report-latency", json={"brokerName": "b", "latencyMs": 5,
                                             "isolation": True})
        assert r.status_code == 200 and r.json()["degraded"] is False
        assert raw.hget(f"{PREFIX}:routes", "t") is not None
        assert '"maxAvoidedPercent":90' in raw.hget(f"{PREFIX}:meta", "config")
        items = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
        assert items["a"]["availableAt"] == a_end and "b" in items
        assert raw.hget(f"{PREFIX}:meta", "epoch")
        # /fault-items never shows a table without the windows this replica holds.
        raw.flushall()
        items = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
        assert items["a"]["availableAt"] == a_end and "b" in items
        # A route write into a flushed table re-seeds first as well.
        raw.flushall()
        assert c.put("/routes/u", json=ROUTE).status_code == 200
        assert {"t", "u"} <= raw_table.names(raw, f"{PREFIX}:routes")
        assert "a" in raw_table.names(raw, f"{PREFIX}:faults")


def _merge_into(raw: Any, writer: str, epoch: str, items: dict[str, str],
                routes: dict[str, str]) -> list[Any]:
    """One replica's merge as RedisStore._merge sends it (reseed.lua's calls)."""
    script = lua.script(raw, "reseed")
    keys = [f"{PREFIX}:{k}" for k in ("faults", "routes", "meta", "events", "ends", "graves",
                                      "graves-by-time")]
    c = Candidates(routes=list(routes.items()), items=list(items.items()))
    replies = [script(keys=keys, args=args)
               for args in calls(c, [f"{PREFIX}:changes", epoch, 100, writer], 10_000, True)]
    return replies[-1]  # type: ignore[no-any-return]


@pytest.mark.parametrize("order", ["short-first", "long-first"])
def test_merging_replicas_converge_and_no_window_shrinks(redis_url: str,
                                                       redis_server: RedisServer,
                                                       order: str) -> None:
    """Two replicas hold different copies of the same broker and merge them into an
    emptied table in either order: one epoch, the later end, the newer copy's rest, both
    replicas' own brokers and routes."""
    raw = redis_server.client()
    far = int(time.time() * 1000) + 600_000
    one = ("one", "e-one", {"a": f"9@5,{far - 500_000}", "b": f"3@5,{far}"},
           {"t": '4|[["a",1,null]]'})
    two = ("two", "e-two", {"a": f"7@80,{far}", "c": f"3@5,{far}"},
           {"t": '4|[["a",1,null]]', "u": '5|[["c",1,null]]'})
    runs = [one, two] if order == "short-first" else [two, one]
    epochs = {_merge_into(raw, *run)[0] for run in runs}
    assert len(epochs) == 1 and raw.hget(f"{PREFIX}:meta", "epoch") in epochs
    faults = raw_table.fields(raw, f"{PREFIX}:faults")
    # a: the later end (two's), the rest from the newer stamp (one's: latency 5, stamp 9)
    assert faults == {"a": f"9@5,{far}", "b": f"3@5,{far}", "c": f"3@5,{far}"}
    assert raw_table.names(raw, f"{PREFIX}:routes") == {"t", "u"}
    assert raw.zscore(f"{PREFIX}:ends", "a") == far  # the eviction index follows
    assert int(raw.hget(f"{PREFIX}:meta", "hlc")) >= 9  # new stamps come after the merged
    restored = [e["b"] for _, e in raw.xrange(f"{PREFIX}:events") if e["r"] == "recovery"]
    assert sorted(set(restored)) == ["a", "b", "c"]


class Producer:
    """One producer in a thread: a select and an isolation report for a new broker, in a loop."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.accepted: list[tuple[str, int, bool]] = []  # broker, availableAt, degraded
        self.selects = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            for i in range(2000):  # bounded (the table cap is 10,000); stopped far earlier
                if self.stop.is_set():
                    return
                try:
                    s = c.post("/select", json={"topic": "t"})
                    if s.status_code != 200:
                        self.failures.append(f"select {s.status_code} {s.text}")
                    self.selects += 1
                    broker = f"{self.name}-{i}"
                    r = c.post("/report-latency",
                               json={"brokerName": broker, "latencyMs": 0, "isolation": True})
                    if r.status_code != 200:
                        self.failures.append(f"report {r.status_code} {r.text}")
                        continue
                    body: dict[str, Any] = r.json()
                    self.accepted.append((broker, body["availableAt"], body["degraded"]))
                except httpx.HTTPError as exc:
                    self.failures.append(f"http {exc!r}")


@pytest.mark.e2e
@pytest.mark.slow
def test_empty_restart_under_load_loses_nothing(server: RedisServer) -> None:
    svc = ServiceProcess(redis_url=server.url, env=FAST_SYNC)
    restarted: RedisServer | None = None
    producers = [Producer(svc.url, f"p{n}") for n in range(4)]

    def accepted() -> list[tuple[str, int, bool]]:
        return [a for p in producers for a in p.accepted]

    try:
        with httpx.Client(base_url=svc.url, timeout=10) as c:
            assert c.put("/routes/t", json=ROUTE).status_code == 200
            assert c.patch("/config", json={"maxAvoidedPercent": 90}).status_code == 200
        for p in producers:
            p.thread.start()
        wait_until(lambda: len(accepted()) >= 100, 30, "load before the crash")
        server.kill()
        at_kill = len(accepted())
        wait_until(lambda: sum(d for _, _, d in accepted()) >= 40, 30,
                   "journaled reports during the outage")
        restarted = RedisServer(port=server.port)  # empty
        wait_until(lambda: recovered(svc.url), 30, "recovered", interval_s=0.05)
        at_return = len(accepted())
        wait_until(lambda: len(accepted()) >= at_return + 100, 30, "load after the restart")
        for p in producers:
            p.stop.set()
        for p in producers:
            p.thread.join(15)
        wait_until(lambda: recovered(svc.url), 30, "journal empty at the end", interval_s=0.05)

        assert [f for p in producers for f in p.failures] == []
        done = accepted()
        assert at_kill >= 100 and len(done) >= at_return + 100
        items = table(svc.url)
        missing = [b for b, _, _ in done if b not in items]
        assert missing == [], f"{len(missing)} of {len(done)} accepted reports lost"
        drift = [(b, items[b]["availableAt"] - end) for b, end, _ in done
                 if items[b]["availableAt"] != end]
        assert drift == [], f"{len(drift)} windows moved, first: {drift[:5]}"
        # Routes and config are in Redis itself: a fresh replica sees them.
        with ServiceProcess(redis_url=restarted.url) as fresh:
            assert httpx.get(fresh.url + "/routes/t", timeout=5).status_code == 200
            assert httpx.get(fresh.url + "/config", timeout=5).json()["maxAvoidedPercent"] == 90
            assert len(table(fresh.url)) >= len(done)
        assert reseed_count(svc.url) >= 1
    finally:
        for p in producers:
            p.stop.set()
        svc.stop()
        if restarted is not None:
            restarted.stop()


def test_a_table_of_ended_windows_at_the_cap_takes_a_new_broker_at_once(
        redis_url: str, redis_server: RedisServer) -> None:
    """10,000 ended windows, then a new broker: answered from Redis (no journal fallback),
    one ended item dropped for it, no scan of the table, and the cap holds."""
    raw = redis_server.client()
    cap = 10_000
    # No version poll inside the test: a poll that finds the table ahead of pushes still
    # unread on a busy machine takes a snapshot (HGETALL), which is not the eviction's.
    settings = Settings(redis_url=redis_url, max_brokers=cap, redis_call_timeout_s=5,
                        sync_interval_s=60)
    with TestClient(create_app(settings)) as c:
        for start in range(0, cap, 1000):
            batch = {"reports": [{"brokerName": f"old{i}", "latencyMs": 1}
                                 for i in range(start, start + 1000)]}
            assert c.post("/report-latency:batch", json=batch).status_code == 200
        assert raw_table.size(raw, f"{PREFIX}:faults") == cap
        raw.config_resetstat()
        raw.config_set("slowlog-log-slower-than", 0)
        raw.config_set("slowlog-max-len", 1000)
        raw.slowlog_reset()
        for n in range(30):
            r = c.post("/report-latency", json={"brokerName": f"new{n}", "latencyMs": 0,
                                                 "isolation": True})
            assert r.status_code == 200, r.text
            assert r.json()["degraded"] is False
        assert raw_table.size(raw, f"{PREFIX}:faults") <= cap
        assert raw.zcard(f"{PREFIX}:ends") == raw_table.size(raw, f"{PREFIX}:faults")
        stats: dict[str, Any] = raw.info("commandstats")
        # The eviction read the index, never the whole table.
        assert "cmdstat_hgetall" not in stats
        assert stats["cmdstat_zrangebyscore"]["calls"] <= 60
        # Redis's own measure of each report script (a scan of 10,000 items took 55 ms).
        scripts = [e["duration"] for e in raw.slowlog_get(1000)
                   if e["command"].startswith(b"EVALSHA") or
                   str(e["command"]).startswith("EVALSHA")]
        assert len(scripts) >= 30
        assert max(scripts) < 10_000, max(scripts)  # microseconds
        raw.config_set("slowlog-log-slower-than", 10_000)
        items = {i["brokerName"]: i for i in c.get("/fault-items").json()["items"]}
        assert {f"new{n}" for n in range(30)} <= items.keys()
        assert all(not items[f"new{n}"]["available"] for n in range(30))
        # Live windows filling the table are what refuses a new broker.
        for start in range(0, cap - 30, 1000):  # the 30 new ones are live too
            live = {"reports": [{"brokerName": f"live{i}", "latencyMs": 0, "isolation": True}
                                for i in range(start, min(start + 1000, cap - 30))]}
            assert c.post("/report-latency:batch", json=live).status_code == 200
        refused = c.post("/report-latency", json={"brokerName": "late", "latencyMs": 0,
                                                   "isolation": True})
        assert refused.status_code == 409 and refused.json()["error"] == "TABLE_FULL"
        assert raw_table.size(raw, f"{PREFIX}:faults") <= cap


def test_a_report_id_is_applied_once_on_every_store(client: TestClient) -> None:
    """The behaviour on both stores: a report sent again with its reportId changes nothing,
    alone or inside a batch, and is logged once; another id is a new report."""
    first = client.post("/report-latency", json={"brokerName": "a", "latencyMs": 5,
                                                  "isolation": True, "reportId": "p-1"})
    assert first.status_code == 200
    again = client.post("/report-latency:batch", json={"reports": [
        {"brokerName": "a", "latencyMs": 5, "isolation": True, "reportId": "p-1"},
        {"brokerName": "b", "latencyMs": 700, "reportId": "p-2"}]})
    assert again.status_code == 200
    dup, new = again.json()["results"]
    assert dup["availableAt"] == first.json()["availableAt"]
    assert dup["notAvailableDurationMs"] == 600_000
    assert new["notAvailableDurationMs"] == 30_000
    log = client.get("/latency-log").json()["entries"]
    assert [e["brokerName"] for e in log] == ["a", "b"]
    bad = client.post("/report-latency", json={"brokerName": "a", "latencyMs": 5,
                                                "reportId": "x" * 65})
    assert bad.status_code == 422 and bad.json()["field"] == "reportId"


def test_a_full_table_of_ended_windows_takes_a_new_broker_while_redis_is_late(
        redis_server: RedisServer) -> None:
    """The journal path too: TABLE_FULL only when live windows fill the table."""
    proxy = DelayProxy(redis_server.port)
    raw = redis_server.client()
    raw.flushall()
    settings = Settings(redis_url=proxy.url, max_brokers=20, redis_timeout_s=5,
                        sync_interval_s=0.2)
    try:
        with TestClient(create_app(settings)) as c:
            batch = {"reports": [{"brokerName": f"old{i}", "latencyMs": 1} for i in range(20)]}
            assert c.post("/report-latency:batch", json=batch).status_code == 200
            proxy.hold_s = 0.6  # the report's call times out: the journal takes it
            r = c.post("/report-latency", json={"brokerName": "new", "latencyMs": 0,
                                                 "isolation": True})
            assert r.status_code == 200 and r.json()["degraded"] is True
            proxy.hold_s = 0
            wait_until(lambda: c.get("/readyz").json()["degraded"] is False, 30, "replayed",
                       interval_s=0.05)
            assert raw_table.size(raw, f"{PREFIX}:faults") <= 20
            assert "new" in raw_table.names(raw, f"{PREFIX}:faults")
    finally:
        proxy.close()
