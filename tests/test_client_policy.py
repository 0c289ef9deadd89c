"""The SDK decides with the whole policy: a live Detour and cached clients agree on it.

Issue 16's table, row by row: each config beyond RocketMQ's defaults, the same table,
``POST /select`` answered by the service and ``select`` decided in-process by a cached
client (its table and config from the push stream). One memory-store service for the
module; each test sets its config, then uses its own topic and brokers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from detour.client import AsyncDetourClient, DetourClient, SelectedQueue
from detour.model import Config
from tests.procs import ServiceProcess, wait_until

pytestmark = pytest.mark.e2e

SELECTS = 40


@pytest.fixture
def admin(service: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, timeout=10) as c:
        yield c


def setup_table(
    admin: httpx.Client, config: dict[str, Any], topic: str, brokers: list[str]
) -> None:
    # a whole config (the service is the module's: nothing of an earlier test's stays)
    admin.put("/config", json={**Config().to_wire(), **config}).raise_for_status()
    body = {"brokers": [{"brokerName": b, "writeQueueNums": 4} for b in brokers]}
    admin.put(f"/routes/{topic}", json=body).raise_for_status()


def report(admin: httpx.Client, broker: str, latency_ms: int, isolation: bool, **kw: Any) -> None:
    body = {"brokerName": broker, "latencyMs": latency_ms, "isolation": isolation, **kw}
    admin.post("/report-latency", json=body).raise_for_status()


def server_selects(admin: httpx.Client, topic: str, **kw: Any) -> list[dict[str, Any]]:
    out = []
    for _ in range(SELECTS):
        r = admin.post("/select", json={"topic": topic, **kw})
        r.raise_for_status()
        out.append(r.json())
    return out


def cached(service: ServiceProcess, producer: str | None = None) -> DetourClient:
    client = DetourClient(service.url, mode="cached", timeout=2.0, producer=producer)
    assert client.wait_ready(10), "the cached client's stream never delivered a snapshot"
    return client


def sdk_selects(client: DetourClient, topic: str) -> list[SelectedQueue]:
    out = [client.select(topic) for _ in range(SELECTS)]
    assert all(s.local for s in out)
    return out


def shares(brokers: list[str]) -> Counter[str]:
    return Counter(brokers)


def test_max_avoided_percent_serves_the_least_bad_in_both(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """maxAvoidedPercent=50; a and b isolated, d slow: c and d, d unenforced."""
    a, b, c, d = (f"cap-{x}" for x in "abcd")
    setup_table(admin, {"maxAvoidedPercent": 50}, "cap-t", [a, b, c, d])
    report(admin, a, 3000, True)
    report(admin, b, 3000, True)
    report(admin, d, 600, False)  # the 550 ms tier: a 30 s window
    with cached(service) as client:
        served = server_selects(admin, "cap-t")
        local = sdk_selects(client, "cap-t")

    for counts in (
        shares([s["brokerName"] for s in served]),
        shares([s.broker_name for s in local]),
    ):
        assert set(counts) == {c, d}, counts
        assert min(counts.values()) >= SELECTS // 4, counts  # about half each
    assert all(s["unenforcedBrokers"] == [d] for s in served)
    assert all(s.unenforced_brokers == (d,) for s in local)


def test_panic_threshold_spreads_over_all_in_both(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """panicThresholdPercent=50; a, b and c isolated: all four, panic."""
    names = [f"panic-{x}" for x in "abcd"]
    setup_table(admin, {"panicThresholdPercent": 50}, "panic-t", names)
    for broker in names[:3]:
        report(admin, broker, 3000, True)
    with cached(service) as client:
        served = server_selects(admin, "panic-t")
        local = sdk_selects(client, "panic-t")

    assert set(shares([s["brokerName"] for s in served])) == set(names)
    assert set(shares([s.broker_name for s in local])) == set(names)
    assert all(s["panic"] and s["unenforcedBrokers"] == names[:3] for s in served)
    assert all(s.panic and s.unenforced_brokers == tuple(names[:3]) for s in local)


def test_a_producers_own_failure_short_of_the_quorum_is_avoided_by_it_in_both(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """isolationQuorum=2; p1 reports a failure on a: p1's selects avoid a, p2's do not."""
    a, b = "quorum-a", "quorum-b"
    setup_table(admin, {"isolationQuorum": 2}, "quorum-t", [a, b])
    with cached(service, "p1") as early, cached(service, "p2") as other:
        report(admin, a, 3000, True, producer="p1")
        # The connected client learns it from the stream's fault event ...
        wait_until(
            lambda: all(early.select("quorum-t").broker_name == b for _ in range(8)),
            10,
            "the cached client of p1 avoids quorum-a",
        )
        with cached(service, "p1") as late:  # ... a new one from the snapshot
            served_p1 = server_selects(admin, "quorum-t", producer="p1")
            served_p2 = server_selects(admin, "quorum-t", producer="p2")
            local_p1 = sdk_selects(early, "quorum-t") + sdk_selects(late, "quorum-t")
            local_p2 = sdk_selects(other, "quorum-t")
        with DetourClient(service.url, decide_within=None, timeout=2.0, producer="p1") as remote:
            remote_p1 = [remote.select("quorum-t") for _ in range(SELECTS)]

    assert {s["brokerName"] for s in served_p1} == {b}
    assert {s.broker_name for s in local_p1} == {b}
    assert {s.broker_name for s in remote_p1} == {b} and not any(s.local for s in remote_p1)
    # Short of the quorum: everyone else still sends to a.
    assert {s["brokerName"] for s in served_p2} == {a, b}
    assert {s.broker_name for s in local_p2} == {a, b}


def test_a_cached_producers_own_report_short_of_the_quorum_stays_avoided(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """The SDK's own failure report, once Detour has it and pushed it back, still keeps
    the producer away (the pushed item carries the producer's suspicion)."""
    a, b = "own-a", "own-b"
    setup_table(admin, {"isolationQuorum": 2}, "own-t", [a, b])
    with cached(service, "p7") as client:
        client.report(a, 5, isolation=True)
        wait_until(lambda: client.stats().sent_reports >= 1, 10, "the report sent")
        wait_until(
            lambda: {s["brokerName"] for s in server_selects(admin, "own-t", producer="p7")} == {b},
            10,
            "Detour avoids own-a for p7",
        )
        local = sdk_selects(client, "own-t")
        served_other = server_selects(admin, "own-t", producer="p8")

    assert {s.broker_name for s in local} == {b}
    assert {s["brokerName"] for s in served_other} == {a, b}


def test_max_avoided_percent_zero_avoids_nothing_in_both(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """maxAvoidedPercent=0; a isolated: a and b."""
    a, b = "zero-a", "zero-b"
    setup_table(admin, {"maxAvoidedPercent": 0}, "zero-t", [a, b])
    report(admin, a, 3000, True)
    with cached(service) as client:
        served = server_selects(admin, "zero-t")
        local = sdk_selects(client, "zero-t")

    for counts in (
        shares([s["brokerName"] for s in served]),
        shares([s.broker_name for s in local]),
    ):
        assert set(counts) == {a, b}, counts
    assert all(s["unenforcedBrokers"] == [a] for s in served)
    assert all(s.unenforced_brokers == (a,) for s in local)


def test_a_sharding_key_picks_the_same_queue_in_both(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    names = [f"key-{x}" for x in "abc"]
    setup_table(admin, {"orderedFallback": "remap"}, "key-t", names)
    report(admin, names[0], 3000, True)
    with cached(service) as client, \
            DetourClient(service.url, decide_within=None, timeout=2.0) as remote:
        for key in ("order-1", "order-2", "order-3", "customer-9", "x"):
            served = admin.post("/select", json={"topic": "key-t", "shardingKey": key}).json()
            local = client.select("key-t", sharding_key=key)
            asked = remote.select("key-t", sharding_key=key)
            for got in (local, asked):
                assert (got.broker_name, got.queue_id, got.ordered) == (
                    served["brokerName"],
                    served["queueId"],
                    served["ordered"],
                ), key
        with pytest.raises(ValueError):
            client.select("key-t", sharding_key="")


def test_fail_open_selects_decide_with_the_fetched_config() -> None:
    """Remote mode with Detour gone: the local select uses the config fetched earlier
    (maxAvoidedPercent=0: an isolated broker is still served), and the producer's own
    failure short of isolationQuorum keeps only that producer away."""
    a, b = "fo-a", "fo-b"
    with ServiceProcess() as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as admin:
            setup_table(admin, {"maxAvoidedPercent": 0}, "fo-t", [a, b])
        client = DetourClient(svc.url, decide_within=None, timeout=0.5, producer="p1",
                              backoff_initial=0.1)
        try:
            assert not client.select("fo-t").local  # fetches the route and the config
            svc.stop()
            client.report(a, 3000, isolation=True)
            local = [client.select("fo-t") for _ in range(SELECTS)]
        finally:
            client.close(flush_timeout=0.5)

    assert all(s.local for s in local)
    assert {s.broker_name for s in local} == {a, b}
    assert all(s.unenforced_brokers == (a,) for s in local)


def test_fail_open_keeps_a_producer_off_its_own_suspected_broker() -> None:
    a, b = "fq-a", "fq-b"
    with ServiceProcess() as svc:
        with httpx.Client(base_url=svc.url, timeout=10) as admin:
            setup_table(admin, {"isolationQuorum": 2}, "fq-t", [a, b])
        client = DetourClient(svc.url, decide_within=None, timeout=0.5, producer="p1",
                              backoff_initial=0.1)
        try:
            assert not client.select("fq-t").local
            svc.stop()
            client.report(a, 3000, isolation=True)
            local = [client.select("fq-t") for _ in range(SELECTS)]
            # Not isolated for everyone: the table holds p1's suspicion, no window.
            item = client._core.table.fault(a)
        finally:
            client.close(flush_timeout=0.5)

    assert all(s.local for s in local)
    assert {s.broker_name for s in local} == {b}
    assert item is not None and [who for who, _ in item.suspects] == ["p1"]


def test_the_async_client_decides_with_the_policy_too(
    service: ServiceProcess, admin: httpx.Client
) -> None:
    """AsyncDetourClient, cached and remote: maxAvoidedPercent=0 and a sharding key."""
    a, b = "aio-a", "aio-b"
    setup_table(admin, {"maxAvoidedPercent": 0}, "aio-t", [a, b])
    report(admin, a, 3000, True)
    served = admin.post("/select", json={"topic": "aio-t", "shardingKey": "k1"}).json()

    async def run() -> tuple[list[SelectedQueue], SelectedQueue, SelectedQueue]:
        async with AsyncDetourClient(service.url, mode="cached", timeout=2.0) as cached_:
            assert await cached_.wait_ready(10)
            local = [await cached_.select("aio-t") for _ in range(SELECTS)]
            keyed = await cached_.select("aio-t", sharding_key="k1")
        async with AsyncDetourClient(service.url, decide_within=None, timeout=2.0) as remote:
            asked = await remote.select("aio-t", sharding_key="k1")
        return local, keyed, asked

    local, keyed, asked = asyncio.run(run())
    assert {s.broker_name for s in local} == {a, b}
    assert all(s.local and s.unenforced_brokers == (a,) for s in local)
    for got in (keyed, asked):
        assert (got.broker_name, got.queue_id, got.ordered) == (
            served["brokerName"],
            served["queueId"],
            served["ordered"],
        )
