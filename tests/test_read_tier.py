"""The fan-out tier (``DETOUR_REDIS_REPLICAS``) on a real primary and replica (``replicaof``).

A process reads its pushes, polls and snapshots from the replica and writes on the primary;
a replica whose replication stops (pointed at a dead master: it keeps its data and answers,
but falls behind) or that dies is left for the primary, counted and logged; a table the
primary lost is merged on the primary, as without the tier; the process goes back to a
replica once ``redis_replica_retry_s`` has passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from service import metrics
from service.settings import Settings
from service.store import ReportIn
from service.store.reads import parse_replicas
from service.store.redis import RedisStore
from tests.procs import (
    PATIENT_CALL_TIMEOUT_S,
    RedisServer,
    free_port,
    wait_until,
    wait_until_async,
)

pytestmark = pytest.mark.integration

CHANNEL = "detour:{default}:changes"
FAULTS = "detour:{default}:faults"


class Replicated:
    """A primary and one replica of it, linked and in sync."""

    def __init__(self) -> None:
        # (a master's setting: without it, each full sync waits 5 s for more replicas)
        self.primary = RedisServer(extra=["--repl-diskless-sync-delay", "0"])
        self.replica = RedisServer()
        self.follow()

    def follow(self) -> None:
        with self.replica.client() as r:
            r.replicaof("127.0.0.1", self.primary.port)
            wait_until(lambda: r.info("replication")["master_link_status"] == "up", 20,
                       "the replica in sync")

    def cut(self) -> None:
        """Stop replicating (a master that is not there): the replica keeps answering
        with what it has, read-only, and falls behind."""
        with self.replica.client() as r:
            r.replicaof("127.0.0.1", free_port())

    def stop(self) -> None:
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def servers() -> Iterator[Replicated]:
    s = Replicated()
    yield s
    s.stop()


def _subscribed(server: RedisServer) -> int:
    with server.client() as c:
        return int(dict(c.pubsub_numsub(CHANNEL))[CHANNEL])


def _fallbacks(cause: str) -> float:
    return float(metrics.READ_FALLBACKS.labels(cause)._value.get())


def _reading() -> float:
    return float(metrics.READING_REPLICA.labels("default")._value.get())


def _settings(servers: Replicated, **extra: object) -> Settings:
    return Settings(redis_url=servers.primary.url,
                    redis_replicas=f"127.0.0.1:{servers.replica.port}",
                    redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S, **extra)


def test_parse_replicas() -> None:
    assert parse_replicas("a:1, b") == [("a", 1), ("b", 6379)]
    assert parse_replicas("sentinel") is None and parse_replicas("") == []
    with pytest.raises(ValueError):
        RedisStore(Settings(redis_url="redis+cluster://127.0.0.1:7000/", redis_replicas="a:1"))
    with pytest.raises(ValueError):
        RedisStore(Settings(redis_url="redis://127.0.0.1:6379/0", redis_replicas="sentinel"))


def test_a_process_reads_the_replica_and_writes_the_primary(servers: Replicated) -> None:
    """Subscribed and polling on the replica (2 connections there), reports on the primary;
    another process's window arrives through the replica."""
    reader_settings = _settings(servers, sync_interval_s=0.1, redis_idle_close_s=0.2)
    writer_settings = Settings(redis_url=servers.primary.url,
                               redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    def replica_clients() -> tuple[int, int]:
        with servers.replica.client() as c:
            me = c.client_id()
            clients = [x for x in c.client_list()
                       if int(x["id"]) != me and "master" not in x["flags"] and x["flags"] != "M"]
            subs = sum(1 for x in clients if x.get("sub") == "1")
            return subs, len(clients) - subs

    async def scenario() -> None:
        reader, writer = RedisStore(reader_settings), RedisStore(writer_settings)
        await reader.start()
        await writer.start()
        try:
            await wait_until_async(
                lambda: (_subscribed(servers.primary), _subscribed(servers.replica)) == (1, 1)
                and reader.synced.is_set() and _reading() == 1, 20,
                "the reader on the replica, the writer on the primary", interval_s=0.05)
            (out,) = await writer.report_many([ReportIn("x", 0, True)])
            await wait_until_async(lambda: "x" in reader.view.faults, 10, "the push")
            assert reader.view.faults["x"].available_at == out.available_at
            (mine,) = await reader.report_many([ReportIn("y", 0, True)])
            assert not reader.degraded and mine.available_at > mine.now_ms
            with servers.primary.client() as c:
                assert c.hget(FAULTS, "y") is not None
            # At rest on the replica: the subscription and the polls' connection.
            await wait_until_async(lambda: replica_clients() == (1, 1), 10,
                                   "2 connections on the replica", interval_s=0.05)
            # The gauge counts a process's connections for a namespace at each poll, and
            # this process holds two stores of one namespace: the writer's counts (no
            # replica) and the reader's take turns. The reader's, at its next poll:
            def held() -> dict[str, float]:
                return {u: metrics.REDIS_CONNECTIONS.labels("default", u)._value.get()
                        for u in ("subscription", "replica")}

            await wait_until_async(lambda: held() == {"subscription": 1, "replica": 1}, 10,
                                   f"the reader's connections counted (last: {held()})",
                                   interval_s=0.02)
        finally:
            await writer.close()
            await reader.close()
        assert _reading() == 0

    asyncio.run(scenario())


def test_a_report_sent_again_through_a_replica_reader_is_applied_once(
    servers: Replicated,
) -> None:
    """Exactly-once is the primary's: a process reading a replica that sends a report id
    again gets the first answer, and the table and the latency log hold it once."""
    settings = _settings(servers, sync_interval_s=0.1, report_flush_ms=0)
    merges = sum(metrics.RESEEDS.labels(c)._value.get()
                 for c in ("empty", "epoch", "behind", "restart", "failover", "merge"))

    async def scenario() -> None:
        reader = RedisStore(settings)
        await reader.start()
        try:
            await wait_until_async(lambda: _reading() == 1 and reader.synced.is_set(), 20,
                                   "the reader on the replica", interval_s=0.05)
            (first,) = await reader.report_many([ReportIn("a", 0, True, report_id="r-1")])
            assert not first.duplicate
            for _ in range(5):
                (again,) = await reader.report_many([ReportIn("a", 0, True, report_id="r-1")])
                assert again.duplicate and again.available_at == first.available_at
            with servers.primary.client() as c:
                log = c.xrange("detour:{default}:latency-log")
                assert [e.get("b") for _, e in log].count("a") == 1
            assert _reading() == 1  # the replica was never left
        finally:
            await reader.close()

    asyncio.run(scenario())
    assert sum(metrics.RESEEDS.labels(c)._value.get()
               for c in ("empty", "epoch", "behind", "restart", "failover", "merge")) == merges


def test_a_lagging_replica_is_left_for_the_primary_and_taken_again(servers: Replicated) -> None:
    """Replication stops: the reader's next window is the primary's, not the replica's,
    so the reader leaves it (lagging), follows the primary, and returns once it is back."""
    reader_settings = _settings(servers, sync_interval_s=0.1, redis_primary_poll_s=0.1,
                                redis_replica_max_lag_s=0.3, redis_replica_retry_s=1.0)
    writer_settings = Settings(redis_url=servers.primary.url,
                               redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    lagging = _fallbacks("lagging")

    async def scenario() -> None:
        reader, writer = RedisStore(reader_settings), RedisStore(writer_settings)
        await reader.start()
        await writer.start()
        try:
            await wait_until_async(lambda: _subscribed(servers.replica) == 1 and _reading() == 1
                                   and reader.synced.is_set(), 20, "the reader on the replica",
                                   interval_s=0.05)
            servers.cut()
            (out,) = await writer.report_many([ReportIn("late", 0, True)])
            # Never on the replica: the reader gets it from the primary after leaving it.
            await wait_until_async(lambda: "late" in reader.view.faults, 20,
                                   "the window through the primary", interval_s=0.05)
            assert reader.view.faults["late"].available_at == out.available_at
            assert _fallbacks("lagging") > lagging
            with servers.replica.client() as r:
                assert r.hget(FAULTS, "late") is None
            # Replicating again: after redis_replica_retry_s the reader is back on it.
            servers.follow()
            await wait_until_async(lambda: _subscribed(servers.replica) == 1 and _reading() == 1
                                   and reader.synced.is_set(), 20, "back on the replica",
                                   interval_s=0.05)
            (again,) = await writer.report_many([ReportIn("next", 0, True)])
            await wait_until_async(lambda: "next" in reader.view.faults, 10, "a push")
            assert reader.view.faults["next"].available_at == again.available_at
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(scenario())


def test_a_dead_replica_is_left_for_the_primary(servers: Replicated) -> None:
    reader_settings = _settings(servers, sync_interval_s=0.1, redis_replica_retry_s=600)
    writer_settings = Settings(redis_url=servers.primary.url,
                               redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)
    unreachable = _fallbacks("unreachable")

    async def scenario() -> None:
        reader, writer = RedisStore(reader_settings), RedisStore(writer_settings)
        await reader.start()
        await writer.start()
        try:
            await wait_until_async(lambda: _subscribed(servers.replica) == 1 and _reading() == 1
                                   and reader.synced.is_set(), 20, "the reader on the replica",
                                   interval_s=0.05)
            servers.replica.kill()
            await wait_until_async(lambda: _subscribed(servers.primary) == 2
                                   and reader.synced.is_set(), 20, "the reader on the primary",
                                   interval_s=0.05)
            assert _fallbacks("unreachable") > unreachable and _reading() == 0
            (out,) = await writer.report_many([ReportIn("x", 0, True)])
            await wait_until_async(lambda: "x" in reader.view.faults, 10, "the push")
            assert reader.view.faults["x"].available_at == out.available_at
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(scenario())


def test_a_table_the_primary_lost_is_merged_on_the_primary(servers: Replicated) -> None:
    """The primary is emptied (the replica follows it): the reader sees it on the replica,
    goes to the primary, and merges what it holds there, as it would without the tier."""
    reader_settings = _settings(servers, sync_interval_s=0.1, redis_replica_retry_s=600)

    async def scenario() -> None:
        reader = RedisStore(reader_settings)
        await reader.start()
        try:
            await wait_until_async(lambda: _subscribed(servers.replica) == 1 and _reading() == 1
                                   and reader.synced.is_set(), 20, "the reader on the replica",
                                   interval_s=0.05)
            (out,) = await reader.report_many([ReportIn("kept", 0, True)])
            with servers.primary.client() as c:
                c.flushall()

            def merged() -> bool:
                with servers.primary.client() as c:
                    return c.hget(FAULTS, "kept") is not None

            await wait_until_async(merged, 20, "the window merged back on the primary",
                                   interval_s=0.05)
            assert reader.view.faults["kept"].available_at == out.available_at
        finally:
            await reader.close()

    asyncio.run(scenario())


def test_an_unreachable_replica_address_reads_the_primary() -> None:
    """A replica that does not answer at all: the process reads the primary and is ready."""
    primary = RedisServer()
    try:
        settings = Settings(redis_url=primary.url, redis_replicas=f"127.0.0.1:{free_port()}",
                            redis_timeout_s=0.5, redis_replica_retry_s=600)

        async def scenario() -> None:
            store = RedisStore(settings)
            await store.start()
            try:
                await wait_until_async(lambda: store.synced.is_set() and _subscribed(primary)
                                       == 1, 20, "on the primary", interval_s=0.05)
            finally:
                await store.close()

        asyncio.run(scenario())
    finally:
        primary.stop()


def test_the_replica_runs_no_write(servers: Replicated) -> None:
    """A replica refuses writes: the read scripts the tier sends it are read-only."""
    with servers.replica.client() as r, pytest.raises(redis.ReadOnlyError):
        r.set("detour:x", 1)
