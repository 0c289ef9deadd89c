"""The decision deadline (remote mode, ``decide_within``): a send waits for Detour's select
at most that long, then decides locally while the call goes on; the late answer still
teaches the client.

A real Detour process (memory store) behind ``tests.proxy.DelayProxy``, a TCP proxy on
127.0.0.1 that can hold Detour's replies back: Detour answers at once, its answer reaches
the client late. The deadlines here are generous for a loaded test machine (50 ms); the
shipped default (3 ms) is measured in bench/producers.py. Both clients, sync and async.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from detour.client import AsyncDetourClient, ClientStats, DetourClient, SelectedQueue
from tests.procs import ServiceProcess, wait_until
from tests.proxy import DelayProxy

pytestmark = [pytest.mark.e2e]

DEADLINE_S = 0.05
_topics = itertools.count(1)


class Client:
    """The sync or the async client behind one blocking face."""

    def __init__(self, kind: str, url: str, **settings: Any) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "sync":
            self.sync: DetourClient | None = DetourClient(url, **settings)
        else:
            self.sync = None
            self.loop = asyncio.new_event_loop()
            self.aio = AsyncDetourClient(url, **settings)

    def select(self, topic: str, last: str | None = None) -> SelectedQueue:
        if self.sync is not None:
            return self.sync.select(topic, last)
        assert self.loop is not None
        return self.loop.run_until_complete(self.aio.select(topic, last))

    def timed_select(self, topic: str, last: str | None = None) -> tuple[SelectedQueue, float]:
        start = time.perf_counter()
        selected = self.select(topic, last)
        return selected, time.perf_counter() - start

    def stats(self) -> ClientStats:
        return self.sync.stats() if self.sync is not None else self.aio.stats()

    def polled_stats(self) -> ClientStats:
        """The stats, for a ``wait_until``: the async client's loop runs a moment first, so
        that its calls in the background can end."""
        if self.loop is not None:
            self.loop.run_until_complete(asyncio.sleep(0.01))
        return self.stats()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            return
        assert self.loop is not None
        try:
            self.loop.run_until_complete(self.aio.aclose())
        finally:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def proxy(service: ServiceProcess) -> Iterator[DelayProxy]:
    p = DelayProxy(service.port)
    try:
        yield p
    finally:
        p.close()


def route(url: str, topic: str, brokers: list[str]) -> None:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": 2} for b in brokers]}
    httpx.put(f"{url}/routes/{topic}", json=body, timeout=10).raise_for_status()


def make(kind: str, proxy: DelayProxy, **settings: Any) -> Client:
    return Client(kind, f"http://127.0.0.1:{proxy.port}", **settings)


def test_a_slow_detour_costs_a_select_at_most_the_decision_deadline(
    kind: str, service: ServiceProcess, proxy: DelayProxy
) -> None:
    topic = f"dl{next(_topics)}"
    route(service.url, topic, [f"{topic}-a", f"{topic}-b"])
    client = make(kind, proxy, decide_within=DEADLINE_S, timeout=2.0)
    try:
        assert not client.select(topic).local  # learns the route and the config
        proxy.hold_s = 0.5
        timed = [client.timed_select(topic) for _ in range(20)]
        assert all(s.local for s, _ in timed)
        slowest = max(t for _, t in timed)
        # Far under the half second each answer takes (a loaded machine adds some).
        assert slowest < DEADLINE_S + 0.2, f"a select took {slowest * 1000:.0f} ms"
        # One call waited for (its reply reaches the proxy when Detour has answered it);
        # the others did not call while it was late.
        wait_until(lambda: proxy.held >= 1, 10, "Detour's answer at the proxy")
        assert proxy.held == 1
        assert client.stats().late_answers == 1 and client.stats().detour_failures == 0
        proxy.hold_s = 0
        wait_until(lambda: not client.select(topic).local, 10, "Detour on time again")
    finally:
        client.close()


def test_a_late_answer_still_teaches_the_local_table(
    kind: str, service: ServiceProcess, proxy: DelayProxy
) -> None:
    """Detour avoids broker a; a select whose answer came too late still showed it, and
    local selects avoid a from then on, where the client alone knew nothing of a."""
    topic, other = f"dl{next(_topics)}", f"dl{next(_topics)}"
    a, b = f"{topic}-a", f"{topic}-b"
    route(service.url, topic, [a, b])
    route(service.url, other, [b])  # its answers never name a
    client = make(kind, proxy, decide_within=DEADLINE_S, timeout=2.0)
    try:
        assert not client.select(topic).local and not client.select(other).local
        httpx.post(f"{service.url}/report-latency", timeout=10,
                   json={"brokerName": a, "latencyMs": 3001, "isolation": True}
                   ).raise_for_status()
        proxy.hold_s = 0.3
        # Retrying after b: Detour's walk passes a (avoided) whichever queue it starts at.
        assert client.select(topic, b).local
        proxy.hold_s = 0
        # Calls resume once the late answer is in (and taken).
        wait_until(lambda: not client.select(other).local, 10, "the late answer in")
        proxy.hold_s = 10  # from now on every answer is late
        chosen = {client.select(topic).broker_name for _ in range(20)}
        assert chosen == {b}, chosen
        assert client.stats().late_answers >= 2
    finally:
        proxy.hold_s = 0
        client.close()


def test_a_frozen_detour_costs_one_decision_deadline_then_the_circuit_opens(
    kind: str, service: ServiceProcess, proxy: DelayProxy
) -> None:
    topic = f"dl{next(_topics)}"
    route(service.url, topic, [f"{topic}-a", f"{topic}-b"])
    client = make(kind, proxy, decide_within=DEADLINE_S, timeout=0.3, backoff_initial=5.0)
    try:
        assert not client.select(topic).local
        proxy.hold_s = 30  # nothing comes back
        first, took = client.timed_select(topic)
        assert first.local and took < DEADLINE_S + 0.2
        # The held call times out (0.3 s): it counts as a failure, and the circuit opens.
        wait_until(lambda: client.polled_stats().detour_failures == 1, 10, "the timeout")
        for _ in range(50):
            assert client.select(topic).local
        stats = client.stats()
        assert proxy.held == 1  # Detour answered the one call made (the proxy held it)
        assert stats.late_answers == 1 and stats.detour_failures == 1
    finally:
        proxy.hold_s = 0
        client.close()
