"""What only the Redis store has: Lua scripts, key layout, push sync, one round trip, outages."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from detour import policy
from detour.model import Config, FaultItem
from detour.view import CHANGES_PER_TURN
from service.app import create_app
from service.settings import Settings
from service.store import ReportIn, codec
from service.store.redis import RedisStore
from tests import lua
from tests.asgi_client import TestClient
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer, wait_until, wait_until_async

pytestmark = pytest.mark.integration


def patient(**fields: Any) -> Settings:
    """Settings whose report timeout a busy machine does not reach (procs.PATIENT_CALL_TIMEOUT_S):
    these tests count Redis calls and pushes, which a report gone to the journal changes."""
    return Settings(redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S, **fields)

PREFIX = "detour:{default}"


def commandstats(r: redis.Redis) -> dict[str, int]:
    info: dict[str, Any] = r.info("commandstats")
    # INFO itself is counted too: leave out the test's own calls.
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()
            if k != "cmdstat_info"}


@pytest.fixture
def raw(redis_url: str, redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client() as c:
        yield c


def test_keys_share_one_hash_tag(redis_url: str, raw: redis.Redis) -> None:
    with TestClient(create_app(patient(redis_url=redis_url))) as c:
        c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 1}]})
        c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
        c.patch("/config", json={})
    keys = sorted(raw.keys("*"))
    assert keys == [f"{PREFIX}:ends", f"{PREFIX}:events", f"{PREFIX}:faults",
                    f"{PREFIX}:graves", f"{PREFIX}:latency-log", f"{PREFIX}:meta",
                    f"{PREFIX}:routes",
                    f"{PREFIX}:writers", f"{PREFIX}:writers-seen"]
    assert raw.hget(f"{PREFIX}:faults", "a") is not None


def test_namespaces_do_not_share_keys(redis_url: str, raw: redis.Redis) -> None:
    with TestClient(create_app(patient(redis_url=redis_url, namespace="blue"))) as c:
        c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
    with TestClient(create_app(patient(redis_url=redis_url, namespace="green"))) as c:
        assert c.get("/fault-items").json()["items"] == []
    assert raw.exists("detour:{blue}:faults") and not raw.exists("detour:{green}:faults")


def settled(c: TestClient) -> None:
    """Wait until the app's store is neither catching up with Redis nor replaying a journal
    (``RedisStore.degraded``): on a busy machine a replica can fall behind its pushes and
    resync, and the reports it takes meanwhile are journaled and replayed together, which
    is not the round trip these tests count."""
    store = c.app_state["store"]
    wait_until(lambda: not store.degraded, 10, "the store settled")


#: Tries of a count a resync disturbed (its reports answered ``degraded``), at most.
COUNT_TRIES = 3


@pytest.mark.parametrize("flush_ms", [0, 60_000])
def test_one_round_trip_per_report_and_none_per_select(redis_url: str, raw: redis.Redis,
                                                       flush_ms: int) -> None:
    """flush 0: every report one script call. Otherwise (docs/semantics.md) only the reports
    that can change a window, and a broker's first: here the six from 560 ms up (tier
    550 ms) and b's first; the rest wait for the flush (none during the count)."""
    settings = patient(redis_url=redis_url, sync_interval_s=60,  # no poll during the count
                       report_flush_ms=flush_ms)
    for _ in range(COUNT_TRIES):
        raw.flushall()
        with TestClient(create_app(settings)) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 2},
                                                 {"brokerName": "b", "writeQueueNums": 2}]})
            c.post("/report-latency", json={"brokerName": "a", "latencyMs": 1})  # connects
            settled(c)
            before = commandstats(raw)
            answers = [c.post("/report-latency", json={"brokerName": "ab"[i % 2],
                                                       "latencyMs": i * 40}).json()
                       for i in range(20)]
            middle = commandstats(raw)
            for _ in range(50):
                assert c.post("/select", json={"topic": "t"}).status_code == 200
            after = commandstats(raw)
        if not any(a["degraded"] for a in answers):
            break
    assert not any(a["degraded"] for a in answers), answers
    delta = {k: middle.get(k, 0) - before.get(k, 0) for k in middle}
    assert delta["evalsha"] == (20 if flush_ms == 0 else 7)
    # Redis counts the script's own commands too; nothing else came from the client but,
    # on a busy machine, the handshake of a connection opened meanwhile (HELLO, CLIENT).
    assert {k for k, v in delta.items() if v} <= {"evalsha", "hget", "hset", "time", "hexists",
                                                  "hlen", "hdel", "hincrby", "publish", "xadd",
                                                  "zadd", "zcard", "zrangebyscore", "hello",
                                                  "client"}
    assert sum(after.values()) == sum(middle.values())


