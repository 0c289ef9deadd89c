"""Keeping a replica's view current: pushes applied in order, a poll as a safety net, the clock.

The follower subscribes to the namespace's change channel, takes a snapshot once
Redis confirmed the subscription (so no change falls between), then applies each
pushed change in version order. Every ``sync_interval_s`` it polls the table's
identity (version, epoch, this writer's high-water mark) and Redis's clock in one
keyed round trip: a gap, a lost table or a moved master sends it back to a full
resync. The store does the resync and the replay; the follower decides when.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio.client import PubSub

from detour.clock import Readings, mono_ms
from detour.view import CHANGES_PER_TURN, TableView
from service import metrics
from service.cancelling import honour_cancel
from service.errors import StoreUnavailable
from service.store import codec
from service.store.reads import ReadTier, ReplicaBehind
from service.store.replies import PollReply
from service.store.topology import Topology

log = logging.getLogger("detour.store")

_MAX_BACKOFF_S = 5.0


class RedisClock:
    """Redis's time estimated from the local monotonic clock: a lower bound, the best of
    the recent samples.

    Every script reply carries Redis's clock. Redis read it somewhere during the round
    trip, so pinning it to the moment the reply was received gives a lower bound of
    Redis time: a window is seen ending up to one round trip late, never early. A slow
    round trip gives a poor bound, and one poor sample must not move the estimate back:
    an item written a moment ago with no window (``availableAt`` = the write's time, a
    tier of 0 ms) would then look avoided until the clock caught up again, and every
    select in between would fall to pickOneAtLeast. So the estimate is the largest
    sample of the last ``HOLD_MS`` to ``2 × HOLD_MS`` (two buckets): it follows drift
    between the two clocks within seconds, and it steps back at once only when Redis's
    clock was set back by more than ``STEP_MS`` (or a failover reached a host whose
    clock is that far behind).

    Read, it never goes back short of that step (``detour.clock.Readings``): when a
    bucket ends and the estimate drops by a few ms, ``now_ms`` holds still until it
    catches up.
    """

    HOLD_MS = 5_000.0
    STEP_MS = 10_000.0

    def __init__(self) -> None:
        # Until the first sample, the local wall clock stands in for Redis's.
        self._readings = Readings(time.time_ns() / 1_000_000 - mono_ms())
        self._current: float | None = None  # the best sample of the current bucket
        self._previous: float | None = None  # ... and of the one before
        self._bucket_at = 0.0
        #: Redis's time now, in ms (every select reads it: one call, no wrapper).
        self.now_ms: Callable[[], int] = self._readings.read

    @property
    def offset_ms(self) -> float:
        """Redis's clock minus the local monotonic clock, as estimated now."""
        return self._readings.offset_ms

    def observe(self, redis_now_ms: int, received_ms: float) -> None:
        """Take one sample: Redis said ``redis_now_ms`` in a reply received (local
        monotonic clock) at ``received_ms``."""
        sample = redis_now_ms - received_ms
        if self._current is None or sample < self.offset_ms - self.STEP_MS:
            # The first sample, or Redis's clock went back: the readings follow it.
            self._current, self._previous, self._bucket_at = sample, None, received_ms
            self._readings.restart(sample)
            return
        if received_ms - self._bucket_at >= self.HOLD_MS:
            self._current, self._previous, self._bucket_at = sample, self._current, received_ms
        elif sample > self._current:
            self._current = sample
        self._readings.move(
            self._current if self._previous is None else max(self._current, self._previous)
        )


class _Resubscribe(StoreUnavailable):
    """Not a failure: subscribe again (the Sentinel master moved under a replica reader)."""


class Followed(Protocol):
    """What the follower needs from the store it keeps current."""

    view: TableView
    synced: asyncio.Event
    namespace: str

    @property
    def journal_size(self) -> int: ...

    @property
    def has_epoch(self) -> bool: ...

    async def resync(self) -> None: ...

    async def replay_journal(self) -> None: ...

    async def poll(self, *, primary: bool = False) -> PollReply: ...

    def held(self) -> tuple[int, int, int]: ...

    def table_lost(
        self, reply: PollReply, held: tuple[int, int, int], *, primary: bool = True
    ) -> bool: ...

    def saw(self, stamp: int) -> None: ...

    def doubt(self, cause: str, replica: str = "") -> None: ...

    def follow_lineage(self, version: int, token: str, prev: str) -> bool: ...

    async def check_identity(self) -> None: ...


@dataclass
class FollowerTimes:
    """The follower's pacing: the poll interval and how long to wait for Redis."""

    sync_interval_s: float
    timeout_s: float


