"""Scenarios: operator writes and ordinary traffic around a Redis that went back in time
(docs/reliability.md, "Redis lost or rolled back data").

- an operator's DELETE between Redis's restart from an older snapshot and the replica's
  reconnection: it acts on the table the replica knows (merged first), answers "deleted",
  and nothing brings the entry back;
- a DELETE of an entry the table lacks but a replica's copy holds leaves its grave;
- an in-place rollback (``DEBUG RELOAD`` of an older dump into the live server: the process,
  its subscriptions and its script cache survive) followed by enough ordinary writes to
  raise the table's version past what the replicas knew: noticed by the table's lineage,
  and merged.

Real redis-server processes; the replicas are RedisStore objects in one event loop
(tests/test_scenario_redis_loss.py's helpers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from detour.model import BrokerRoute, Route
from service import metrics
from service.settings import Settings
from service.store import ReportIn, codec, scripts
from service.store.redis import RedisStore
from tests import raw_table
from tests.procs import RedisServer
from tests.test_scenario_redis_loss import (
    PREFIX,
    Persisted,
    isolate,
    recovered,
    run,
    started,
    table,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def route(topic: str) -> Route:
    return Route.from_brokers(topic, [BrokerRoute("b1", 1)])


async def pause(store: RedisStore) -> None:
    """Stop the store's follower: it neither reconnects nor polls until ``resume`` (a
    replica that has not noticed yet what happened to Redis)."""
    task = store._task
    assert task is not None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def resume(store: RedisStore) -> None:
    store._task = asyncio.create_task(store._follower.run_forever())


def routes_in(persisted: Persisted) -> set[str]:
    with persisted.client() as c:
        return raw_table.names(c, f"{PREFIX}:routes")


@pytest.fixture
def rdb() -> Iterator[Persisted]:
    p = Persisted("rdb")
    yield p
    p.stop()


def test_a_delete_before_the_replica_reconnected_to_a_restored_redis_is_kept(
    rdb: Persisted,
) -> None:
    """Route t3 and bC's window are written after the snapshot; Redis restarts from it. A
    DELETE of each on a replica that has not reconnected yet answers "deleted" (not 404:
    the replica merged first), and once every replica has reconnected and merged, neither
    is back, in Redis or in any replica."""

    async def scenario() -> None:
        a, b = await started(rdb.url, 2)
        try:
            await a.put_route(route("t1"))
            rdb.snapshot()
            await a.put_route(route("t3"))
            await isolate(a, "bC")
            await until(lambda: "bC" in b.view.faults and "t3" in b.view.routes, "pushed")
            await pause(a)
            await pause(b)
            rdb.crash()
            rdb.restart_from_snapshot()
            assert "t3" not in routes_in(rdb)  # the restart did lose them
            assert await a.delete_route("t3")
            assert await a.delete_fault("bC")
            resume(a)
            resume(b)
            await until(recovered([a, b]), "both replicas reconnected")
            # b merged what it holds (t3 and bC, stamped before the deletes) on reconnecting
            await until(lambda: b.view.routes.keys() == {"t1"}, "b holds t1 alone")
            assert routes_in(rdb) == {"t1"}
            with rdb.client() as c:
                assert "bC" not in table(c)
            for s in (a, b):
                assert "t3" not in s.view.routes and "bC" not in s.view.faults
        finally:
            await a.close()
            await b.close()

    run(scenario)


def test_a_delete_of_an_entry_the_table_lacks_leaves_its_grave() -> None:
    """The table lost route t without any sign (a key gone by hand); a replica that still
    holds it deletes it: answered "deleted", and a merge from another replica that holds
    t but missed the delete does not bring it back."""
    server = RedisServer()

    async def scenario() -> None:
        a, b = await started(server.url, 2)
        try:
            await a.put_route(route("t"))
            await a.put_route(route("u"))
            await until(lambda: "t" in b.view.routes, "pushed")
            await pause(b)  # b holds t and will miss the delete's push
            with server.client() as c:
                c.hdel(f"{PREFIX}:routes", "t")
            assert await a.delete_route("t")
            assert not await a.delete_route("never")  # held by no one: 404 as before
            b.doubt("merge")  # as on another replica's announced merge
            resume(b)
            await until(recovered([b]), "b resynced")
            with server.client() as c:
                assert raw_table.names(c, f"{PREFIX}:routes") == {"u"}
                assert c.hexists(f"{PREFIX}:graves", "r#t")
            assert "t" not in b.view.routes
        finally:
            await a.close()
            await b.close()

    try:
        run(scenario)
    finally:
        server.stop()


def reloadable() -> RedisServer:
    """A server whose data can be rolled back in place: ``DEBUG RELOAD NOSAVE`` loads the
    dump saved before into the live process (Redis 7 refuses DEBUG unless enabled)."""
    return RedisServer(extra=["--enable-debug-command", "yes"])


async def quiet_pollers(url: str, n: int) -> list[RedisStore]:
    """Replicas whose poll does not come within a test (30 s): only pushes, reconnections
    and operator writes can show them what happened to the table."""
    stores = [
        RedisStore(Settings(redis_url=url, sync_interval_s=30, redis_call_timeout_s=5.0))
        for _ in range(n)
    ]
    for s in stores:
        await s.start()
    return stores


async def write_then_roll_back(server: RedisServer, a: RedisStore, b: RedisStore) -> None:
    """Routes t1, t2 and bA's window, saved; then t3 written, t1 and bA deleted (b holds all
    of it by push); then the saved dump loaded back into the live server."""
    await a.put_route(route("t1"))
    await a.put_route(route("t2"))
    await isolate(a, "bA")
    with server.client() as c:
        c.save()
    await a.put_route(route("t3"))
    assert await a.delete_route("t1")
    assert await a.delete_fault("bA")
    await until(lambda: b.view.routes.keys() == {"t2", "t3"} and "bA" not in b.view.faults,
                "pushed")
    with server.client() as c:
        c.execute_command("DEBUG", "RELOAD", "NOSAVE")
        assert raw_table.names(c, f"{PREFIX}:routes") == {"t1", "t2"}  # rolled back


async def converged(server: RedisServer, stores: list[RedisStore]) -> None:
    """Redis and every replica hold t2 and t3, neither t1 nor bA."""

    def done() -> bool:
        with server.client() as c:
            routes = raw_table.names(c, f"{PREFIX}:routes")
            faults = raw_table.names(c, f"{PREFIX}:faults")
        return routes == {"t2", "t3"} and "bA" not in faults and all(
            s.view.routes.keys() == {"t2", "t3"} and "bA" not in s.view.faults for s in stores)

    await until(done, "the newest of everything in Redis and every replica", timeout_s=20)


def test_an_in_place_rollback_overtaken_by_later_writes_is_merged() -> None:
    """After the rollback, eight ordinary reports raise the table's version past what the
    replicas knew before any poll: the first push past it comes from another history (its
    lineage), so both replicas merge; a replica started afterwards sees the same."""
    server = reloadable()

    async def scenario() -> None:
        a, b = await quiet_pollers(server.url, 2)
        c: RedisStore | None = None
        try:
            await write_then_roll_back(server, a, b)
            for n in range(8):  # (one may be journaled, while a merges: degraded)
                await a.report_many([ReportIn(f"n{n}", 0, isolation=True, producer="p")])
            await converged(server, [a, b])
            await until(lambda: not a.journal_size, "the journal replayed")
            (c,) = await quiet_pollers(server.url, 1)
            assert c.view.routes.keys() == {"t2", "t3"} and "bA" not in c.view.faults
            assert {f"n{n}" for n in range(8)} <= c.view.faults.keys()
        finally:
            for s in (a, b, c):
                if s is not None:
                    await s.close()

    try:
        run(scenario)
    finally:
        server.stop()


def test_replicas_away_during_an_in_place_rollback_and_the_writes_after_it_merge() -> None:
    """a and b are not following while the table is rolled back and written past their
    version by a replica started since (w, which knows only the rolled-back table), so no
    push tells them; their resync's snapshot does (the table's history lacks their lineage
    pair), and they merge."""
    server = reloadable()

    async def scenario() -> None:
        a, b = await quiet_pollers(server.url, 2)
        w: RedisStore | None = None
        try:
            await write_then_roll_back(server, a, b)
            await pause(a)
            await pause(b)
            (w,) = await quiet_pollers(server.url, 1)
            assert "t1" in w.view.routes  # the rolled-back table
            for n in range(8):
                await isolate(w, f"n{n}")
            resume(a)
            resume(b)
            await converged(server, [a, b, w])
        finally:
            for s in (a, b, w):
                if s is not None:
                    await s.close()

    try:
        run(scenario)
    finally:
        server.stop()


def test_a_report_retried_after_a_flush_is_answered_as_the_first_time() -> None:
    """A report with a reportId, applied; Redis is emptied (FLUSHALL) and the replicas merge
    the window back, but not the id. The producer's retry on the replica that answered it is
    answered as the first time (``duplicate``, the same window end) and changes nothing: no
    second latency-log entry, the window where it was."""
    server = RedisServer()

    async def scenario() -> None:
        (a,) = await started(server.url, 1)
        report = ReportIn("bR", 0, isolation=True, producer="p", report_id="rid-1")
        try:
            (first,) = await a.report_many([report])
            assert not first.duplicate and not first.degraded
            with server.client() as c:
                c.flushall()
            await until(lambda: not a.degraded and "bR" in table_of(server), "merged back")
            (again,) = await a.report_many([report])
            assert again.duplicate
            assert again.available_at == first.available_at
            assert table_of(server)["bR"] == first.available_at
            with server.client() as c:
                logged = [e["b"] for _, e in c.xrange(f"{PREFIX}:latency-log")]
            assert logged.count("bR") == 0  # the first entry went with the flush; no second
        finally:
            await a.close()

    try:
        run(scenario)
    finally:
        server.stop()


def table_of(server: RedisServer) -> dict[str, int]:
    with server.client() as c:
        return table(c)


BURST = """
local stamps = stamper(KEYS[2], clock_ms(), 0)
for i = 1, tonumber(ARGV[2]) do
  local stamp = stamps.next()
  local value = fmt(stamp) .. '|' .. ARGV[3]
  redis.call('HSET', KEYS[1], 'burst' .. i, value)
  push(KEYS[2], ARGV[1], 'route', 'burst' .. i, value, stamp)
