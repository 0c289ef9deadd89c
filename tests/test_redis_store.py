"""What only the Redis store has: Lua scripts, key layout, push sync, one round trip, outages."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from detour import policy, strategy
from detour.model import Config, FaultItem
from service.app import create_app
from service.settings import Settings
from service.store import ReportIn, codec
from service.store.redis import RedisStore, _policy_arg, integrity_arg
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer, wait_until
from tests.rule import applied


def stored_form(item: FaultItem) -> str:
    """The one string the Lua scripts write for ``item`` (the format codec.decode_fault
    reads): the fields past ``latencyMs,availableAt`` only as far as the policy keeps more."""
    if not item.isolations and not item.suspects and not item.slow and not item.probation \
            and item.reachable is None:
        return f"{item.current_latency_ms},{item.available_at}"
    head = f"{item.current_latency_ms},{item.available_at},{item.isolations}"
    if item.reachable is not None:
        head += f",{int(item.probation)},{int(item.reachable)}"
    elif item.probation:
        head += ",1"
    return (head + "".join(f";{p}={a}" for p, a in item.suspects)
            + "".join(f";{p}={a}={e}" for p, a, e in item.slow))

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
        c.put("/config", json={})
    keys = sorted(raw.keys("*"))
    assert keys == [f"{PREFIX}:ends", f"{PREFIX}:events", f"{PREFIX}:faults",
                    f"{PREFIX}:latency-log", f"{PREFIX}:meta", f"{PREFIX}:routes",
                    f"{PREFIX}:writers", f"{PREFIX}:writers-seen"]
    assert raw.hget(f"{PREFIX}:faults", "a") is not None


def test_namespaces_do_not_share_keys(redis_url: str, raw: redis.Redis) -> None:
    with TestClient(create_app(patient(redis_url=redis_url, namespace="blue"))) as c:
        c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
    with TestClient(create_app(patient(redis_url=redis_url, namespace="green"))) as c:
        assert c.get("/fault-items").json()["items"] == []
    assert raw.exists("detour:{blue}:faults") and not raw.exists("detour:{green}:faults")


@pytest.mark.parametrize("flush_ms", [0, 60_000])
def test_one_round_trip_per_report_and_none_per_select(redis_url: str, raw: redis.Redis,
                                                       flush_ms: int) -> None:
    """flush 0: every report one script call. Otherwise (docs/semantics.md) only the reports
    that can change a window, and a broker's first: here the six from 560 ms up (tier
    550 ms) and b's first; the rest wait for the flush (none during the count)."""
    settings = patient(redis_url=redis_url, sync_interval_s=60,  # no poll during the count
                       report_flush_ms=flush_ms)
    with TestClient(create_app(settings)) as c:
        c.put("/routes/t", json={"brokers": [{"brokerName": "a", "writeQueueNums": 2},
                                             {"brokerName": "b", "writeQueueNums": 2}]})
        c.post("/report-latency", json={"brokerName": "a", "latencyMs": 1})  # connects
        before = commandstats(raw)
        for i in range(20):
            c.post("/report-latency", json={"brokerName": "ab"[i % 2], "latencyMs": i * 40})
        middle = commandstats(raw)
        for _ in range(50):
            assert c.post("/select", json={"topic": "t"}).status_code == 200
        after = commandstats(raw)
    delta = {k: middle.get(k, 0) - before.get(k, 0) for k in middle}
    assert delta["evalsha"] == (20 if flush_ms == 0 else 7)
    # Redis counts the script's own commands too; nothing else came from the client.
    assert {k for k, v in delta.items() if v} <= {"evalsha", "hget", "hset", "time", "hexists",
                                                  "hlen", "hdel", "hincrby", "publish", "xadd",
                                                      "zadd", "zcard", "zrangebyscore"}
    assert sum(after.values()) == sum(middle.values())


def test_scripts_reload_after_script_flush(redis_url: str, raw: redis.Redis) -> None:
    with TestClient(create_app(patient(redis_url=redis_url))) as c:
        raw.script_flush()
        r = c.post("/report-latency", json={"brokerName": "a", "latencyMs": 0, "isolation": True})
        assert r.status_code == 200
        assert r.json()["notAvailableDurationMs"] == 600000


def _report_script(raw: redis.Redis) -> Any:
    from importlib import resources

    return raw.register_script(
        (resources.files("service.store") / "lua" / "report.lua").read_text())


def _run_reports(raw: redis.Redis, script: Any, rule: str,
                 reports: list[tuple[str, int, int, int]], config_version: int = 0) -> Any:
    args: list[Any] = [config_version, rule, f"{PREFIX}:changes", 1000, 10_000,
                       _policy_arg(Config()), "", "test", integrity_arg(0)]
    for broker, latency, duration, age in reports:
        args += [broker, latency, duration, age, 0, "test", 0, 0, "", "test", 0, ""]
    return script(keys=REPORT_KEYS, args=args)


