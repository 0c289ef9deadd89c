"""Cluster: the change channel is a sharded channel (SSUBSCRIBE/SPUBLISH, Redis 7).

A real cluster on loopback (three masters, each with one replica): a namespace's pushes
stay on the shard serving its slot (``PUBSUB SHARDCHANNELS`` lists the channel there and
nowhere else; no node has a classic channel of ours), and a failover of that shard's
master (``CLUSTER FAILOVER`` on its replica) keeps them flowing: the old master drops the
sharded subscriptions with the slot, and each process subscribes again on the new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from service.settings import Settings
from service.store import ReportIn
from service.store.redis import RedisStore
from tests.procs import PATIENT_CALL_TIMEOUT_S, RedisServer, wait_until, wait_until_async
from tests.test_scenario_cluster_failover import ReplicatedCluster

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

CHANNEL = "detour:{default}:changes"
META = "detour:{default}:meta"


@pytest.fixture
def cluster() -> Iterator[ReplicatedCluster]:
    c = ReplicatedCluster()
    yield c
    c.stop()


def _shard_channels(node: RedisServer) -> list[str]:
    with node.client() as c:
        return sorted(c.execute_command("PUBSUB", "SHARDCHANNELS", "detour:*"))


def _classic_channels(node: RedisServer) -> list[str]:
    with node.client() as c:
        return sorted(c.pubsub_channels("detour:*"))


def _shard_subscribers(node: RedisServer) -> int:
    with node.client() as c:
        _, count = c.execute_command("PUBSUB", "SHARDNUMSUB", CHANNEL)
        return int(count)


def test_pushes_stay_on_the_owning_shard_and_survive_its_failover(
    cluster: ReplicatedCluster,
) -> None:
    master, replica = cluster.owner(META)
    others = [n for n in cluster.nodes if n not in (master, replica)]
    settings = Settings(redis_url=cluster.url, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    async def report(store: RedisStore, broker: str) -> int:
        """Report until Redis took it (a failover may answer one with the journal)."""
        for _ in range(100):
            (out,) = await store.report_many([ReportIn(broker, 0, True)])
            if not store.degraded:
                return out.available_at
            await wait_until_async(lambda: not store.degraded, 20, "the store recovered",
                                   interval_s=0.05)
        raise AssertionError(f"{broker} never reached Redis")

    async def scenario() -> None:
        writer, follower = RedisStore(settings), RedisStore(settings)
        await writer.start()
        await follower.start()
        try:
            await wait_until_async(
                lambda: _shard_subscribers(master) == 2 and writer.synced.is_set()
                and follower.synced.is_set(), 20, "both subscribed on the slot's master",
                interval_s=0.05)
            assert _shard_channels(master) == [CHANNEL]
            for node in others:
                assert _shard_channels(node) == [], "a sharded channel off the owning shard"
            for node in cluster.nodes:
                assert _classic_channels(node) == [], "a classic channel of ours"
            at = await report(writer, "a")
            await wait_until_async(lambda: "a" in follower.view.faults, 20, "the push")
            assert follower.view.faults["a"].available_at == at

            # The shard's master fails over to its replica (no data lost: a manual failover
            # waits for the replica to catch up).
            with replica.client() as r:
                r.execute_command("CLUSTER", "FAILOVER")
                wait_until(lambda: r.info("replication")["role"] == "master", 30,
                           "the replica took over")
            await wait_until_async(
                lambda: _shard_subscribers(replica) == 2 and _shard_subscribers(master) == 0
                and writer.synced.is_set() and follower.synced.is_set(), 30,
                "both subscribed again on the new master", interval_s=0.05)
            at = await report(writer, "b")
            await wait_until_async(lambda: "b" in follower.view.faults, 20,
                                   "a push after the failover", interval_s=0.05)
            assert follower.view.faults["b"].available_at == at
            assert _shard_channels(replica) == [CHANNEL]
            for node in cluster.nodes:
                assert _classic_channels(node) == []
        finally:
            await follower.close()
            await writer.close()

    asyncio.run(scenario())
