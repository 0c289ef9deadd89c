"""The asyncio producer SDK against a live Detour process: send loop, deadline, cached mode.

No pytest plugin: each test runs its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
import pytest

from detour.client import AsyncDetourClient, SelectedQueue, SendError, SendResult
from detour.view import CHANGES_PER_TURN
from tests.procs import ServiceProcess, wait_until_async

pytestmark = pytest.mark.e2e


def put_route(url: str, topic: str, brokers: dict[str, int]) -> None:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": n} for b, n in brokers.items()]}
    httpx.put(f"{url}/routes/{topic}", json=body, timeout=5).raise_for_status()


def items(url: str) -> dict[str, dict[str, object]]:
    body = httpx.get(f"{url}/fault-items", timeout=5).json()
    return {i["brokerName"]: i for i in body["items"]}


def test_async_send_retries_elsewhere_and_isolates(service: ServiceProcess) -> None:
    put_route(service.url, "async-t", {"async-a": 1, "async-b": 1})

    async def deliver(q: SelectedQueue, payload: bytes) -> int:
        await asyncio.sleep(0)
        if q.broker_name == "async-a":
            raise ConnectionResetError("async-a reset the connection")
        return len(payload)

    async def main() -> None:
        async with AsyncDetourClient(service.url, decide_within=None, timeout=2.0) as client:
            results: list[SendResult[int]] = []
            while not any(r.attempts[0].error for r in results):
                assert len(results) < 4
                results.append(await client.send("async-t", b"hello", deliver))
            failed = next(r for r in results if r.attempts[0].error)
            assert [a.queue.broker_name for a in failed.attempts] == ["async-a", "async-b"]
            assert failed.value == 5
            assert client.stats().sent_reports == sum(len(r.attempts) for r in results)

    asyncio.run(main())
    table = items(service.url)
    assert table["async-a"]["available"] is False and table["async-b"]["available"] is True


def test_async_deadline_cuts_a_hanging_deliver(service: ServiceProcess) -> None:
    put_route(service.url, "async-dl", {f"adl-{c}": 1 for c in "abcd"})
    started: list[str] = []
    at: dict[str, float] = {}

    async def hang(q: SelectedQueue, payload: bytes) -> None:
        started.append(q.broker_name)
        at["deliver"] = time.monotonic()
        await asyncio.sleep(60)

    async def main() -> SendError:
        async with AsyncDetourClient(service.url, decide_within=None, retries=3,
                                     deadline=0.3) as client:
            with pytest.raises(SendError) as info:
                at["send"] = time.monotonic()
                await client.send("async-dl", b"m", hang)
            return info.value

    err = asyncio.run(main())
    assert err.timed_out and started == [err.attempts[0].queue.broker_name]
    assert isinstance(err.attempts[0].error, TimeoutError)
    # Cut at the send's deadline: the deliver had what the select left of the 0.3 s, not
    # less, and not its 60 s (the upper bound is generous for a busy machine).
    left_ms = (at["send"] + 0.3 - at["deliver"]) * 1000
    assert left_ms - 5 <= err.attempts[0].latency_ms < left_ms + 1000
    assert items(service.url)[started[0]]["available"] is False


def test_async_cached_clients_obey_each_others_reports(service: ServiceProcess) -> None:
    put_route(service.url, "acache-t", {"acache-a": 1, "acache-b": 1})

    async def main() -> None:
        async with AsyncDetourClient(service.url, mode="cached") as one, \
                AsyncDetourClient(service.url, mode="cached") as two:
            assert await one.wait_ready(15) and await two.wait_ready(15)
            last = {"acache-a": "acache-b", "acache-b": "acache-a"}
            picks: dict[str, str] = {}

            async def refresh(client: AsyncDetourClient, name: str) -> None:
                picks[name] = (await client.select("acache-t", last["acache-a"])).broker_name

            await refresh(two, "two")
            assert picks["two"] == "acache-a"
            await one.report("acache-a", 2, isolation=True)
            await refresh(one, "one")
            assert picks["one"] == "acache-b"  # its own report, at once

            start = time.monotonic()
            while picks["two"] != "acache-b":
                assert time.monotonic() - start < 10, "the other client never avoided acache-a"
                await asyncio.sleep(0.005)
                await refresh(two, "two")
            assert two.stats().remote_selects == 0

            async def deliver(q: SelectedQueue, payload: int) -> str:
                return q.broker_name

            result = await two.send("acache-t", 1, deliver)
            assert result.value == "acache-b" and result.queue.local
            await wait_until_async(lambda: two.stats().sent_reports == 1, 10, "the batch")

    asyncio.run(main())
    assert items(service.url)["acache-a"]["available"] is False


def test_every_async_cached_select_is_decided_locally_and_counted_once(
    service: ServiceProcess,
) -> None:
    """As the sync client: the table first, each select local and counted once."""
    put_route(service.url, "afast-t", {"afast-a": 2, "afast-b": 2})

    async def main() -> None:
        async with AsyncDetourClient(service.url, mode="cached") as client:
            assert await client.wait_ready(15)
            before = client.stats()
            firsts = [await client.select("afast-t") for _ in range(8)]
            retries = [await client.select("afast-t", "afast-a") for _ in range(4)]
            keyed = [await client.select("afast-t", sharding_key="k") for _ in range(3)]
            with pytest.raises(ValueError):
                await client.select("afast-t", sharding_key="x" * 1025)
            after = client.stats()
        assert all(s.local for s in firsts + retries + keyed)
        assert len({(s.broker_name, s.queue_id) for s in firsts}) == 4
        assert {s.broker_name for s in retries} == {"afast-b"}
        assert len({(s.broker_name, s.queue_id) for s in keyed}) == 1
        assert after.local_selects - before.local_selects == 15
        assert after.remote_selects == before.remote_selects == 0

    asyncio.run(main())


def test_async_cached_client_applies_a_burst_of_events_a_few_at_a_time(
    service: ServiceProcess,
) -> None:
    """One read of the event stream can hold hundreds of events (a batch's window changes),
    applied on the producer's own loop. The stream task gives the loop up every
    ``CHANGES_PER_TURN`` events, as a replica does with its pushes: between two turns of
    another task the client's table takes at most that many of them."""
    changes = 400
    batch = {"reports": [{"brokerName": f"burst-{i}", "latencyMs": 600} for i in range(changes)]}
    relayed = threading.Event()
    subscribed = threading.Event()

    def watch() -> None:
        """Another stream reader: once it has the burst's last event, the service has
        written every event of the burst to the client's connection too."""
        with httpx.stream("GET", f"{service.url}/fault-items/stream", timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("event: snapshot"):
                    subscribed.set()
                elif f'"burst-{changes - 1}"' in line:
                    relayed.set()
                    return

    async def main() -> None:
        async with AsyncDetourClient(service.url, mode="cached") as client:
            assert await client.wait_ready(15)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            assert subscribed.wait(15)
            faults = client._core.table.view.faults  # the client's copy of the table

            def burst_known() -> int:
                return sum(1 for name in faults if name.startswith("burst-"))

            # Posted while this loop is held: the client's stream task reads nothing
            # until the whole burst waits in its connection.
            httpx.post(f"{service.url}/report-latency:batch", json=batch,
                       timeout=30).raise_for_status()
            assert relayed.wait(30), "the burst never reached the other reader"
            seen = [burst_known()]
            for _ in range(100_000):
                if seen[-1] == changes:
                    break
                await asyncio.sleep(0)
                seen.append(burst_known())
            assert seen[-1] == changes
            steps = [b - a for a, b in itertools.pairwise(seen)]
            assert max(steps) <= CHANGES_PER_TURN, max(steps)
            watcher.join(10)

    asyncio.run(main())