REPORT_KEYS = [f"{PREFIX}:{k}" for k in ("faults", "meta", "latency-log", "events", "ends",
                                         "writers", "writers-seen", "report-ids")]


def test_report_lua_matches_the_python_rule(raw: redis.Redis) -> None:
    """Differential test: report.lua and strategy.apply_report/window_change agree."""
    script = _report_script(raw)
    rng = random.Random(7)
    model: dict[str, FaultItem] = {}
    version = sent = 0
    for _ in range(150):
        rule = rng.choice(["extend", "overwrite"])
        batch = [
            (rng.choice("abc"), rng.choice([0, 10, 549, 550, 1000, 15000]),
             rng.choice([0, 0, 1, 5, 30000, 600000]), rng.choice([0, 0, 0, 3, 40000]))
            for _ in range(rng.randint(1, 4))
        ]
        status, now, ends, pushed, changes, evicted, *_ = _run_reports(raw, script, rule, batch)
        assert evicted == 0
        sent += len(batch)
        assert status == 1 and len(ends) == len(pushed) == len(changes) == len(batch)
        for (broker, latency, duration, age), end, v, change in zip(
                batch, ends, pushed, changes, strict=True):
            old = model.get(broker)
            expected = strategy.apply_report(old, broker, latency, duration, now - age,
                                             rule == "overwrite")
            assert end == expected.available_at
            kind = strategy.window_change(old.available_at if old else None, end, now)
            assert change == kind.value
            changed = kind is not strategy.WindowChange.NONE
            assert (v > 0) == changed
            if changed:
                version += 1
                assert v == version
            model[broker] = expected
        for broker, item in model.items():
            assert raw.hget(f"{PREFIX}:faults", broker) == \
                f"{item.current_latency_ms},{item.available_at}"
    # "off" reads only.
    before = raw.hgetall(f"{PREFIX}:faults")
    status, now, ends, pushed, changes, *_ = _run_reports(
        raw, script, "off", [("a", 0, 600000, 0), ("zz", 0, 1, 0)])
    assert (status, ends, pushed, changes) == (1, [model["a"].available_at, now], [0, 0], [0, 0])
    assert raw.hgetall(f"{PREFIX}:faults") == before
    # Every report went to the latency log, "off" ones too.
    assert raw.xlen(f"{PREFIX}:latency-log") == sent + 2


def test_report_lua_matches_the_policy(raw: redis.Redis) -> None:
    """Differential test: report.lua and policy.apply agree on both quorums, backoff,
    jitter, probation (probeOnExpiry, earlyRecovery's early probation) and rampMs's kept
    window end."""
    import dataclasses

    script = _report_script(raw)
    rng = random.Random(11)
    model: dict[str, FaultItem] = {}
    for round_ in range(120):
        config = Config(
            isolation_quorum=rng.choice([1, 2, 3]),
            quorum_window_ms=rng.choice([1, 50_000, 600_000]),
            repeat_multiplier=rng.random() < 0.6,
            max_isolation_ms=rng.choice([1, 900_000, 3_600_000]),
            repeat_decay_ms=rng.choice([1, 30_000, 600_000]),
            jitter_percent=rng.choice([0, 0, 10, 100]),
            last_report_wins=rng.random() < 0.2,
            probe_on_expiry=rng.random() < 0.5,
            latency_quorum=rng.choice([1, 2, 3]),
            early_recovery=rng.random() < 0.4,
            ramp_ms=rng.choice([0, 0, 3000, 600_000]),
        )
        if model and rng.random() < 0.3:
            # the detector's refused-then-reachable reading (policy.reach), as reach.lua
            # writes it: an early probation the next reports decide
            b = rng.choice(sorted(model))
            sec, usec = raw.time()
            t = sec * 1000 + usec // 1000
            down = dataclasses.replace(model[b], reachable=False,
                                       available_at=max(model[b].available_at, t + 60_000))
            model[b] = policy.reach(down, True, t - rng.choice([0, 5000]), config)
            raw.hset(f"{PREFIX}:faults", b, stored_form(model[b]))
        batch = []
        args: list[Any] = [0, "overwrite" if config.last_report_wins else "extend",
                           f"{PREFIX}:changes", 1000, 10_000, _policy_arg(config), "",
                           "test", integrity_arg(0)]
        for _ in range(rng.randint(1, 4)):
            isolation = rng.random() < 0.5
            report = (rng.choice("ab"), rng.choice([0, 10, 550, 1200, 15000]), isolation,
                      rng.choice([None, "broker", "local"]), rng.choice(["p1", "p2", "p3", ""]),
                      rng.choice([0, 0, 3, 40_000, 700_000]),
                      rng.randrange(policy.JITTER_SCALE))
            broker, latency, isolation, origin, producer, age, roll = report
            duration = strategy.report_duration(config, latency, isolation)
            args += [broker, latency, duration, age, int(isolation), producer,
                     1 if policy.counts_toward_quorum(config, isolation, origin)
                     else 2 if policy.counts_toward_latency_quorum(
                         config, isolation, duration, origin) else 0, roll, "",
                     producer, 0, ""]
            batch.append(report)
        reply = script(keys=REPORT_KEYS, args=args)
        status, now, ends, _, _, _, quorums, asked, values, probes, _ = reply
        assert status == 1
        for (broker, latency, isolation, origin, producer, age, roll), end, q, d, value, pr in zip(
                batch, ends, quorums, asked, values, probes, strict=True):
            out = applied(model.get(broker), broker, latency, isolation, origin, producer,
                               now - age, now, config, roll)
            assert (end, d, q) == (out.item.available_at, out.duration_ms,
                                   2 if out.quorum_reached else 1 if out.suspected else 0), round_
            assert value == stored_form(out.item)
            assert pr == {None: 0, "passed": 1, "failed": 2}[out.probe]
            assert codec.decode_fault(broker, value) == out.item
            model[broker] = out.item


