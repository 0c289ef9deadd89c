"""Fail-open against real processes: Detour stopped, frozen and restarted under producers.

The service runs on Redis here so its table survives the restart, as in a
deployment; the producers keep sending throughout, and what they learned while
Detour was away reaches the shared table afterwards with the time it happened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from detour.client import AsyncDetourClient, ClientStats, DetourClient, SelectedQueue
from tests.procs import PATIENT_ENV, ServiceProcess, wait_until, wait_until_async
from tests.proxy import DelayProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ISOLATION_MS = 600_000
TOPIC = "fo-t"
BROKERS = ("fo-a", "fo-b", "fo-c")


def put_route(url: str) -> None:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": 1} for b in BROKERS]}
    httpx.put(f"{url}/routes/{TOPIC}", json=body, timeout=5).raise_for_status()


def table(url: str) -> dict[str, dict[str, int]]:
    body = httpx.get(f"{url}/fault-items", timeout=5).json()
    return {i["brokerName"]: i for i in body["items"]}


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Brokers:
    """The user's ``deliver``: fails on the brokers in ``down``, noting when each failed."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.failed_at: dict[str, int] = {}

    def deliver(self, q: SelectedQueue, payload: object) -> str:
        if q.broker_name in self.down:
            self.failed_at[q.broker_name] = wall_ms()
            raise ConnectionRefusedError(f"{q.broker_name} is down")
        return q.broker_name


@pytest.fixture
def service(redis_url: str) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(redis_url=redis_url, env=PATIENT_ENV)
    try:
        yield svc
    finally:
        svc.stop()


#: Replayed windows must land within this of where the original reports put them (ms) ...
TOLERANCE_MS = 250
#: ... which only tells something when the replay comes clearly later than the report (s).
AGE_S = 1.5


def age_the_reports(since: float) -> None:
    # Not a synchronisation: the reports must be old enough that a window computed
    # from the replay's time would miss the tolerance.
    time.sleep(max(0.0, AGE_S - (time.monotonic() - since)))


def test_sends_survive_a_detour_restart_and_the_queued_reports_arrive(
    service: ServiceProcess, redis_url: str
) -> None:
    put_route(service.url)
    brokers = Brokers()
    # 2 s, not the default 200 ms: the warm sends must be answered on a busy machine too
    # (once Detour is stopped, its port refuses at once).
    with DetourClient(service.url, decide_within=None, timeout=2.0) as client:
        for i in range(3):  # warm: Detour answers, the route is known locally
            assert not client.send(TOPIC, i, brokers.deliver).queue.local

        service.stop()
        brokers.down = {"fo-a"}
        results = [client.send(TOPIC, i, brokers.deliver) for i in range(6)]
        assert all(r.queue.local and r.value != "fo-a" for r in results)
        assert "fo-a" in brokers.failed_at  # the walk reached it within three sends
        assert sum(len(r.attempts) for r in results) == 7  # one retry, after fo-a
        assert client.stats().pending_reports == 7
        age_the_reports(since=min(brokers.failed_at.values()) / 1000 - time.time()
                        + time.monotonic())

        restarted = ServiceProcess(redis_url=redis_url, port=service.port, env=PATIENT_ENV)
        try:
            wait_until(lambda: client.stats().pending_reports == 0, 10, "the replay")
            items = table(restarted.url)
            # ageMs put the window where it would be had Detour been up all along.
            expected = brokers.failed_at["fo-a"] + ISOLATION_MS
            assert abs(items["fo-a"]["availableAt"] - expected) < TOLERANCE_MS
            assert items["fo-b"]["available"] and items["fo-c"]["available"]
            stats = client.stats()
            assert (stats.dropped_reports, stats.sent_reports) == (0, 3 + 7)
            wait_until(lambda: not client.select(TOPIC).local, 10, "remote selects again")
            picks = {client.select(TOPIC).broker_name for _ in range(4)}
            assert picks == {"fo-b", "fo-c"}
        finally:
            restarted.stop()