def test_scripts_reload_after_script_flush(redis_url: str, raw: redis.Redis) -> None:
    with TestClient(create_app(patient(redis_url=redis_url))) as c:
        raw.script_flush()
        r = c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
        assert r.status_code == 200
        assert r.json()["notAvailableDurationMs"] == 600000


def test_report_lua_refuses_a_stale_config_and_a_table_behind_the_callers(
        raw: redis.Redis) -> None:
    """The report names the config stamp it computed with: a newer one in the table is a
    stale config (-1: recompute); an older one means the table lost the caller's config
    (-3: merge). Nothing is written either way."""
    script = lua.script(raw, "report")
    raw.hset(f"{PREFIX}:meta", "config_stamp", 3)
    args = lua.head(Config(), config_stamp=2) + lua.entry(Config(), ReportIn("a", 10))
    out = script(keys=lua.REPORT_KEYS, args=args)
    assert out[0] == -1 and int(out[5]) == 3
    args = lua.head(Config(), config_stamp=4) + lua.entry(Config(), ReportIn("a", 10))
    out = script(keys=lua.REPORT_KEYS, args=args)
    assert out[0] == -3
    assert not raw.exists(f"{PREFIX}:faults")


def test_report_recomputes_after_a_config_it_had_not_seen(redis_url: str) -> None:
    async def scenario() -> None:
        settings = patient(redis_url=redis_url)
        a, b = RedisStore(settings), RedisStore(settings)
        await a.start()
        await b.start()
        try:
            # Stop a's sync so the push of b's config change never reaches it, and
            # let a believe it is still synced (the push was merely lost).
            assert a._task is not None
            a._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await a._task
            a.synced.set()
            await b.put_config(Config(latency_max=(0,), not_available_duration=(1234,)))
            assert a.view.config.latency_max != (0,)
            (out,) = await a.report_many([ReportIn("x", 5)])
            assert out.not_available_duration_ms == 1234
            assert a.view.config.latency_max == (0,)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_replicas_follow_each_other(redis_url: str) -> None:
    settings = patient(redis_url=redis_url)
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        a.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1},
                                             {"brokerName": "y", "writeQueueNums": 1}]})
        wait_until(lambda: b.get("/routes/t").status_code == 200, 10, "route push")
        a.post("/report-latency", json={"brokerName": "x", "latencyMs": 0, "isolation": True})

        def b_avoids_x() -> bool:
            picks = {b.post("/select", json={"topic": "t"}).json()["brokerName"] for _ in range(2)}
            return picks == {"y"}

        wait_until(b_avoids_x, 10, "fault push")
        a.patch("/config", json={"sendLatencyFaultEnable": False})
        wait_until(lambda: b.get("/config").json()["sendLatencyFaultEnable"] is False, 10,
                   "config push")
        a.delete("/fault-items/x")
        a.patch("/config", json={})
        wait_until(lambda: {b.post("/select", json={"topic": "t"}).json()["brokerName"]
                            for _ in range(2)} == {"x", "y"}, 10, "clear push")
        a.delete("/routes/t")
        wait_until(lambda: b.get("/routes/t").status_code == 404, 10, "route delete push")


def test_replica_reseeds_a_redis_that_lost_its_data(redis_url: str, raw: redis.Redis) -> None:
    settings = patient(redis_url=redis_url, sync_interval_s=0.1)
    with TestClient(create_app(settings)) as c:
        c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1}]})
        c.patch("/config", json={"isolationLatencyMs": 1000})
        raw.flushall()  # what a restart without persistence looks like
        wait_until(lambda: raw.hget(f"{PREFIX}:routes", "t") is not None, 15, "re-seeded route")
        wait_until(lambda: raw.hget(f"{PREFIX}:meta", "config") is not None, 15,
                   "re-seeded config")
        assert c.get("/routes/t").status_code == 200
        assert c.get("/config").json()["isolationLatencyMs"] == 1000
        r = c.post("/report-latency", json={"brokerName": "x", "latencyMs": 0, "isolation": True})
        assert r.json()["notAvailableDurationMs"] == 60000 and r.json()["degraded"] is False


