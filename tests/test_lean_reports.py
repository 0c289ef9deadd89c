"""Reports that change no window stay on the replica until the flush (docs/semantics.md):
no Redis command per such report, one summary per broker and producer per flush, applied
once; windows stay the store's to decide, and a stale copy never shortens one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from detour.model import Config
from service.settings import Settings
from service.store import ReportIn, codec
from service.store.aggregate import bucket_of
from service.store.redis import RedisStore
from tests.procs import RedisServer

pytestmark = [pytest.mark.integration]

PREFIX = "detour:{default}"


@pytest.fixture
def raw(redis_url: str, redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client() as c:
        yield c


def _settings(url: str, **kw: object) -> Settings:
    # No background flush and no poll during the test: the test flushes when it means to.
    return Settings(redis_url=url, report_flush_ms=60_000, sync_interval_s=60, **kw)


@contextlib.asynccontextmanager
async def _store(settings: Settings) -> AsyncIterator[RedisStore]:
    store = RedisStore(settings)
    await store.start()
    try:
        yield store
    finally:
        await store.close()


async def _stop_sync(store: RedisStore) -> None:
    """The replica stops hearing pushes but believes it is synced (a push in flight)."""
    assert store._task is not None
    store._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await store._task
    store.synced.set()


def _commands(raw: redis.Redis) -> int:
    return int(raw.info("stats")["total_commands_processed"])


def _fault(raw: redis.Redis, broker: str) -> tuple[int, int]:
    value = raw.hget(f"{PREFIX}:faults", broker)
    assert value is not None
    item = codec.decode_fault(broker, str(value))
    return item.current_latency_ms, item.available_at


def test_fast_reports_cost_no_redis_command_until_the_flush(
    redis_url: str, raw: redis.Redis
) -> None:
    async def scenario() -> None:
        async with _store(_settings(redis_url)) as store:
            (first,) = await store.report_many([ReportIn("x", 20, producer="p1")])
            assert first.latency_ms == 20  # a broker's first report is sent: it makes the item
            assert _fault(raw, "x")[0] == 20
            log_before = raw.xlen(f"{PREFIX}:latency-log")
            before = _commands(raw)
            latencies = [5 + (i * 37) % 400 for i in range(200)]
            for i, lat in enumerate(latencies):
                (out,) = await store.report_many([ReportIn("x", lat, producer=f"p{1 + i % 2}")])
                assert out.not_available_duration_ms == 0 and not out.degraded
            batch = await store.report_many([ReportIn("x", 30, producer="p1")] * 10)
            assert len(batch) == 10
            # INFO itself is one command: nothing else reached Redis for 210 reports
            assert _commands(raw) - before <= 1
            assert raw.xlen(f"{PREFIX}:latency-log") == log_before
            await store.flush_reports()
            assert _fault(raw, "x")[0] == 30  # the latest report's latency
            entries = [e for e in await store.latency_log(None, 100) if e.histogram]
            assert sorted(e.producer for e in entries) == ["p1", "p2"]
            assert sum(sum(e.histogram or ()) for e in entries) == 210
            for e in entries:
                assert e.since is not None and e.since <= e.at
            counts = [0] * 64
            for lat in [*latencies, *[30] * 10]:
                counts[bucket_of(lat)] += 1
            summed = [0] * 64
            for e in entries:
                for i, c in enumerate(e.histogram or ()):
                    summed[i] += c
            assert summed == counts

    asyncio.run(scenario())


def test_a_flush_whose_reply_was_lost_is_applied_once(redis_url: str, raw: redis.Redis) -> None:
    async def scenario() -> None:
        async with _store(_settings(redis_url)) as store:
            await store.report_many([ReportIn("x", 20)])
            for _ in range(50):
                await store.report_many([ReportIn("x", 40)])
            # The flush reaches Redis but its reply is lost: the replica retries the same
            # summaries with the same sequence numbers.
            summaries = store._quiet.take()
            store._seq += 1
            summaries[0].seq = store._seq
            store._unflushed = list(summaries)
            await store.flush_reports()
            store._unflushed = list(summaries)
            await store.flush_reports()
            histograms = [e for e in await store.latency_log(None, 100) if e.histogram]
            assert len(histograms) == 1 and sum(histograms[0].histogram or ()) == 50

    asyncio.run(scenario())


def test_a_retried_report_id_is_counted_once_on_the_replica(redis_url: str) -> None:
    async def scenario() -> None:
        async with _store(_settings(redis_url)) as store:
            await store.report_many([ReportIn("x", 20)])
            (a,) = await store.report_many([ReportIn("x", 30, report_id="r-1")])
            (b,) = await store.report_many([ReportIn("x", 30, report_id="r-1")])
            assert not a.duplicate and b.duplicate
            await store.flush_reports()
            histograms = [e for e in await store.latency_log(None, 100) if e.histogram]
            assert sum(sum(e.histogram or ()) for e in histograms) == 1

    asyncio.run(scenario())


def test_a_window_report_is_sent_and_extends_from_a_stale_copy(
    redis_url: str, raw: redis.Redis
) -> None:
    """b opens a window a has not heard of: a's slow report still extends it in Redis, and
    a's fast reports, kept local, leave it as it is (extend rule: never shorter)."""

    async def scenario() -> None:
        async with _store(_settings(redis_url)) as a, _store(_settings(redis_url)) as b:
            await a.report_many([ReportIn("x", 20)])
            await _stop_sync(a)
            (opened,) = await b.report_many([ReportIn("x", 1200)])  # 60 s window
            assert opened.not_available_duration_ms == 60_000
            assert a.view.faults["x"].available_at < opened.available_at  # a is stale
            for _ in range(20):
                (kept,) = await a.report_many([ReportIn("x", 10)])
                assert kept.not_available_duration_ms == 0
            await a.flush_reports()
            assert _fault(raw, "x") == (10, opened.available_at)  # latency moved, window kept
            (slow,) = await a.report_many([ReportIn("x", 2500)])  # 120 s: sent
            assert slow.not_available_duration_ms == 120_000
            assert _fault(raw, "x")[1] == slow.available_at > opened.available_at

    asyncio.run(scenario())


def test_last_report_wins_a_stale_copy_never_ends_a_window_early(
    redis_url: str, raw: redis.Redis
) -> None:
    async def scenario() -> None:
        settings = _settings(redis_url)
        async with _store(settings) as a, _store(settings) as b:
            await b.put_config(Config(last_report_wins=True))
            await a.resync()
            await a.report_many([ReportIn("x", 20)])
            await _stop_sync(a)
            (opened,) = await b.report_many([ReportIn("x", 700)])
            for _ in range(5):
                await a.report_many([ReportIn("x", 10)])  # a sees no window: kept local
            await a.flush_reports()
            assert _fault(raw, "x")[1] == opened.available_at  # not ended by a stale copy
            # A replica that knows the window sends its fast report, which ends it.
            await b.report_many([ReportIn("x", 10)])
            assert _fault(raw, "x")[1] < opened.available_at

    asyncio.run(scenario())


def test_flush_zero_writes_every_report(redis_url: str, raw: redis.Redis) -> None:
    async def scenario() -> None:
        async with _store(Settings(redis_url=redis_url, report_flush_ms=0)) as store:
            for lat in (20, 30, 40):
                await store.report_many([ReportIn("x", lat)])
            assert raw.xlen(f"{PREFIX}:latency-log") == 3
            assert _fault(raw, "x")[0] == 40

    asyncio.run(scenario())