def test_a_cached_client_rides_out_a_detour_crash(
    service: ServiceProcess, redis_url: str
) -> None:
    # SIGKILL, not ServiceProcess.stop: a graceful stop waits for the open event stream.
    put_route(service.url)
    brokers = Brokers()
    # A shorter backoff cap than the default 5 s only to keep the test short.
    with DetourClient(service.url, mode="cached", backoff_max=1.0) as client:
        assert client.wait_ready(15)
        os.killpg(service.proc.pid, signal.SIGKILL)
        service.proc.wait(10)
        brokers.down = {"fo-c"}
        results = [client.send(TOPIC, i, brokers.deliver) for i in range(6)]
        assert all(r.queue.local and r.value != "fo-c" for r in results)
        assert "fo-c" in brokers.failed_at
        wait_until(lambda: not client.stats().stream_connected, 10, "the stream is lost")
        assert client.stats().pending_reports == 7
        age_the_reports(since=min(brokers.failed_at.values()) / 1000 - time.time()
                        + time.monotonic())

        restarted = ServiceProcess(redis_url=redis_url, port=service.port, env=PATIENT_ENV)
        try:
            wait_until(lambda: client.stats().pending_reports == 0, 10, "the replay")
            expected = brokers.failed_at["fo-c"] + ISOLATION_MS
            assert abs(table(restarted.url)["fo-c"]["availableAt"] - expected) < TOLERANCE_MS
            wait_until(lambda: client.stats().stream_connected, 10, "the stream reconnects")
            # Following Detour again: an operator's restore reaches the client.
            httpx.delete(f"{restarted.url}/fault-items/fo-c", timeout=5).raise_for_status()
            wait_until(lambda: "fo-c" in {client.select(TOPIC, "fo-a").broker_name
                                          for _ in range(3)}, 5, "the restore")
            assert client.stats().dropped_reports == 0
        finally:
            client.close()  # first: a graceful stop waits for an open stream
            restarted.stop()


