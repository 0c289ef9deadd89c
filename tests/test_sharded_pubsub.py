"""Cluster: the change channel is a sharded channel (SSUBSCRIBE/SPUBLISH, Redis 7).

A real cluster on loopback (three masters, each with one replica): a namespace's pushes
stay on the shard serving its slot (``PUBSUB SHARDCHANNELS`` lists the channel there and
nowhere else; no node has a classic channel of ours), and a failover of that shard's
master (``CLUSTER FAILOVER`` on its replica) or a move of the slot to another master keeps
them flowing: the old owner drops the sharded subscriptions with the slot, and each process
subscribes again on the new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

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


def _where(cluster: ReplicatedCluster, *stores: RedisStore) -> str:
    """Each node's role and sharded subscribers, and each store's state."""
    nodes = []
    for n in cluster.nodes:
        with n.client() as c:
            nodes.append(f"{n.port} {c.execute_command('ROLE')[0]} subscribers "
                         f"{_shard_subscribers(n)}")
    states = [f"synced {s.synced.is_set()} degraded {s.degraded}" for s in stores]
    return f"nodes: {', '.join(nodes)}; stores: {', '.join(states)}"


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
            try:
                await wait_until_async(
                    lambda: _shard_subscribers(replica) == 2 and _shard_subscribers(master) == 0
                    and writer.synced.is_set() and follower.synced.is_set(), 30,
                    "both subscribed again on the new master", interval_s=0.05)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; {_where(cluster, writer, follower)}") from None
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


def test_subscriptions_follow_a_slot_move(cluster: ReplicatedCluster) -> None:
    """The namespace's slot is migrated to another master (keys by MIGRATE, then CLUSTER
    SETSLOT ... NODE on every master): the old owner drops its sharded subscribers with the
    slot, both processes subscribe on the new owner, and pushes flow."""
    source, _ = cluster.owner(META)
    target = next(n for n in cluster.nodes[:3] if n is not source)
    settings = Settings(redis_url=cluster.url, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    def move_slot() -> None:
        with source.client() as s, target.client() as t:
            slot = int(s.execute_command("CLUSTER", "KEYSLOT", META))
            source_id = s.execute_command("CLUSTER", "MYID")
            target_id = t.execute_command("CLUSTER", "MYID")
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            for _ in range(1000):  # bounded: the namespace has a few dozen keys
                keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
                if not keys:
                    break
                s.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                  "KEYS", *keys)
            for node in cluster.nodes[:3]:
                with node.client() as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    async def scenario() -> None:
        writer, follower = RedisStore(settings), RedisStore(settings)
        await writer.start()
        await follower.start()
        try:
            await wait_until_async(
                lambda: _shard_subscribers(source) == 2 and writer.synced.is_set()
                and follower.synced.is_set(), 20, "both subscribed on the slot's master",
                interval_s=0.05)
            await writer.report_many([ReportIn("a", 0, True)])
            await wait_until_async(lambda: "a" in follower.view.faults, 20, "the push")
            move_slot()
            await wait_until_async(
                lambda: _shard_subscribers(target) == 2 and _shard_subscribers(source) == 0
                and writer.synced.is_set() and follower.synced.is_set(), 30,
                "both subscribed on the slot's new master", interval_s=0.05)
            assert _shard_channels(target) == [CHANNEL] and _shard_channels(source) == []
            for _ in range(100):  # (a report racing the move may be journaled, replayed)
                (out,) = await writer.report_many([ReportIn("b", 0, True)])
                if not writer.degraded:
                    break
                await wait_until_async(lambda: not writer.degraded, 20, "recovered",
                                       interval_s=0.05)
            await wait_until_async(lambda: "b" in follower.view.faults, 20,
                                   "a push after the move", interval_s=0.05)
            assert follower.view.faults["b"].available_at == out.available_at
        finally:
            await follower.close()
            await writer.close()

    asyncio.run(scenario())


def test_a_stale_slot_map_never_leaves_the_subscription_on_a_replica(
    cluster: ReplicatedCluster,
) -> None:
    """The slot map a process reads after a failover can come from a node that has not yet
    heard of it, and name the old master, by then a replica. Redis takes ``SSUBSCRIBE``
    there, but a new master publishes past a replica it does not yet count in its shard:
    pushes lost. Here the first map a process reads names the slot's replica (a stale map,
    injected): the process finds it subscribed on a replica, reads the map again and ends
    on the master, where pushes reach it."""
    master, replica = cluster.owner(META)
    settings = Settings(redis_url=cluster.url, sync_interval_s=60,
                        redis_call_timeout_s=PATIENT_CALL_TIMEOUT_S)

    async def scenario() -> None:
        writer, stale = RedisStore(settings), RedisStore(settings)
        topology = stale._topology
        real = topology._pubsub_nodes
        maps_read = 0

        def first_map_stale(client: Any) -> tuple[list[tuple[str, int]], bool]:
            nonlocal maps_read
            maps_read += 1
            if maps_read == 1:
                return [("127.0.0.1", replica.port)], True
            return real(client)

        topology._pubsub_nodes = first_map_stale  # type: ignore[method-assign]
        await writer.start()
        await stale.start()
        try:
            try:
                await wait_until_async(
                    lambda: _shard_subscribers(master) == 2 and writer.synced.is_set()
                    and stale.synced.is_set(), 20, "both subscribed on the slot's master",
                    interval_s=0.05)
            except TimeoutError as exc:
                raise TimeoutError(f"{exc}; {_where(cluster, writer, stale)}") from None
            assert maps_read >= 2, "the stale map was never read"
            assert _shard_subscribers(replica) == 0, "a subscription left on the replica"
            (out,) = await writer.report_many([ReportIn("a", 0, True)])
            await wait_until_async(lambda: "a" in stale.view.faults, 20, "the push",
                                   interval_s=0.05)
            assert stale.view.faults["a"].available_at == out.available_at
        finally:
            await stale.close()
            await writer.close()

    asyncio.run(scenario())