def test_report_lua_refuses_a_stale_config(raw: redis.Redis) -> None:
    script = _report_script(raw)
    raw.hset(f"{PREFIX}:meta", "config_version", 3)
    out = _run_reports(raw, script, "extend", [("a", 10, 0, 0)], config_version=2)
    assert out[0] == -1 and out[5] == 3
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
        a.put("/config", json={"sendLatencyFaultEnable": False})
        wait_until(lambda: b.get("/config").json()["sendLatencyFaultEnable"] is False, 10,
                   "config push")
        a.delete("/fault-items/x")
        a.put("/config", json={})
        wait_until(lambda: {b.post("/select", json={"topic": "t"}).json()["brokerName"]
                            for _ in range(2)} == {"x", "y"}, 10, "clear push")
        a.delete("/routes/t")
        wait_until(lambda: b.get("/routes/t").status_code == 404, 10, "route delete push")


def test_replica_reseeds_a_redis_that_lost_its_data(redis_url: str, raw: redis.Redis) -> None:
    settings = patient(redis_url=redis_url, sync_interval_s=0.1)
    with TestClient(create_app(settings)) as c:
        c.put("/routes/t", json={"brokers": [{"brokerName": "x", "writeQueueNums": 1}]})
        c.put("/config", json={"isolationLatencyMs": 1000})
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
    """Thousands of sidecar replicas subscribe: a healthy broker's reports must not wake them."""
    settings = patient(redis_url=redis_url, sync_interval_s=60)
    with TestClient(create_app(settings)) as c:
        c.post("/report-latency", json={"brokerName": "a", "latencyMs": 700})  # opens: 1 push
        before = commandstats(raw).get("publish", 0)
        for latency in (10, 20, 549, 30, 0):  # inside the open window, or below every tier
            c.post("/report-latency", json={"brokerName": "a", "latencyMs": latency})
            c.post("/report-latency", json={"brokerName": "b", "latencyMs": latency})
        assert commandstats(raw).get("publish", 0) == before
        c.post("/report-latency", json={"brokerName": "b", "latencyMs": 0, "isolation": True})
        assert commandstats(raw).get("publish", 0) == before + 1


def test_reach_lua_matches_the_codec(raw: redis.Redis) -> None:
    """Differential test: reach.lua rewrites an item exactly as policy.reach would (a reading
    replaced; with earlyRecovery, refused-then-reachable ends an open window on probation)."""
    import dataclasses
    from importlib import resources

    script = raw.register_script(
        (resources.files("service.store") / "lua" / "reach.lua").read_text())
    rng = random.Random(5)
    for _ in range(300):
        item = FaultItem("a", rng.choice([0, 40]), rng.choice([1, 4_102_444_800_000]),
                         rng.choice([0, 0, 3]),
                         tuple(rng.sample([("p1", 7), ("p2", 9), ("", 11)], rng.randint(0, 2))),
                         rng.random() < 0.5, rng.choice([None, True, False]))
        raw.hset(f"{PREFIX}:faults", "a", stored_form(item))
        reading = rng.random() < 0.5
        early = rng.random() < 0.5
        sec, usec = raw.time()
        before = sec * 1000 + usec // 1000
        out = script(keys=[f"{PREFIX}:faults", f"{PREFIX}:meta", f"{PREFIX}:ends"],
                     args=[f"{PREFIX}:changes", int(early), "a", int(reading), "missing", 1])
        got = codec.decode_fault("a", raw.hget(f"{PREFIX}:faults", "a"))
        expected = policy.reach(item, reading, before, Config(early_recovery=early))
        if expected.available_at != item.available_at:  # ended now, on Redis's clock
            assert before <= got.available_at <= before + 1000
            assert raw.zscore(f"{PREFIX}:ends", "a") == got.available_at
            expected = dataclasses.replace(expected, available_at=got.available_at)
        assert got == expected
        stored = raw.hget(f"{PREFIX}:faults", "a")
        assert stored == (stored_form(expected) if item.reachable is not reading
                          else stored_form(item))
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