def test_a_frozen_detour_costs_one_timeout_not_one_per_send(
    service: ServiceProcess,
) -> None:
    put_route(service.url)
    brokers = Brokers()
    # A 2 s backoff (0.5 s by default): the 50 sends below fit in it on a busy machine too.
    with DetourClient(service.url, decide_within=None, timeout=0.2, backoff_initial=2.0) as client:
        assert not client.select(TOPIC).local
        os.killpg(service.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            start = time.monotonic()
            first = client.send(TOPIC, 0, brokers.deliver)
            first_s = time.monotonic() - start
            # It waited for the 0.2 s timeout (the upper bound is generous: the count of
            # failed calls below is what says "one timeout").
            assert first.queue.local and 0.15 < first_s < 2
            for i in range(50):  # within the backoff: no call to Detour at all
                assert client.send(TOPIC, i, brokers.deliver).queue.local
            stats = client.stats()
            assert stats.detour_failures == 1 and stats.pending_reports == 51
        finally:
            os.killpg(service.proc.pid, signal.SIGCONT)
        wait_until(lambda: not client.select(TOPIC).local, 15, "Detour answers again")
        wait_until(lambda: client.stats().pending_reports == 0, 15, "the replay")
        assert client.stats().sent_reports >= 51


def test_an_answered_call_ends_the_streams_backoff_at_once(
    service: ServiceProcess, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an outage, a cached copy is current again as soon as Detour answers any call
    (here the report batch the client was holding), not when the stream's backoff ends:
    the backoff is made 60 s on purpose, and the stream must reconnect well within it."""
    from detour.client import threads
    from detour.client.reconnect import Jitter

    monkeypatch.setattr(threads, "stream_jitter", lambda rand: Jitter(60.0, 60.0, lambda: 1.0))
    put_route(service.url)
    brokers = Brokers()
    with DetourClient(service.url, mode="cached", backoff_initial=0.2, backoff_max=0.2) as client:
        assert client.wait_ready(15)
        os.killpg(service.proc.pid, signal.SIGKILL)  # the stream is lost: a 60 s backoff
        service.proc.wait(10)
        wait_until(lambda: not client.stats().stream_connected, 10, "the stream is lost")
        brokers.down = {"fo-c"}
        for i in range(3):
            client.send(TOPIC, i, brokers.deliver)
        assert client.stats().pending_reports >= 1
        restarted = ServiceProcess(redis_url=redis_url, port=service.port, env=PATIENT_ENV)
        try:
            start = time.monotonic()
            wait_until(lambda: client.stats().pending_reports == 0, 15, "the held reports sent")
            wait_until(lambda: client.stats().stream_connected, 15, "the stream reconnects")
            assert time.monotonic() - start < 30  # far inside the 60 s backoff
            assert client.stats().stream_snapshots == 2  # the first, and the reconnect's
            # following Detour again: an operator's delete reaches the copy
            httpx.delete(f"{restarted.url}/fault-items/fo-c", timeout=5).raise_for_status()
            wait_until(lambda: "fo-c" in {client.select(TOPIC, "fo-a").broker_name
                                          for _ in range(3)}, 5, "the delete followed")
        finally:
            client.close()  # first: a graceful stop waits for an open stream
            restarted.stop()


def test_the_async_clients_stream_is_woken_by_an_answered_call_too(
    service: ServiceProcess, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule for the async client's stream task (a 60 s backoff made on purpose)."""
    from detour.client import tasks
    from detour.client.reconnect import Jitter

    monkeypatch.setattr(tasks, "stream_jitter", lambda rand: Jitter(60.0, 60.0, lambda: 1.0))
    put_route(service.url)

    async def deliver(q: SelectedQueue, payload: object) -> str:
        return q.broker_name

    async def until(check: object, what: str) -> None:
        deadline = time.monotonic() + 15
        while not check():  # type: ignore[operator]
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def main() -> None:
        async with AsyncDetourClient(service.url, mode="cached", backoff_initial=0.2,
                                     backoff_max=0.2) as client:
            assert await client.wait_ready(15)
            os.killpg(service.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(service.proc.wait, 10)
            await until(lambda: not client.stats().stream_connected, "the stream is lost")
            await client.send(TOPIC, 0, deliver)
            restarted = await asyncio.to_thread(
                ServiceProcess, redis_url=redis_url, port=service.port, env=PATIENT_ENV)
            try:
                await until(lambda: client.stats().pending_reports == 0, "the report sent")
                await until(lambda: client.stats().stream_connected, "the stream reconnects")
            finally:
                await client.aclose()
                await asyncio.to_thread(restarted.stop)

    asyncio.run(main())


def test_reports_unsent_at_close_are_dropped_once_not_also_pending(
    service: ServiceProcess,
) -> None:
    """A client closed while Detour is down counts what it could not send as dropped, and
    no longer as pending: stats add up (sent + pending + dropped = reported)."""
    put_route(service.url)
    brokers = Brokers()
    with DetourClient(service.url, decide_within=None, timeout=2.0) as client:
        client.send(TOPIC, 0, brokers.deliver)
        service.stop()
        for i in range(4):
            client.send(TOPIC, i, brokers.deliver)
        assert client.stats().pending_reports == 4
        client.close(flush_timeout=0.2)
        stats = client.stats()
        assert (stats.sent_reports, stats.pending_reports, stats.dropped_reports) == (1, 0, 4)


def test_the_async_client_closing_with_reports_unsent_counts_them_once(
    service: ServiceProcess,
) -> None:
    put_route(service.url)

    async def run() -> tuple[int, int, int]:
        client = AsyncDetourClient(service.url, decide_within=None, timeout=2.0)
        await client.select(TOPIC)
        service.stop()
        for _ in range(3):
            await client.report("fo-a", 5.0)
        assert client.stats().pending_reports == 3
        await client.aclose(flush_timeout=0.2)
        s = client.stats()
        return s.sent_reports, s.pending_reports, s.dropped_reports

    assert asyncio.run(run()) == (0, 0, 3)


# -- a report whose answer came late: sent again, applied once -------------------------


def duplicates(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return float(next(ln.split()[1] for ln in text.splitlines()
                      if ln.startswith("detour_reports_duplicate_total ")))


@pytest.mark.parametrize("mode", ["remote", "cached"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_report_whose_answer_came_late_is_sent_again_and_applied_once(
    service: ServiceProcess, kind: str, mode: str
) -> None:
    """Detour applies the report at once, but its answer is held past the SDK's timeout
    (a proxy holds it on purpose). The SDK cannot tell that from a report that never
    arrived, so it sends it again: remote mode queues it for the next batch, cached mode
    retries the batch. The report id makes the second one a duplicate: the table and the
    latency log hold it once, the SDK counts it sent and none dropped."""
    broker = f"late-{kind}-{mode}"
    put_route(service.url)
    before = duplicates(service.url)
    proxy = DelayProxy(int(service.url.rsplit(":", 1)[1]))
    proxy.hold_reply_to, proxy.hold_reply_s = f'"{broker}"'.encode(), 2.0
    url = f"http://127.0.0.1:{proxy.port}"

    def settled(stats: ClientStats) -> bool:
        return stats.pending_reports == 0 and stats.sent_reports >= 1

    try:
        if kind == "sync":
            with DetourClient(url, mode=mode, timeout=0.5, backoff_initial=0.1) as client:
                assert mode == "remote" or client.wait_ready(15)
                client.report(broker, 5, isolation=True)
                wait_until(lambda: settled(client.stats()), 20, "the report sent again")
                stats = client.stats()
        else:
            async def main() -> ClientStats:
                async with AsyncDetourClient(url, mode=mode, timeout=0.5,
                                             backoff_initial=0.1) as client:
                    assert mode == "remote" or await client.wait_ready(15)
                    await client.report(broker, 5, isolation=True)
                    await wait_until_async(lambda: settled(client.stats()), 20,
                                           "the report sent again")
                    return client.stats()

            stats = asyncio.run(main())
        assert proxy.held == 1  # the fault happened: the first answer came late
        assert stats.dropped_reports == 0
        assert duplicates(service.url) - before == 1  # the second one was known
        logged = httpx.get(f"{service.url}/latency-log", timeout=5).json()["entries"]
        assert [e["brokerName"] for e in logged].count(broker) == 1
        assert table(service.url)[broker]["available"] is False
    finally:
        proxy.close()