def test_redis_outage_degrades_never_500() -> None:
    server = RedisServer()
    try:
        settings = Settings(redis_url=server.url, redis_timeout_s=2.0)
        with TestClient(create_app(settings)) as c:
            c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 2},
                                                 {"brokerName": "y", "writeQueueNums": 2}]})
            server.proc.kill()
            server.proc.wait(10)
            r = c.post("/report-latency", json={"brokerName": "x", "latencyMs": 0,
                                                "isolation": True})
            assert r.status_code == 200 and r.json()["degraded"] is True
            assert r.json()["notAvailableDurationMs"] == 600000
            ready = c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["degraded"] is True
            # The replica's copy obeys the journaled report at once.
            picks = [c.post("/select", json={"topic": "t"}).json() for _ in range(4)]
            assert {p["brokerName"] for p in picks} == {"y"}
            assert all(p["degraded"] for p in picks)
            # What needs Redis itself says so.
            assert c.get("/fault-items").status_code == 503
            r = c.put("/routes/u", json={"brokers": [{"brokerName": "z", "writeQueueNums": 1}]})
            assert r.status_code == 503 and r.json()["error"] == "STORE_UNAVAILABLE"
            text = c.get("/metrics").text
            assert 'detour_store_degraded{namespace="default"} 1.0' in text
            assert "detour_journal_reports 1.0" in text
    finally:
        server.stop()


def test_starts_while_redis_is_down_and_syncs_when_it_comes_up() -> None:
    from tests.procs import free_port

    port = free_port()
    settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=2.0)
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200
        server = RedisServer(port=port)
        try:
            wait_until(lambda: c.get("/readyz").status_code == 200, 15, "sync after redis start")
        finally:
            server.stop()


def test_reports_that_change_no_window_push_nothing(redis_url: str, raw: redis.Redis) -> None:
    """Thousands of sidecar replicas subscribe: a healthy broker's reports must not wake them.
    (No flush during the count: a flush is its own write, tested in test_lean_reports.)"""
    settings = patient(redis_url=redis_url, sync_interval_s=60, report_flush_ms=60_000)
    for _ in range(COUNT_TRIES):
        raw.flushall()
        with TestClient(create_app(settings)) as c:
            c.post("/report-latency", json={"brokerName": "a", "latencyMs": 700})  # opens: 1 push
            settled(c)
            before = commandstats(raw).get("publish", 0)
            answers = []
            for latency in (10, 20, 549, 30, 0):  # inside the open window, or below every tier
                for broker in "ab":
                    answers.append(c.post("/report-latency", json={
                        "brokerName": broker, "latencyMs": latency}).json())
            quiet = commandstats(raw).get("publish", 0)
            c.post("/report-latency", json={"brokerName": "b", "latencyMs": 0, "isolation": True})
            opened = commandstats(raw).get("publish", 0)
        if not any(a["degraded"] for a in answers):
            break
    assert not any(a["degraded"] for a in answers), answers
    assert quiet == before
    assert opened == before + 1


def test_reach_lua_matches_the_codec(raw: redis.Redis) -> None:
    """Differential test: reach.lua rewrites an item exactly as policy.reach would (a reading
    replaced; with earlyRecovery, refused-then-reachable ends an open window on probation)."""
    import dataclasses

    script = lua.script(raw, "reach")
    rng = random.Random(5)
    for _ in range(300):
        item = FaultItem("a", rng.choice([0, 40]), rng.choice([1, 4_102_444_800_000]),
                         rng.choice([0, 0, 3]),
                         tuple(rng.sample([("p1", 7), ("p2", 9), ("", 11)], rng.randint(0, 2))),
                         rng.random() < 0.5, rng.choice([None, True, False]))
        raw.hset(f"{PREFIX}:faults", "a", codec.encode_fault(item))
        reading = rng.random() < 0.5
        early = rng.random() < 0.5
        sec, usec = raw.time()
        before = sec * 1000 + usec // 1000
        out = script(keys=[f"{PREFIX}:faults", f"{PREFIX}:meta", f"{PREFIX}:ends"],
                     args=[f"{PREFIX}:changes", int(early), 0, "a", int(reading), "missing", 1])
        got = codec.decode_fault("a", raw.hget(f"{PREFIX}:faults", "a"))
        expected = policy.reach(item, reading, before, Config(early_recovery=early))
        if expected.available_at != item.available_at:  # ended now, on Redis's clock
            assert before <= got.available_at <= before + 1000
            assert raw.zscore(f"{PREFIX}:ends", "a") == got.available_at
            expected = dataclasses.replace(expected, available_at=got.available_at)
        assert got == expected
        stored = raw.hget(f"{PREFIX}:faults", "a")
        assert lua.unstamped(stored) == (lua.stored_form(expected) if item.reachable is not reading
                                         else lua.stored_form(item))
        assert [b for b, _, _ in out] == (["a"] if item.reachable is not reading else [])
    assert not raw.hexists(f"{PREFIX}:faults", "missing")


