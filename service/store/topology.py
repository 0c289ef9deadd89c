"""Where the table lives when Redis is more than one server: the Sentinel master and Cluster nodes.

The store's commands name keys of one slot, so redis-py routes them by itself. What
it cannot do on its own is keep a *subscription* on the right server: under Sentinel
on the current master (resubscribing when the master moved), in a Cluster on the node
serving the namespace's slot (the change channel is a sharded one there), with the slot
map read again after each failure, so that it follows slot moves and failovers.
"""

from __future__ import annotations

import asyncio
import contextlib

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.exceptions import RedisClusterException, RedisError

from service.errors import StoreUnavailable
from service.store.connect import StoreClients


class Topology:
    """The servers behind ``conn`` as the follower needs them: the master, the pub/sub node."""

    def __init__(self, conn: StoreClients, timeout_s: float, routing_key: str) -> None:
        self._conn = conn
        self._timeout_s = timeout_s
        #: a key of the namespace's slot (a Cluster's pub/sub goes to its node first)
        self._routing_key = routing_key
        #: Cluster only: how many subscriptions failed, so the next one tries another node.
        self._pubsub_turn = 0

    @property
    def sentinel(self) -> bool:
        return self._conn.sentinel is not None

    def subscription_failed(self) -> None:
        """The next subscription reads the slot map again first (Cluster)."""
        self._pubsub_turn += 1

    async def refresh_slots(self) -> None:
        """Cluster, after a failed subscription: read the slot map again, so the next one
        goes to the node serving the slot now (a failover, a slot move). Failing here is
        left to the subscription that follows (it fails too, and is retried)."""
        client = self._conn.main
        if self._pubsub_turn and isinstance(client, RedisCluster):
            with contextlib.suppress(RedisClusterException, RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self._timeout_s):
                    await client.nodes_manager.initialize()

    def master_address(self) -> tuple[str, int] | None:
        """Sentinel: the master the pools use now (None elsewhere or before the first ask)."""
        for pool in self._conn.sentinel_pools():
            address = pool.master_address
            if address is not None:
                return (str(address[0]), int(address[1]))
        return None

    async def find_master(self) -> None:
        """Sentinel: ask where the master is now, before subscribing.

        Each pool keeps the master it last found and drops its idle connections
        to another one, so the subscription, the snapshot and the reports that
        follow all go to the current master.
        """
        for pool in self._conn.sentinel_pools():
            await pool.get_master_address()  # type: ignore[no-untyped-call]

    async def _sentinel_says(self) -> tuple[str, int] | None:
        """Sentinel: the master's address as one sentinel names it (one cheap query).

        None when that sentinel does not answer (the next poll asks another):
        sentinels being away does not make a healthy master unusable.
        """
        sentinel = self._conn.sentinel
        assert sentinel is not None
        first = sentinel.sentinels[0]
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await first.execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self._conn.target.service
                )
        except (TimeoutError, RedisError, OSError):
            sentinel.sentinels.append(sentinel.sentinels.pop(0))
            return None
        if not reply:
            return None
        host, port = (x.decode() if isinstance(x, bytes) else str(x) for x in reply)
        return host, int(port)

    async def follow_master(self, pubsub: PubSub | None) -> None:
        """Sentinel: move to a new master as soon as the sentinels name one.

        Connections to the old master keep working after a switchover
        (``SENTINEL FAILOVER``) until the sentinels reconfigure it, about ten
        seconds later: writes it accepts meanwhile are lost when it becomes a
        replica. Asking every poll bounds that to one ``sync_interval_s``.
        Raises StoreUnavailable when the subscription must move (``pubsub`` None: it is on
        a replica, which does not move with the master).
        """
        said = await self._sentinel_says()
        if said is not None and any(
            pool.master_address not in (None, said) for pool in self._conn.sentinel_pools()
        ):
            await self.find_master()  # the full check (the master is up) before moving
        if self._master_moved(pubsub):
            raise StoreUnavailable("the sentinel master moved: subscribing on the new one")

    def _master_moved(self, pubsub: PubSub | None) -> bool:
        """Sentinel: the subscription is on a server that is no longer the master.

        A pool learns of a failover when it makes a connection (a report that
        found its master gone or read-only, say). A subscription still open on a
        demoted master would keep receiving pushes by replication, but only as
        long as that server lives and replicates: it moves to the new master.
        """
        conn = pubsub.connection if pubsub is not None else None
        if conn is None:
            return False
        return any(
            pool.master_address not in (None, (conn.host, conn.port))
            for pool in self._conn.sentinel_pools()
        )

    def _pubsub_nodes(self, cluster: RedisCluster) -> tuple[list[tuple[str, int]], bool]:
        """Cluster nodes to subscribe on: the namespace slot's node first.

        The change channel is sharded (``SSUBSCRIBE``): only the slot's shard carries it,
        and a node of another shard answers MOVED. The others are listed for when the slot
        map is not known at all; the map read again after a failure names the owner.
        Returns the nodes and whether the first is the slot's.
        """
        nodes: list[tuple[str, int]] = []
        with contextlib.suppress(RedisClusterException, RedisError, KeyError):
            owner = cluster.get_node_from_key(self._routing_key)
            if owner is not None:
                nodes.append((owner.host, int(owner.port)))
        owned = bool(nodes)
        nodes += [(n.host, int(n.port)) for n in cluster.get_nodes()]
        nodes += self._conn.target.hosts
        return list(dict.fromkeys(nodes)), owned

    async def close_idle(self, *others: Redis) -> int:
        """Close the connections nothing uses (``StoreClients.close_idle``), ``others``' too;
        how many were closed."""
        return await self._conn.close_idle(self._routing_key, *others)

    def held(self, pubsub: PubSub, replica: Redis | None) -> dict[str, int]:
        """The connections open now, by use (``StoreClients.held``), the subscription
        counted once: as ``subscription``, not in the pool it was taken from."""
        held = self._conn.held(replica)
        conn = pubsub.connection
        held["subscription"] = sub = int(conn is not None and conn.is_connected)
        pool = pubsub.connection_pool
        if replica is not None and pool is replica.connection_pool:
            held["replica"] -= sub
        elif isinstance(self._conn.main, Redis) and pool is self._conn.main.connection_pool:
            held["commands"] -= sub
        return held

    async def check_slot_master(self, pubsub: PubSub) -> None:
        """Cluster, once a sharded subscription is confirmed: it must be on a master.

        A slot map read from a node that has not yet heard of a failover names the old
        master, by then the new one's replica. Redis takes ``SSUBSCRIBE`` there too, but
        for a moment after the failover the new master does not count that node in its
        shard and publishes past it: pushes lost until the next one shows the gap, or the
        next poll. A node drops its sharded subscribers in the same step in which it stops
        serving the slot, before it calls itself a replica; so a node that still says
        "master" once the subscription is confirmed drops it (and this process subscribes
        again) when it stops being one. A replica's subscription is refused here: the
        caller fails it, and the next one reads the slot map again.
        """
        client = self._conn.main
        conn = pubsub.connection
        if not isinstance(client, RedisCluster) or conn is None:
            return
        node = client.get_node(host=conn.host, port=conn.port)
        if node is None:
            return  # (a node the map no longer names: the next push or poll tells)
        async with asyncio.timeout(self._timeout_s):
            role = await client.execute_command("ROLE", target_nodes=node)
        if str(role[0]) != "master":
            raise StoreUnavailable("subscribed on a replica: the slot map read was stale")

    def open_pubsub(self) -> tuple[PubSub, Redis | None]:
        """A pub/sub connection for the changes channel, and the client to close with it."""
        client = self._conn.main
        if isinstance(client, RedisCluster):
            nodes, owned = self._pubsub_nodes(client)
            # The slot's node when the map names one; else each try another.
            host, port = nodes[0] if owned else nodes[self._pubsub_turn % len(nodes)]
            node = self._conn.node_client(host, port)
            return node.pubsub(), node
        return client.pubsub(), None
