"""The fan-out tier: which Redis server a process subscribes to and reads its polls and
snapshots from, a replica while one keeps up, the primary otherwise.

A replica carries the primary's pushes (Redis replicates ``PUBLISH``) and its table, so a
fleet spread over replicas costs the primary one push per window and replica, not one per
sidecar. Writes, and every script that writes, go to the primary; only what the follower
reads moves, so the merge and exactly-once rules (decided on what the primary answers)
are the same. A replica is left for the primary, for ``retry_s``, when it fails a call or
when its table stays behind what this process knows of the primary's (the version a write
or a poll of the primary returned) for ``max_lag_s``: its replication is lagging or broken.
(Detour's ACL user has no ``INFO`` or ``ROLE``: the table's version, which every change
increments, stands in for the replication offset.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from service import metrics
from service.errors import StoreUnavailable
from service.store.connect import StoreClients, host_port

log = logging.getLogger("detour.store")


class ReplicaBehind(StoreUnavailable):
    """The replica read is behind what this process knows the primary holds: read the
    primary instead (it alone decides whether the table lost data)."""


def parse_replicas(spec: str) -> list[tuple[str, int]] | None:
    """``redis_replicas`` as addresses; None for ``sentinel`` (asked at each choice), [] when
    empty. Raises ValueError on a malformed address."""
    spec = spec.strip()
    if spec == "sentinel":
        return None
    return [
        host_port(h.strip(), 6379, "DETOUR_REDIS_REPLICAS") for h in spec.split(",") if h.strip()
    ]


class ReadTier:
    """The replica a process reads from now (None: the primary) and when to leave it."""

    def __init__(
        self,
        conn: StoreClients,
        spec: str,
        namespace: str,
        *,
        max_lag_s: float,
        primary_poll_s: float,
        retry_s: float,
    ) -> None:
        self._conn = conn
        self._namespace = namespace
        self.enabled = bool(spec.strip())
        if self.enabled and conn.target.mode == "cluster":
            raise ValueError("DETOUR_REDIS_REPLICAS is not for a redis+cluster:// URL")
        self._static = parse_replicas(spec) if self.enabled else []
        if self._static is None and conn.sentinel is None:
            raise ValueError("DETOUR_REDIS_REPLICAS=sentinel needs a redis+sentinel:// URL")
        self.max_lag_s = max_lag_s
        self.primary_poll_s = primary_poll_s
        self._retry_s = retry_s
        #: the replica client in use and its address (None: reading the primary)
        self.client: Redis | None = None
        self.address: tuple[str, int] | None = None
        #: when this process may try a replica again (monotonic seconds)
        self._retry_at = 0.0
        #: a fleet's processes start on different replicas, and move to the next on failure
        self._turn = random.randrange(1 << 16)
        #: the highest table version this process knows the primary reached
        self.primary_version = 0
        #: since when the replica has been behind it (monotonic seconds), None: it is not
        self._behind_since: float | None = None
        metrics.READING_REPLICA.labels(namespace)  # the series exists from the start

    @property
    def on_replica(self) -> bool:
        return self.client is not None

    async def _addresses(self) -> list[tuple[str, int]]:
        if self._static is not None:
            return self._static
        sentinel = self._conn.sentinel
        assert sentinel is not None
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self._conn.timeout_s):
                found = await sentinel.discover_slaves(self._conn.target.service)
                return [(str(h), int(p)) for h, p in found]
        return []

    async def choose(self) -> Redis | None:
        """At each (re)subscription: a replica client to read from, or None (the primary:
        none configured, none listed, or a recent fallback)."""
        await self.close()
        if not self.enabled or time.monotonic() < self._retry_at:
            return None
        addresses = await self._addresses()
        if not addresses:
            self.fall_back("none", "no replica listed")
            return None
        self._turn += 1
        self.address = addresses[self._turn % len(addresses)]
        self.client = self._conn.node_client(*self.address)
        self._behind_since = None
        return self.client

    def fall_back(self, cause: str, why: str) -> None:
        """Read from the primary for ``retry_s``: counted by cause (lagging, unreachable,
        none) and logged, the one event an operator gets."""
        metrics.READ_FALLBACKS.labels(cause).inc()
        metrics.READING_REPLICA.labels(self._namespace).set(0)
        self._retry_at = time.monotonic() + self._retry_s
        where = f"{self.address[0]}:{self.address[1]}" if self.address else "(none)"
        log.warning(
            "redis read tier: namespace %s leaves replica %s for the primary for %.0f s (%s): %s",
            self._namespace,
            where,
            self._retry_s,
            cause,
            why,
        )

    def reading(self) -> None:
        """Subscribed and synced on the replica."""
        metrics.READING_REPLICA.labels(self._namespace).set(1)

    def primary_at(self, version: int) -> None:
        """The primary answered with the table at ``version`` (a write's reply, a poll)."""
        self.primary_version = max(self.primary_version, version)

    def check_lag(self, replica_version: int, view_version: int) -> None:
        """After a read of the replica: raises ReplicaBehind once its table has stayed
        behind the primary's known version (or this process's view) for ``max_lag_s``."""
        known = max(self.primary_version, view_version)
        if replica_version >= known:
            self._behind_since = None
            return
        now = time.monotonic()
        if self._behind_since is None:
            self._behind_since = now
        elif now - self._behind_since > self.max_lag_s:
            raise ReplicaBehind(
                f"the replica's table is at version {replica_version}, the primary's at "
                f"{known} or later, for over {self.max_lag_s:g} s"
            )

    def may_try(self) -> bool:
        """Reading the primary after a fallback: is it time to try a replica again?"""
        return self.enabled and time.monotonic() >= self._retry_at

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            metrics.READING_REPLICA.labels(self._namespace).set(0)
            with contextlib.suppress(Exception):
                await client.aclose()