def test_detector_lease_is_held_by_one_replica(redis_url: str) -> None:
    async def scenario() -> None:
        settings = patient(redis_url=redis_url)
        a, b = RedisStore(settings), RedisStore(settings)
        await a.start()
        await b.start()
        try:
            assert await a.detector_lease(60_000)
            assert not await b.detector_lease(60_000)
            assert await a.detector_lease(60_000)  # renewed by its holder
            assert await a.detector_lease(1)  # a short lease ends on its own...
            async with asyncio.timeout(5):
                while not await b.detector_lease(60_000):  # ...and the other takes over
                    await asyncio.sleep(0.005)
            assert not await a.detector_lease(60_000)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_report_acknowledged_during_a_poll_does_not_make_the_poll_look_lost(
        redis_url: str) -> None:
    """A poll answered before a report was acknowledged carries the older high-water mark
    and version; judged against what the replica held when it sent the poll, that is no
    loss (judged against what it holds when the answer is read, it looked "behind" and the
    replica re-seeded a table that had lost nothing)."""
    async def scenario() -> None:
        store = RedisStore(patient(redis_url=redis_url, sync_interval_s=60))
        await store.start()
        try:
            await store.report_many([ReportIn("a", 5, isolation=True)])
            held = store.held()
            reply = await store.poll()
            # Acknowledged after the poll's answer left Redis, before it is judged.
            await store.report_many([ReportIn("b", 5, isolation=True)])
            assert store.held() != held
            assert not store.table_lost(reply, held)
            # A real loss is still one, whatever was held.
            redis.Redis.from_url(redis_url).flushall()
            assert store.table_lost(await store.poll(), store.held())
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_burst_of_pushes_is_applied_a_few_at_a_time(redis_url: str) -> None:
    """A batch's window changes reach a replica together, and redis-py reads buffered pushes
    without giving up the event loop: applied all in one turn, they held every request behind
    them. The follower gives the loop up every ``CHANGES_PER_TURN`` pushes, so between two
    turns of another task its view moves by at most that many versions."""
    settings = patient(redis_url=redis_url, namespace=f"burst-{uuid.uuid4().hex[:8]}",
                       sync_interval_s=60, report_flush_ms=0)
    changes = 400

    async def write(brokers: range) -> None:
        writer = RedisStore(settings)
        await writer.start()
        try:
            for start in range(brokers.start, brokers.stop, 25):  # a batch's chunks
                await writer.report_many([ReportIn(f"b{i}", 600, False)  # each a new window
                                          for i in range(start, min(start + 25, brokers.stop))])
            assert not writer.degraded
        finally:
            await writer.close()

    failed: list[BaseException] = []

    def in_a_thread(brokers: range) -> threading.Thread:
        def run() -> None:
            try:
                asyncio.run(write(brokers))
            except BaseException as exc:  # noqa: BLE001 - the test thread asserts on it
                failed.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    async def scenario() -> None:
        follower = RedisStore(settings)
        await follower.start()
        try:
            # One push applied: the follower is in its loop, subscribed.
            await asyncio.to_thread(in_a_thread(range(1)).join, 60)
            assert not failed, failed
            await wait_until_async(lambda: follower.view.version == 1, 20, "the first push")
            # The burst is written while this loop is held: its pushes wait in the socket.
            burst = in_a_thread(range(1, 1 + changes))
            burst.join(60)
            assert not burst.is_alive() and not failed, failed
            seen = [follower.view.version]
            for _ in range(100_000):
                if seen[-1] >= 1 + changes:
                    break
                await asyncio.sleep(0)
                seen.append(follower.view.version)
            assert seen[-1] == 1 + changes
            steps = [b - a for a, b in itertools.pairwise(seen)]
            assert max(steps) <= CHANGES_PER_TURN, max(steps)
            assert sum(1 for s in steps if s) >= changes // CHANGES_PER_TURN
        finally:
            await follower.close()

    asyncio.run(scenario())


