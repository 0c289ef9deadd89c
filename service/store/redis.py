"""The shared store: the fault table in Redis, mirrored into this replica's view by push.

Layout (all keys share the ``{namespace}`` hash tag, so one Cluster slot):

    {prefix}:{ns}:faults   hash broker -> "latencyMs,availableAt"
    {prefix}:{ns}:routes   hash topic  -> JSON [[brokerName, writeQueueNums, address], ...]
    {prefix}:{ns}:meta     hash version (bumped by every visible change),
                                config_version (version that wrote config), config (JSON)
    {prefix}:{ns}:latency-log  stream: every report (broker, latency, isolation, producer,
                           time), trimmed to about ``latency_log_max`` entries
    {prefix}:{ns}:events   stream: the event log (windows opened, extended, ended early,
                           opened by quorum), trimmed to about ``events_max`` entries
    {prefix}:{ns}:changes  pub/sub channel: one message per visible change

Writes are Lua scripts (one round trip, atomic, Redis's clock). A report that
changes no window bumps nothing and pushes nothing, so thousands of sidecar
replicas receive one message per window opened, moved or cleared. Each
replica applies pushes in version order, resyncs from a snapshot on a gap or
a reconnect, and polls the version every ``sync_interval_s`` as a safety net.

The same code runs on one server, a Redis Cluster or a Sentinel-managed master
(``service.store.connect`` reads the URL): every command names keys of the one
slot, so a cluster routes it to that slot's node; the poll reads the version and
the clock in one keyed script rather than a pipeline with the keyless TIME. The
subscription is on the slot's node in a cluster (PUBLISH reaches every node, so
after a failure the next attempt moves on to another node) and on the current
master under Sentinel (resubscribing when the master moved).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from importlib import resources
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.commands.core import AsyncScript
from redis.exceptions import RedisClusterException, RedisError

from service import metrics, policy, strategy
from service.cancelling import honour_cancel
from service.errors import StoreUnavailable, TableFull
from service.model import Config, FaultItem, Route
from service.settings import Settings
from service.store import codec
from service.store.base import Event, LogEntry, ReportIn, ReportOutcome
from service.store.connect import StoreClients, parse_redis_url
from service.store.journal import Journal
from service.store.local import report_locally
from service.view import Snapshot, TableView

log = logging.getLogger("detour.store")

_MAX_BACKOFF_S = 5.0
#: Journaled reports sent per script call on replay (the batch endpoint's cap).
_REPLAY_BATCH = 1000
#: The poll: the table version and Redis's clock in one round trip, routed by the
#: meta key (a pipeline with TIME would send the keyless TIME to any cluster node).
_POLL_LUA = """
local t = redis.call('TIME')
return {tonumber(redis.call('HGET', KEYS[1], 'version') or '0'), t[1], t[2]}
"""


_QUORUM_STATES: tuple[str | None, ...] = (None, "suspected", "reached")
_PROBE_STATES: tuple[str | None, ...] = (None, "passed", "failed")


def _policy_arg(config: Config, events_max: int = 0) -> str:
    """report.lua's ARGV[6] (codec.REPORT_POLICY): the policy knobs the script applies."""
    return codec.encode_report_policy(
        config,
        {
            "keep_ms": max(config.quorum_window_ms, strategy.report_duration(config, 0, True)),
            "jitter_scale": policy.JITTER_SCALE,
            "max_suspects": policy.MAX_SUSPECTS,
            "max_isolations": policy.MAX_ISOLATIONS,
            "event_log_cap": events_max,
        },
    )


def _load_lua(name: str) -> str:
    return (resources.files("service.store") / "lua" / f"{name}.lua").read_text()


def _mono_ms() -> float:
    return time.monotonic_ns() / 1_000_000


@contextlib.asynccontextmanager
async def _wrap_errors() -> AsyncIterator[None]:
    """Callers handle one error type whatever went wrong on the wire."""
    try:
        yield
    except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
        raise StoreUnavailable(f"redis: {exc.__class__.__name__}: {exc}") from exc


