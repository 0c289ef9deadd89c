"""Closing idle Redis connections never closes one a call is using (service/store/connect.py).

``StoreClients.close_idle`` runs every ``redis_idle_close_s`` while reports keep coming. It
awaits each disconnect; a call that takes a connection from the pool meanwhile must never be
handed one of those being closed. When it was (the list of free connections read once,
before the awaits), a report under load failed with "Connection closed by server" every 10
s, fell back to the journal, and the replica lost its sync and re-synced under the load.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from detour.apply import ReportIn
from service.metrics import STORE_ERRORS
from service.settings import Settings
from service.store.connect import StoreClients, parse_redis_url
from service.store.redis import RedisStore
from tests.procs import PATIENT_CALL_TIMEOUT_S

pytestmark = pytest.mark.integration


def close_while_calling(
    url: str, rounds: int, calls: int, keep_used: bool = True
) -> tuple[int, list[BaseException]]:
    """(connections closed, calls failed) over ``rounds`` idle closes, each run while
    ``calls`` calls run at once on ``StoreClients(url).fast`` (the connections are
    connected and free first; the client counts as used by one call at a time, keeping
    one, or as unused, keeping none). The interleaving is the event loop's, not luck's."""

    async def run() -> tuple[int, list[BaseException]]:
        clients = StoreClients(parse_redis_url(url), 2.0, 2.0, max_connections=16,
                               idle_close_s=0.0)
        fast: Any = clients.fast
        try:
            failures: list[BaseException] = []
            closed = 0
            for _ in range(rounds):
                await asyncio.gather(*(fast.get("k") for _ in range(calls)))
                fast.used, fast.peak = keep_used, 1
                clients._last_close = 0.0
                results = await asyncio.gather(
                    clients.close_idle("k"),
                    *(fast.get("k") for _ in range(calls)),
                    return_exceptions=True,
                )
                closed += results[0] if isinstance(results[0], int) else 0
                failures += [r for r in results if isinstance(r, BaseException)]
            return closed, failures
        finally:
            await clients.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("keep_used", [False, True])
def test_calls_during_an_idle_close_never_get_a_closing_connection(
    redis_url: str, keep_used: bool
) -> None:
    closed, failures = close_while_calling(redis_url, rounds=20, calls=8, keep_used=keep_used)
    assert failures == []
    assert closed > 0  # the close did close connections meanwhile


async def _fill(client: Any, n: int) -> None:
    """Leave ``n`` connected connections free in the pool (n calls at once)."""
    await asyncio.gather(*(client.ping() for _ in range(n)))


def test_a_client_keeps_the_idle_connections_its_busiest_moment_needed(redis_url: str) -> None:
    """Under steady load nothing is closed (the next calls would connect again); once the
    load stops, one idle close keeps one connection and the next keeps none."""

    async def run() -> list[int]:
        clients = StoreClients(parse_redis_url(redis_url), 2.0, 2.0, max_connections=16,
                               idle_close_s=0.0)
        try:
            counts = []
            await _fill(clients.fast, 6)
            counts.append(clients.held()["reports"])
            for _ in range(3):  # steady load: 6 at once between closes
                await clients.close_idle("k")
                counts.append(clients.held()["reports"])
                await _fill(clients.fast, 6)
            await clients.close_idle("k")  # used since (6 at once): keeps them
            await clients.fast.ping()  # one call alone
            await clients.close_idle("k")
            counts.append(clients.held()["reports"])
            await clients.close_idle("k")  # unused since
            counts.append(clients.held()["reports"])
            return counts
        finally:
            await clients.aclose()

    assert asyncio.run(run()) == [6, 6, 6, 6, 1, 0]


def test_a_store_closing_idle_connections_under_load_journals_no_report(redis_url: str) -> None:
    """The same through the store: reports written at once (no flush), many at a time, while
    the sync loop closes idle connections as often as it runs. Every report reaches Redis:
    none falls back to the journal, and the replica never loses its sync."""
    # A patient call timeout: a busy machine's slow connect is not what this is about; a
    # connection cut off mid-call fails at once whatever the timeout.
    settings = Settings(redis_url=redis_url, report_flush_ms=0, sync_interval_s=0.01,
                        redis_idle_close_s=0.01, redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    async def run() -> tuple[int, float]:
        store = RedisStore(settings)
        await store.start()
        errors = STORE_ERRORS.labels("report")._value.get()
        try:
            await asyncio.wait_for(store.synced.wait(), 10)
            written = 0
            for i in range(60):  # bounded: 60 rounds of 16 reports at once
                outcomes = await asyncio.gather(*(
                    store.report_many([ReportIn(f"b{j}", 10 + i, producer=f"p{j}")])
                    for j in range(16)
                ))
                written += sum(1 for (o,) in outcomes if not o.degraded)
                await asyncio.sleep(0)  # the sync loop's turn: it closes idle connections
            return written, STORE_ERRORS.labels("report")._value.get() - errors
        finally:
            await store.close()

    written, failed = asyncio.run(run())
    assert failed == 0
    assert written == 60 * 16