def test_a_report_taken_during_a_merge_stays_on_the_copy_until_it_is_in_redis(
    redis_url: str, raw: redis.Redis
) -> None:
    """A report that arrives while a resync merges (Redis lost the table) is journaled and
    answered from this replica's copy. The resync then installs Redis's table: the
    journaled window must stay on the copy (selects keep avoiding the broker) until the
    replay has put it in Redis."""
    settings = patient(redis_url=redis_url, sync_interval_s=60, report_flush_ms=0)

    async def scenario() -> None:
        store = RedisStore(settings)
        await store.start()
        # Only this test resyncs and replays: the store's own follower, which would do both
        # when it notices the flush, is stopped.
        assert store._task is not None
        store._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await store._task
        try:
            await store.report_many([ReportIn("a", 5)])  # the table this replica holds
            raw.flushall()  # Redis loses it: the next resync merges
            release = asyncio.Event()
            merge = store._merge

            async def held_merge(*args: Any, **kwargs: Any) -> bool:
                await release.wait()
                return await merge(*args, **kwargs)

            store._merge = held_merge  # type: ignore[method-assign]
            resync = asyncio.create_task(store.resync())
            await wait_until_async(lambda: store._recovering, 10, "the merge under way")
            (answer,) = await store.report_many([ReportIn("b", 0, isolation=True)])
            assert answer.degraded and answer.not_available_duration_ms > 0
            release.set()
            await asyncio.wait_for(resync, 10)
            item = store.view.faults.get("b")
            assert item is not None and not item.is_available(store.view.now_ms())
            assert item.available_at == answer.available_at
            await store.replay_journal()
            stored = raw.hget(f"{PREFIX}:faults", "b")
            assert stored is not None
            assert codec.decode_fault("b", str(stored)).available_at == answer.available_at
        finally:
            await store.close()

    asyncio.run(scenario())


def test_resyncs_asked_for_at_once_run_one_at_a_time(redis_url: str, raw: redis.Redis) -> None:
    """After a FLUSHALL the follower and a request may each ask for a resync at the same
    moment. They run one at a time: one merge, not two racing over the replica's epoch and
    lineage; and of those that waited, the first reads the merged table and the others end
    with it (each read Redis after its caller saw the loss)."""
    settings = patient(redis_url=redis_url, sync_interval_s=60, report_flush_ms=0)

    async def scenario() -> None:
        store = RedisStore(settings)
        await store.start()
        assert store._task is not None  # only this test resyncs: the follower is stopped
        store._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await store._task
        try:
            (a,) = await store.report_many([ReportIn("a", 0, isolation=True)])
            raw.flushall()
            release = asyncio.Event()
            merges, snapshots = [], []
            merge, snapshot = store._merge, store._snapshot

            async def held_merge(*args: Any, **kwargs: Any) -> bool:
                merges.append(args[0])
                await release.wait()
                return await merge(*args, **kwargs)

            async def counted_snapshot(*args: Any, **kwargs: Any) -> Any:
                snapshots.append(1)
                return await snapshot(*args, **kwargs)

            store._merge = held_merge  # type: ignore[method-assign]
            store._snapshot = counted_snapshot  # type: ignore[method-assign]
            first = asyncio.create_task(store.resync())
            await wait_until_async(lambda: merges, 10, "the first resync's merge under way")
            waiting = [asyncio.create_task(store.resync()) for _ in range(3)]
            for _ in range(20):  # every waiter reaches the lock (no Redis call before it)
                await asyncio.sleep(0)
            assert store._recovering and len(snapshots) == 1
            release.set()
            await asyncio.wait_for(asyncio.gather(first, *waiting), 10)
            assert merges == ["empty"]
            # the first: before and after its merge; one waiter: the merged table; the rest
            # end with that one
            assert len(snapshots) == 3
            assert not store._recovering
            stored = raw.hget(f"{PREFIX}:faults", "a")
            assert stored is not None
            assert codec.decode_fault("a", str(stored)).available_at == a.available_at
            assert store.view.faults["a"].available_at == a.available_at
        finally:
            await store.close()

    asyncio.run(scenario())