end
stamps.done()
"""


class Received:
    """A subscription's pushes received but not handled yet (the follower's ``_poll`` reads
    them through ``get_message``)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages

    async def get_message(self, **_: Any) -> dict[str, Any] | None:
        return self.messages.pop(0) if self.messages else None


def test_a_poll_behind_a_burst_of_pushes_longer_than_the_kept_lineage_starts_no_merge() -> None:
    """5,000 visible changes in one script call (more than the 1,024 versions of lineage the
    table keeps) wait as pushes received when the follower's poll comes: the poll checks the
    lineage pair the replica reaches once it handled them, which the table still holds, so
    no merge (the pair from before the burst is out of the kept history)."""
    server = RedisServer()

    async def scenario() -> None:
        (a,) = await started(server.url, 1)
        try:
            await a.put_route(route("t"))
            await until(lambda: a.view.version == 1, "its push handled")
            await pause(a)  # its own follower neither reads the pushes nor polls
            with server.client() as c:
                sub = c.pubsub()
                sub.subscribe(a._channel)
                assert sub.get_message(timeout=5)["type"] == "subscribe"
                lua = scripts.source("poll").split("\n-- poll.lua", 1)[0] + BURST
                c.eval(lua, 2, f"{PREFIX}:routes", f"{PREFIX}:meta", a._push_channel, 5000,
                       codec.encode_route(route("x")))
                pushes = [sub.get_message(timeout=5) for _ in range(5000)]
                sub.close()
            follower = a._follower
            await follower._poll(Received(pushes))  # type: ignore[arg-type]
            assert not follower.resync_needed and a._doubt is None
            assert len(a.view.routes) == 5001
        finally:
            await a.close()

    try:
        run(scenario)
    finally:
        server.stop()


def reseeds() -> float:
    return sum(metrics.RESEEDS.labels(c)._value.get()
               for c in ("empty", "epoch", "behind", "restart", "failover", "merge"))
