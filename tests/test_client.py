"""The sync producer SDK against a live Detour process: the send loop, 4xx, cached mode.

One memory-store service for the module; each test uses its own topic and
brokers, so the shared table's state from one test cannot steer another.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from detour.client import (
    DetourClient,
    DetourRequestError,
    SelectedQueue,
    SendError,
    SendResult,
    TopicNotFound,
)
from tests.procs import ServiceProcess, wait_until
from tests.proxy import DelayProxy

pytestmark = pytest.mark.e2e

ISOLATION_MS = 600_000  # the default tiers: a failure counts as 30 s -> 600 s


@pytest.fixture
def admin(service: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=5) as c:
        yield c


def put_route(admin: httpx.Client, topic: str, brokers: dict[str, int]) -> None:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": n} for b, n in brokers.items()]}
    admin.put(f"/routes/{topic}", json=body).raise_for_status()


def fault_items(admin: httpx.Client) -> tuple[int, dict[str, dict[str, int]]]:
    body = admin.get("/fault-items").json()
    return body["now"], {i["brokerName"]: i for i in body["items"]}


def test_a_failed_delivery_is_retried_elsewhere_and_isolated_for_everyone(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    put_route(admin, "send-t", {"send-a": 2, "send-b": 2})

    def deliver(q: SelectedQueue, payload: bytes) -> str:
        if q.broker_name == "send-a":
            raise ConnectionError("broker send-a refused the connection")
        return f"{q.broker_name}/{q.queue_id}"

    # 2 s, not the default 200 ms a busy machine can miss: this test is about Detour's answers.
    with DetourClient(service.url, decide_within=None, timeout=2.0) as client:
        results: list[SendResult[str]] = []
        # The service's round-robin walk reaches send-a within two sends.
        while not any(r.attempts[0].error for r in results):
            assert len(results) < 4
            results.append(client.send("send-t", b"m", deliver))
        failed = next(r for r in results if r.attempts[0].error)
        first, retry = failed.attempts
        assert first.queue.broker_name == "send-a" and isinstance(first.error, ConnectionError)
        assert retry.queue.broker_name == "send-b" and retry.error is None
        assert failed.queue == retry.queue and failed.value == f"send-b/{retry.queue.queue_id}"
        assert not retry.queue.local

        # Every attempt was reported; send-a is isolated in the shared table.
        now, items = fault_items(admin)
        a, b = items["send-a"], items["send-b"]
        assert a["available"] is False
        assert a["currentLatencyMs"] == int(first.latency_ms)
        assert now < a["availableAt"] <= now + ISOLATION_MS
        assert b["available"] is True
        assert client.stats().sent_reports == sum(len(r.attempts) for r in results)

        # Another producer's select avoids it too.
        with httpx.Client(base_url=service.url, timeout=5) as other:
            picks = [other.post("/select", json={"topic": "send-t"}).json() for _ in range(4)]
            assert {p["brokerName"] for p in picks} == {"send-b"}
            assert ["send-a"] in [p["avoidedBrokers"] for p in picks]


def test_the_deadline_stops_new_attempts(service: ServiceProcess, admin: httpx.Client) -> None:
    put_route(admin, "deadline-t", {f"dl-{c}": 1 for c in "abcdef"})
    calls: list[str] = []
    deadline_s = 1.0
    start = time.monotonic()

    def slow_failure(q: SelectedQueue, payload: bytes) -> None:
        calls.append(q.broker_name)
        if len(calls) == 2:  # the retry outlasts the send's deadline, however busy the machine
            time.sleep(max(0.0, start + deadline_s + 0.1 - time.monotonic()))
        raise TimeoutError("broker did not answer")

    with DetourClient(service.url, decide_within=None, retries=5, deadline=deadline_s) as client:
        start = time.monotonic()
        with pytest.raises(SendError) as info:
            client.send("deadline-t", b"m", slow_failure)
        elapsed = time.monotonic() - start
    err = info.value
    # Five retries allowed, but the deadline passed during the second attempt: no third.
    assert err.timed_out and len(err.attempts) == 2 == len(calls)
    assert len(set(calls)) == 2  # the retry went to another broker
    assert elapsed < deadline_s + 0.1 + 2  # and no wait after it (generous: a busy machine)
    assert all(isinstance(e, TimeoutError) for e in err.errors)
    _, items = fault_items(admin)
    assert all(items[b]["available"] is False for b in calls)


def test_a_restore_reaches_a_cached_client_whose_own_report_was_unanswered(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """The client's report reaches Detour, but Detour's answer to its batch is held back;
    meanwhile an operator restores the broker. Until the answer comes the client keeps its
    own report on top of Detour's items (it cannot know Detour holds it); once it comes,
    the broker's item is Detour's again: restored, not avoided for the rest of the window.
    The late answer is caused on purpose (a proxy holds the batch's reply)."""
    put_route(admin, "cache-r-t", {"cache-r": 1, "cache-s": 1})
    proxy = DelayProxy(int(service.url.rsplit(":", 1)[1]))
    try:
        with DetourClient(f"http://127.0.0.1:{proxy.port}", mode="cached", timeout=20,
                          deadline=30) as one, \
                DetourClient(service.url, mode="cached") as two:
            assert one.wait_ready(15) and two.wait_ready(15)

            def avoids(client: DetourClient) -> bool:
                return client.select("cache-r-t", last_broker="cache-s").broker_name != "cache-r"

            proxy.hold_reply_to, proxy.hold_reply_s = b'"cache-r"', 8.0
            one.report("cache-r", 3, isolation=True)
            assert avoids(one)
            wait_until(lambda: avoids(two), 10, "Detour applied the report and pushed it")
            admin.delete("/fault-items/cache-r").raise_for_status()
            wait_until(lambda: not avoids(two), 10, "the restore pushed")
            # the premise: the restore arrived while the client's answer was still held
            assert proxy.held == 1 and one.stats().pending_reports == 1
            assert avoids(one)  # its report still waits: re-applied on the restore
            wait_until(lambda: one.stats().pending_reports == 0, 20, "the answer came")
            wait_until(lambda: not avoids(one), 5, "the restore reached the client")
            _, items = fault_items(admin)
            assert "cache-r" not in items or items["cache-r"]["available"]
    finally:
        proxy.close()


def test_programming_mistakes_are_raised(service: ServiceProcess) -> None:
    with DetourClient(service.url, decide_within=None, timeout=2.0) as client:
        with pytest.raises(TopicNotFound):
            client.select("no-such-topic")
        with pytest.raises(DetourRequestError) as info:
            client.select("not a topic!")
        assert (info.value.status, info.value.code, info.value.field) == (
            422, "VALIDATION_ERROR", "topic")
        with pytest.raises(ValueError):
            client.report("b", -5)
        with pytest.raises(TopicNotFound):
            client.send("no-such-topic", b"m", lambda q, p: None)
        assert client.stats().detour_failures == 0  # none of that failed open


def test_cached_clients_obey_each_others_reports(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    put_route(admin, "cache-t", {"cache-a": 1, "cache-b": 1})
    with DetourClient(service.url, mode="cached") as one, \
            DetourClient(service.url, mode="cached") as two:
        assert one.wait_ready(15) and two.wait_ready(15)

        def avoids(client: DetourClient, broker: str) -> bool:
            # With the other broker as last_broker, an available broker is always chosen.
            other = "cache-b" if broker == "cache-a" else "cache-a"
            return client.select("cache-t", last_broker=other).broker_name != broker

        assert not avoids(two, "cache-a")
        one.report("cache-a", 3, isolation=True)
        assert avoids(one, "cache-a")  # its own report, at once
        # Pushed, not polled: well within the bound on a busy machine (speed: bench/).
        wait_until(lambda: avoids(two, "cache-a"), 10, "the other cached client avoids cache-a")
        sel = two.select("cache-t")
        assert sel.local and sel.broker_name == "cache-b" and sel.avoided_brokers == ("cache-a",)
        _, items = fault_items(admin)
        assert items["cache-a"]["available"] is False

        # An operator restore reaches both; so does a new route.
        admin.delete("/fault-items/cache-a").raise_for_status()
        wait_until(lambda: not avoids(one, "cache-a") and not avoids(two, "cache-a"), 10,
                   "the restore")
        put_route(admin, "cache-u", {"cache-c": 1})
        wait_until(lambda: two.select("cache-u").broker_name == "cache-c", 10, "the new route")
        with pytest.raises(TopicNotFound):
            two.select("no-such-topic")
        assert two.stats().remote_selects == 0 and two.stats().stream_connected


def test_every_cached_select_is_decided_locally_and_counted_once(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """Cached selects take the table first, whatever they ask (a first attempt, a retry, a
    key): each is local, counted once, and a bad key is still refused before it."""
    put_route(admin, "fast-t", {"fast-a": 2, "fast-b": 2})
    with DetourClient(service.url, mode="cached") as client:
        assert client.wait_ready(15)
        before = client.stats()
        firsts = [client.select("fast-t") for _ in range(8)]
        retries = [client.select("fast-t", last_broker="fast-a") for _ in range(4)]
        keyed = [client.select("fast-t", sharding_key="order-7") for _ in range(3)]
        with pytest.raises(ValueError):
            client.select("fast-t", sharding_key="")
        after = client.stats()
    assert all(s.local for s in firsts + retries + keyed)
    assert {(s.broker_name, s.queue_id) for s in firsts} == {
        (b, q) for b in ("fast-a", "fast-b") for q in (0, 1)
    }  # round robin over all four queues, twice
    assert {s.broker_name for s in retries} == {"fast-b"}
    assert len({(s.broker_name, s.queue_id) for s in keyed}) == 1  # the key's queue
    assert after.local_selects - before.local_selects == 15
    assert after.remote_selects == before.remote_selects == 0


def test_cached_send_loop_flushes_reports_in_batches(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    put_route(admin, "batch-t", {"batch-a": 2, "batch-b": 2})
    with DetourClient(service.url, mode="cached") as client:
        assert client.wait_ready(15)
        for i in range(300):
            client.send("batch-t", i, lambda q, p: None)
        wait_until(lambda: client.stats().sent_reports == 300, 10, "300 reports flushed")
        stats = client.stats()
        assert (stats.pending_reports, stats.dropped_reports) == (0, 0)
    _, items = fault_items(admin)
    assert items["batch-a"]["available"] and items["batch-b"]["available"]