class RedisStore:
    kind = "redis"

    def __init__(self, settings: Settings, namespace: str | None = None) -> None:
        assert settings.redis_url
        self._settings = settings
        self.namespace = namespace or settings.namespace
        base = f"{settings.redis_prefix}:{{{self.namespace}}}"
        self._faults, self._routes, self._meta = f"{base}:faults", f"{base}:routes", f"{base}:meta"
        self._channel = f"{base}:changes"
        self._log = f"{base}:latency-log"
        self._log_max = settings.latency_log_max
        self._events = f"{base}:events"
        self._lease = f"{base}:detector"
        self._replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._events_max = settings.events_max
        # Reports are on the producers' send path: they get their own connections
        # (``fast``) with a short timeout, and fall back to the journal when it passes.
        self._conn = StoreClients(
            parse_redis_url(settings.redis_url),
            settings.redis_timeout_s,
            settings.redis_call_timeout_s,
        )
        self._client = self._conn.main
        self._scripts: dict[str, AsyncScript] = {
            name: self._client.register_script(_load_lua(name))
            for name in ("report", "set_entry", "snapshot", "fault_items", "reach", "lease")
        }
        self._poll_script = self._client.register_script(_POLL_LUA)
        self._fast = self._conn.fast
        self._fast_report = self._fast.register_script(self._scripts["report"].script)
        #: Cluster only: how many subscriptions failed, so the next one tries another node.
        self._pubsub_turn = 0
        self._journal = Journal(settings.journal_max)
        # Until the first sync, the local wall clock stands in for Redis's.
        self._offset_ms = time.time_ns() / 1_000_000 - _mono_ms()
        self.view = TableView(lambda: int(_mono_ms() + self._offset_ms), self.namespace)
        self.synced = asyncio.Event()
        self._ever_synced = False
        self._resync_needed = False
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        """Load the scripts and take a first snapshot; keep syncing in the background.

        An unreachable Redis does not stop the process: the background task
        retries with backoff and /readyz reports not ready meanwhile.
        """
        try:
            async with _wrap_errors():
                for script in (*self._scripts.values(), self._poll_script):
                    await self._client.script_load(script.script)
                await self._resync()
        except StoreUnavailable as exc:
            log.warning("redis not reachable at start, will retry: %s", exc.message)
        self._task = asyncio.create_task(self._sync_forever(), name="detour-redis-sync")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._journal:
            # Graceful stop: one bounded attempt to hand the journal to Redis.
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                async with asyncio.timeout(self._settings.redis_timeout_s * 2):
                    await self._replay_journal()
            if self._journal:
                log.warning("stopping with %d journaled reports not in redis", len(self._journal))
        await self._conn.aclose()

    @property
    def degraded(self) -> bool:
        """Redis is not answering, or reports taken meanwhile are not replayed yet."""
        return not self.synced.is_set() or bool(self._journal)

    @property
    def journal_size(self) -> int:
        return len(self._journal)

    async def ping(self) -> None:
        """Ready once a table was ever synced: afterwards an outage degrades, not stops."""
        if not self._ever_synced:
            raise StoreUnavailable("no table synced from redis yet")

    # -- writes ------------------------------------------------------------
    async def _eval(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        script: AsyncScript | None = None,
    ) -> Any:
        start = time.perf_counter()
        try:
            async with _wrap_errors():
                run = script or self._scripts[name]
                return await run(keys=list(keys), args=list(args))
        except StoreUnavailable:
            metrics.STORE_ERRORS.labels(name).inc()
            raise
        finally:
            metrics.STORE_ROUNDTRIP.labels(name).observe(time.perf_counter() - start)

    async def report_many(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        """One atomic script; when Redis does not answer in time, the journal takes them.

        While the journal holds reports, new ones queue behind them so Redis
        receives every report in the order this replica accepted it.
        """
        if not self._journal and self.synced.is_set():
            try:
                return await self._report_remote(reports, self._fast_report)
            except StoreUnavailable as exc:
                log.warning("report falls back to the journal: %s", exc.message)
        return self._report_locally(reports)

    def _report_locally(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        """Apply to this replica's view at once and journal for replay."""
        now = self.view.now_ms()
        new = {r.broker_name for r in reports} - self.view.faults.keys()
        if new and len(self.view.faults) + len(new) > self._settings.max_brokers:
            # No eviction here: dropping items is Redis's call once it is back.
            raise TableFull(self.namespace, self._settings.max_brokers)
        received = _mono_ms()
        out = []
        for r in reports:
            self._journal.append(r, received)
            out.append(report_locally(self.view, r, now, self.view.set_local_fault, True))
            self.view.observe_latency(r.broker_name, r.latency_ms, now)
        return out

    async def _replay_journal(self) -> None:
        """Hand journaled reports to Redis in order, each dated from when it was accepted."""
        while self._journal:
            batch = self._journal.take(_REPLAY_BATCH, _mono_ms())
            if batch:
                try:
                    await self._report_remote(batch)
                except TableFull:
                    # The table filled while Redis was away: keep what still fits.
                    await self._replay_one_by_one(batch)
            self._journal.drop(len(batch))
            metrics.JOURNAL_REPLAYED.inc(len(batch))

    async def _replay_one_by_one(self, batch: Sequence[ReportIn]) -> None:
        for report in batch:
            try:
                await self._report_remote([report])
            except TableFull:
                metrics.JOURNAL_DROPPED.labels("table_full").inc()

    async def _report_remote(
        self, reports: Sequence[ReportIn], script: AsyncScript | None = None
    ) -> list[ReportOutcome]:
        view = self.view
        for _ in range(3):
            config, config_version = view.config, view.config_version
            enabled = config.send_latency_fault_enable
            rule = ("overwrite" if config.last_report_wins else "extend") if enabled else "off"
            tiers = [
                strategy.tier(config, r.latency_ms, r.isolation) if enabled else None
                for r in reports
            ]
            durations = [0 if t is None else config.not_available_duration[t] for t in tiers]
            args: list[str | int] = [
                config_version,
                rule,
                self._channel,
                self._log_max,
                self._settings.max_brokers,
                _policy_arg(config, self._events_max),
            ]
            for r, d, t in zip(reports, durations, tiers, strict=True):
                args += [
                    r.broker_name,
                    r.latency_ms,
                    d,
                    r.age_ms,
                    int(r.isolation),
                    r.producer,
                    int(policy.counts_toward_quorum(config, r.isolation, r.origin)),
                    random.randrange(policy.JITTER_SCALE) if config.jitter_percent else 0,
                    "" if t is None else config.latency_max[t],
                    r.voter_id,
                ]
            keys = (self._faults, self._meta, self._log, self._events)
            reply = await self._eval("report", keys, args, script)
            if reply[0] == -1:
                # Another replica changed the config and its push has not
                # arrived yet: take the table as it is now and recompute.
                await self._resync()
                continue
            extra = reply[5]
            if extra:
                metrics.EVICTED.labels(self.namespace).inc(int(extra))
            if reply[0] == -2:
                raise TableFull(self.namespace, self._settings.max_brokers)
            _, now, ends, versions, changes, _, quorums, asked, values, probes = reply
            out = []
            for r, t, d, end, version, change, q, value, probe in zip(
                reports,
                tiers,
                asked,
                ends,
                versions,
                changes,
                quorums,
                values,
                probes,
                strict=True,
            ):
                if version:
                    view.apply_fault(
                        r.broker_name, codec.decode_fault(r.broker_name, value), version
                    )
                out.append(
                    ReportOutcome(
                        r.broker_name,
                        r.latency_ms,
                        int(d),
                        int(end),
                        int(now),
                        r.isolation,
                        None if t is None else config.latency_max[t],
                        strategy.WindowChange(int(change)),
                        quorum=_QUORUM_STATES[int(q)],
                        probe=_PROBE_STATES[int(probe)],
                    )
                )
                view.observe_latency(r.broker_name, r.latency_ms, int(now))
            return out
        raise StoreUnavailable("config kept changing during the report; retry")

    async def latency_log(self, after: str | None, limit: int) -> list[LogEntry]:
        async with _wrap_errors():
            rows: list[tuple[str, dict[str, str]]] = await self._client.xrange(
                self._log, min=f"({after}" if after else "-", max="+", count=limit
            )  # type: ignore[assignment]
        return [
            LogEntry(entry_id, f["b"], int(f["l"]), f["i"] == "1", f["p"], int(f["t"]))
            for entry_id, f in rows
        ]

    async def events(self, since: str | None, limit: int, latest: bool = False) -> list[Event]:
        rows: list[tuple[str, dict[str, str]]]
        async with _wrap_errors():
            if latest:
                newest = await self._client.xrevrange(self._events, count=limit)
                rows = list(reversed(newest))  # type: ignore[arg-type]
            else:
                rows = await self._client.xrange(
                    self._events, min=f"({since}" if since else "-", max="+", count=limit
                )  # type: ignore[assignment]
        return [
            Event(
                entry_id,
                f["k"],
                f["r"],
                f["b"],
                int(f["t"]) if f["t"] else None,
                int(f["n"]),
                int(f["e"]),
                int(f["a"]),
            )
            for entry_id, f in rows
        ]

    async def _set_entry(
        self, key: str, kind: str, field: str, value: str, events: bool = False
    ) -> int:
        keys = (key, self._meta, self._events) if events else (key, self._meta)
        args = (self._channel, kind, field, value, *((self._events_max,) if events else ()))
        version = await self._eval("set_entry", keys, args)
        return int(version)

    async def detector_lease(self, ttl_ms: int) -> bool:
        """One replica per namespace runs the detector: a lease it renews each round."""
        held = await self._eval("lease", (self._lease,), (self._replica_id, ttl_ms))
        return int(held) == 1

    async def set_reachability(self, readings: Mapping[str, bool]) -> None:
        args: list[str | int] = [self._channel]
        for broker, reachable in readings.items():
            args += [broker, int(reachable)]
        changed = await self._eval("reach", (self._faults, self._meta), args)
        for broker, version, value in changed:
            self.view.apply_fault(broker, codec.decode_fault(broker, value), int(version))

    async def delete_fault(self, broker: str) -> bool:
        item = self.view.faults.get(broker)
        version = await self._set_entry(self._faults, "fault", broker, "", events=True)
        if version and item is not None and item.available_at > self.view.now_ms():
            metrics.EVENTS.labels(self.namespace, "ended", "operator").inc()
        if version:
            self.view.apply_fault(broker, None, version)
        return version > 0

    async def put_route(self, route: Route) -> None:
        encoded = codec.encode_route(route)
        version = await self._set_entry(self._routes, "route", route.topic, encoded)
        self.view.apply_route(route.topic, route, version)

    async def delete_route(self, topic: str) -> bool:
        version = await self._set_entry(self._routes, "route", topic, "")
        if version:
            self.view.apply_route(topic, None, version)
        return version > 0

    async def put_config(self, config: Config) -> None:
        version = await self._set_entry(self._meta, "config", "config", codec.encode_config(config))
        self.view.apply_config(config, version)

    # -- reads -------------------------------------------------------------
    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        now, flat = await self._eval("fault_items", (self._faults,), ())
        return int(now), [codec.decode_fault(b, v) for b, v in codec.pairs(flat)]

    # -- sync --------------------------------------------------------------
    async def _snapshot(self) -> Snapshot:
        version, config_version, config, now, faults, routes = await self._eval(
            "snapshot", (self._faults, self._routes, self._meta), ()
        )
        self._set_clock(int(now), _mono_ms())
        return Snapshot(
            version=int(version),
            config=codec.decode_config(config),
            config_version=int(config_version),
            routes={t: codec.decode_route(t, r) for t, r in codec.pairs(routes)},
            faults={b: codec.decode_fault(b, v) for b, v in codec.pairs(faults)},
        )

    async def _resync(self) -> None:
        snap = await self._snapshot()
        lost = snap.version < self.view.version
        if lost:
            snap = await self._reseed(snap)
        self.view.replace(snap, reset=lost)
        self._resync_needed = False
        self.synced.set()
        self._ever_synced = True
        metrics.RESYNCS.inc()

    async def _reseed(self, snap: Snapshot) -> Snapshot:
        """Redis lost its data (a restart without persistence, a flush): write back the
        config and routes this replica holds, so producers keep their routes.

        Every replica that notices does the same; the writes carry the same
        content, so the outcome does not depend on which one wins.
        """
        view = self.view
        log.warning(
            "redis table is older than this replica's (version %d < %d): re-seeding",
            snap.version,
            view.version,
        )
        metrics.RESEEDS.inc()
        if view.config_version > 0 and snap.config_version == 0:
            await self._set_entry(self._meta, "config", "config", codec.encode_config(view.config))
        for topic, route in view.routes.items():
            if topic not in snap.routes:
                await self._set_entry(self._routes, "route", topic, codec.encode_route(route))
        return await self._snapshot()

    def _set_clock(self, redis_now_ms: int, received_ms: float) -> None:
        """Track Redis time against the local monotonic clock, erring early.

        Redis read its clock somewhere during the round trip; pinning it to the
        moment the reply was ``received`` makes this replica's estimate of Redis time a lower
        bound, so it may see a window end up to one round trip late, never early:
        a sick broker is avoided a little longer rather than retried too soon.
        """
        self._offset_ms = redis_now_ms - received_ms

    async def _poll(self, pubsub: PubSub) -> None:
        if self._conn.sentinel is not None:
            await self._follow_master(pubsub)
        raw_version, sec, usec = await self._poll_script(keys=[self._meta])
        self._set_clock(int(sec) * 1000 + int(usec) // 1000, _mono_ms())
        if int(raw_version or 0) > self.view.version:
            # Pushes for that version may still be in flight: drain them first.
            while (msg := await pubsub.get_message(ignore_subscribe_messages=True)) is not None:
                self._on_message(msg)
            if int(raw_version or 0) > self.view.version:
                self._resync_needed = True
        elif int(raw_version or 0) < self.view.version:
            self._resync_needed = True  # Redis lost its data (restart, flush)

    def _on_message(self, msg: dict[str, Any]) -> None:
        if msg.get("type") != "message":
            return
        change = json.loads(msg["data"])
        version, kind, field, value = int(change["v"]), change["k"], change["f"], change["x"]
        view = self.view
        if kind == "fault":
            view.apply_fault(field, codec.decode_fault(field, value) if value else None, version)
        elif kind == "route":
            view.apply_route(field, codec.decode_route(field, value) if value else None, version)
        elif kind == "config":
            view.apply_config(codec.decode_config(value), version)
        if version == view.version + 1:
            view.version = version
        elif version > view.version + 1:
            self._resync_needed = True

    async def _wait_subscribed(self, pubsub: PubSub) -> None:
        deadline = _mono_ms() + 1000 * self._settings.redis_timeout_s
        while _mono_ms() < deadline:
            honour_cancel()
            msg = await pubsub.get_message(timeout=self._settings.redis_timeout_s)
            if msg is not None and msg.get("type") == "subscribe":
                return
        raise StoreUnavailable("no subscribe confirmation from redis")

    async def _find_master(self) -> None:
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
            async with asyncio.timeout(self._settings.redis_timeout_s):
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

    async def _follow_master(self, pubsub: PubSub) -> None:
        """Sentinel: move to a new master as soon as the sentinels name one.

        Connections to the old master keep working after a switchover
        (``SENTINEL FAILOVER``) until the sentinels reconfigure it, about ten
        seconds later: writes it accepts meanwhile are lost when it becomes a
        replica. Asking every poll bounds that to one ``sync_interval_s``.
        """
        said = await self._sentinel_says()
        if said is not None and any(
            pool.master_address not in (None, said) for pool in self._conn.sentinel_pools()
        ):
            await self._find_master()  # the full check (the master is up) before moving
        if self._master_moved(pubsub):
            raise StoreUnavailable("the sentinel master moved: subscribing on the new one")

    def _master_moved(self, pubsub: PubSub) -> bool:
        """Sentinel: the subscription is on a server that is no longer the master.

        A pool learns of a failover when it makes a connection (a report that
        found its master gone or read-only, say). A subscription still open on a
        demoted master would keep receiving pushes by replication, but only as
        long as that server lives and replicates: it moves to the new master.
        """
        conn = pubsub.connection
        if conn is None:
            return False
        return any(
            pool.master_address not in (None, (conn.host, conn.port))
            for pool in self._conn.sentinel_pools()
        )

    def _pubsub_nodes(self, cluster: RedisCluster) -> list[tuple[str, int]]:
        """Cluster nodes to subscribe on: the namespace slot's node first.

        Any node would do (a cluster delivers PUBLISH to every node), but the
        slot's node is the one this replica depends on anyway: subscribing
        there adds no node whose failure interrupts the pushes.
        """
        nodes: list[tuple[str, int]] = []
        with contextlib.suppress(RedisClusterException, RedisError, KeyError):
            owner = cluster.get_node_from_key(self._meta)
            if owner is not None:
                nodes.append((owner.host, int(owner.port)))
        nodes += [(n.host, int(n.port)) for n in cluster.get_nodes()]
        nodes += self._conn.target.hosts
        return list(dict.fromkeys(nodes))

    def _open_pubsub(self) -> tuple[PubSub, Redis | None]:
        """A pub/sub connection for the changes channel, and the client to close with it."""
        if isinstance(self._client, RedisCluster):
            nodes = self._pubsub_nodes(self._client)
            host, port = nodes[self._pubsub_turn % len(nodes)]
            node = self._conn.node_client(host, port)
            return node.pubsub(), node
        return self._client.pubsub(), None

    async def _follow(self) -> None:
        """Subscribe, snapshot, then apply pushes until the connection fails."""
        interval = self._settings.sync_interval_s
        pubsub, pubsub_client = self._open_pubsub()
        try:
            async with _wrap_errors():
                await self._find_master()
                await pubsub.subscribe(self._channel)
                # Snapshot only once Redis confirms, so no change falls between.
                await self._wait_subscribed(pubsub)
                await self._replay_journal()
                await self._resync()
                next_poll = _mono_ms() + interval * 1000
                while True:
                    honour_cancel()
                    timeout = max(0.0, (next_poll - _mono_ms()) / 1000)
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
                    if msg is not None:
                        self._on_message(msg)
                    if _mono_ms() >= next_poll:
                        await self._poll(pubsub)
                        next_poll = _mono_ms() + interval * 1000
                    if self._resync_needed:
                        await self._resync()
                    if self._journal:
                        await self._replay_journal()
        except StoreUnavailable:
            self._pubsub_turn += 1
            raise
        finally:
            self.synced.clear()
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            if pubsub_client is not None:
                with contextlib.suppress(Exception):
                    await pubsub_client.aclose()

    async def _sync_forever(self) -> None:
        backoff = 0.05
        while True:
            honour_cancel()
            started = _mono_ms()
            try:
                await self._follow()
            except StoreUnavailable as exc:
                metrics.STORE_ERRORS.labels("sync").inc()
                log.warning("redis sync lost: %s", exc.message)
            if _mono_ms() - started > 10_000:
                backoff = 0.05  # it was healthy for a while: start the backoff over
            # Full jitter, so many replicas do not reconnect in step.
            await asyncio.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