class Follower:
    """Runs the sync loop of one store until cancelled."""

    def __init__(
        self,
        store: Followed,
        topology: Topology,
        channel: str,
        times: FollowerTimes,
        wrap_errors: Callable[[], contextlib.AbstractAsyncContextManager[None]],
        *,
        sharded: bool = False,
        tier: ReadTier | None = None,
    ) -> None:
        self._store = store
        self._topology = topology
        self._channel = channel
        self._times = times
        self._wrap_errors = wrap_errors
        #: a Cluster's change channel is a sharded one (SSUBSCRIBE): only the nodes of the
        #: shard serving its slot carry it, and they drop the subscription when the slot moves
        self._sharded = sharded
        #: the fan-out tier: subscribe and read on a replica while one keeps up
        self._tier = tier
        self._next_primary_poll = 0.0
        #: pushes applied so far (``_paced``)
        self._applied = 0
        self.resync_needed = False
        #: called after a (re)subscription on a master other than the last one (Sentinel)
        self.on_master_change: Callable[[], Awaitable[None]] | None = None
        self._last_master: tuple[str, int] | None = None

    async def _poll(self, pubsub: PubSub) -> None:
        if self._topology.sentinel:
            await self._topology.follow_master(pubsub)
        store = self._store
        # The pushes already received first: the lineage pair the poll asks about is then
        # the latest this replica can know, never one a burst of pushes took out of the
        # table's kept history while they waited here (a merge nobody needed).
        await self._drain(pubsub)
        held = store.held()  # before the poll: what is acknowledged meanwhile is newer
        reply = await store.poll()
        if store.table_lost(reply, held):
            self.resync_needed = True  # Redis lost its data (restart, flush, failover)
        elif reply.version > store.view.version:
            # Pushes for that version may still be in flight: drain them first.
            await self._drain(pubsub)
            if reply.version > store.view.version:
                self.resync_needed = True
        elif reply.version < store.view.version:
            self.resync_needed = True

    async def _poll_replica(self, pubsub: PubSub) -> None:
        """The poll while on a replica: its table must keep up with what this process
        knows of the primary's (its own writes; a poll of the primary every
        ``redis_primary_poll_s``); any sign that it lacks data sends the process to the
        primary, whose table alone decides a merge. Raises ReplicaBehind."""
        store, tier = self._store, self._tier
        assert tier is not None
        if self._topology.sentinel:
            await self._topology.follow_master(None)
            if self._topology.master_address() != self._last_master:
                raise _Resubscribe("the sentinel master moved")
        if mono_ms() >= self._next_primary_poll:
            await store.poll(primary=True)  # the primary's version, and Redis's clock
            self._next_primary_poll = mono_ms() + 1000 * tier.primary_poll_s
        await self._drain(pubsub)  # (as in ``_poll``)
        held = store.held()
        reply = await store.poll()
        if reply.version > store.view.version:
            await self._drain(pubsub)
            if reply.version > store.view.version:
                self.resync_needed = True
        tier.check_lag(reply.version, held[1])
        if reply.version >= max(tier.primary_version, held[1]) and store.table_lost(
            reply, held, primary=False
        ):
            raise ReplicaBehind("the replica's table is not the one this process holds")

    async def _drain(self, pubsub: PubSub) -> None:
        """Apply the pushes already received."""
        while (msg := await pubsub.get_message()) is not None:
            self.on_message(msg)
            await self._paced()

    async def _paced(self) -> None:
        """After each push applied: the loop given up every ``CHANGES_PER_TURN`` (a
        buffered push is read without giving it up)."""
        self._applied += 1
        if self._applied % CHANGES_PER_TURN == 0:
            await asyncio.sleep(0)

    def _count(self, pubsub: PubSub) -> None:
        """The connections held now, by use (the metric docs/deploy.md's Sizing counts):
        at each poll and after idle ones were closed, not at each push, whose cost it was
        a third of."""
        replica = self._tier.client if self._tier is not None else None
        held = self._topology.held(pubsub, replica)
        for use, count in held.items():
            metrics.REDIS_CONNECTIONS.labels(self._store.namespace, use).set(count)

    async def _learn_epoch(self) -> None:
        """Ask which table a push comes from before the view holds its data.

        A replica that synced while the table was new (no epoch yet) learns the epoch its
        first writer gave it from a poll. Until then it could not tell the table it holds
        from a new one: were Redis emptied before that poll, it would take the new table
        as its own and never re-seed what it holds. So the first push is held back until
        the epoch is known; if Redis is gone meanwhile, the push is never applied and the
        view holds nothing it could fail to re-seed.
        """
        store = self._store
        held = store.held()
        on_replica = self._tier is not None and self._tier.on_replica
        if store.table_lost(await store.poll(), held, primary=not on_replica):
            self.resync_needed = True

    def on_message(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind in ("unsubscribe", "sunsubscribe"):
            # Not asked for: a Cluster node drops its sharded subscribers when the slot
            # moves away (a resharding, a failover). Subscribe again where it lives now.
            raise StoreUnavailable("the change channel's subscription was dropped")
        if kind not in ("message", "smessage"):
            return
        change = json.loads(msg["data"])
        version, kind, field, value = int(change["v"]), change["k"], change["f"], change["x"]
        stamp = int(change.get("s") or 0)
        store = self._store
        if not store.follow_lineage(version, change.get("l") or "", change.get("p") or ""):
            # the next version, of another history: Redis was rolled back in place
            self.resync_needed = True
            return
        view = store.view
        store.saw(stamp)
        if kind == "fault":
            item = codec.decode_fault(field, value) if value else None
            view.apply_fault(field, item, version, stamp)
        elif kind == "route":
            route = codec.decode_route(field, value) if value else None
            view.apply_route(field, route, version, stamp)
        elif kind == "config":
            view.apply_config(codec.decode_config(value), version, stamp)
        elif kind == "reseed":
            # Another replica merged into a table that lost data: merge what this one holds
            # too (it may hold what the other did not).
            store.doubt("merge", field)
            self.resync_needed = True
            return
        if version == view.version + 1:
            view.version = version
        elif version > view.version + 1:
            self.resync_needed = True

    async def _wait_subscribed(self, pubsub: PubSub) -> None:
        deadline = mono_ms() + 1000 * self._times.timeout_s
        while mono_ms() < deadline:
            honour_cancel()
            msg = await pubsub.get_message(timeout=self._times.timeout_s)
            if msg is not None and msg.get("type") in ("subscribe", "ssubscribe"):
                return
        raise StoreUnavailable("no subscribe confirmation from redis")

    async def _check_master(self) -> None:
        """Sentinel: a new master may be a replica that missed the last writes."""
        master = self._topology.master_address()
        moved = self._last_master is not None and master != self._last_master
        self._last_master = master
        if moved and self.on_master_change is not None:
            await self.on_master_change()

    async def follow(self) -> None:
        """Subscribe, snapshot, then apply pushes until the connection fails."""
        interval = self._times.sync_interval_s
        store = self._store
        tier = self._tier
        await self._topology.refresh_slots()
        replica = await tier.choose() if tier is not None else None
        if replica is not None:
            pubsub, pubsub_client = replica.pubsub(), None  # (the tier closes the client)
        else:
            pubsub, pubsub_client = self._topology.open_pubsub()
        try:
            async with self._wrap_errors():
                await self._topology.find_master()
                await self._check_master()
                if self._sharded:
                    await pubsub.ssubscribe(self._channel)
                else:
                    await pubsub.subscribe(self._channel)
                # Snapshot only once Redis confirms, so no change falls between.
                await self._wait_subscribed(pubsub)
                if self._sharded and replica is None:
                    await self._topology.check_slot_master(pubsub)
                # Another Redis process than before (a restart, a failover) does not know
                # this replica's mark: the resync merges.
                await store.check_identity()
                # The resync first: it notices a lost table and merges before the journal's
                # reports land in it (their replies carry the epoch too).
                await store.resync()
                self.resync_needed = False
                if tier is not None and replica is not None:
                    tier.reading()
                await store.replay_journal()
                next_poll = mono_ms() + interval * 1000
                self._count(pubsub)
                while True:
                    honour_cancel()
                    timeout = max(0.0, (next_poll - mono_ms()) / 1000)
                    msg = await pubsub.get_message(timeout=timeout)
                    if msg is not None and msg.get("type") in ("message", "smessage"):
                        if not store.has_epoch:
                            await self._learn_epoch()
                        self.on_message(msg)
                        await self._paced()
                    elif msg is not None:
                        self.on_message(msg)  # a dropped subscription raises
                    if mono_ms() >= next_poll:
                        if replica is not None:
                            await self._poll_replica(pubsub)
                        else:
                            await self._poll(pubsub)
                        next_poll = mono_ms() + interval * 1000
                        self._count(pubsub)
                    if self.resync_needed:
                        await store.resync()
                        self.resync_needed = False
                    if store.journal_size:
                        await store.replay_journal()
                    if await self._topology.close_idle(*([replica] if replica else [])):
                        self._count(pubsub)
                    if replica is None and tier is not None and tier.may_try():
                        return  # back to a replica once the fallback has lasted retry_s
        except ReplicaBehind as exc:
            assert tier is not None
            tier.fall_back("lagging", exc.message)
        except _Resubscribe:
            pass
        except StoreUnavailable as exc:
            if tier is not None and replica is not None:
                tier.fall_back("unreachable", exc.message)
            self._topology.subscription_failed()
            raise
        finally:
            store.synced.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            if pubsub_client is not None:
                with contextlib.suppress(Exception):
                    await pubsub_client.aclose()

    async def run_forever(self) -> None:
        backoff = 0.05
        while True:
            honour_cancel()
            started = mono_ms()
            try:
                await self.follow()
            except StoreUnavailable as exc:
                metrics.STORE_ERRORS.labels("sync").inc()
                log.warning("redis sync lost: %s", exc.message)
            if mono_ms() - started > 10_000:
                backoff = 0.05  # it was healthy for a while: start the backoff over
            # Full jitter, so many replicas do not reconnect in step.
            await asyncio.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
