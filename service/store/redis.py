"""The shared store: the fault table in Redis, mirrored into this replica's view by push.

Layout (all keys share the ``{namespace}`` hash tag, so one Cluster slot):

    {prefix}:{ns}:faults   hash broker -> item ("stamp@latencyMs,availableAt,...",
                           service/store/lua/lib/item.lua); and "~epoch" -> the table's
                           epoch, as in routes and graves (lib/item.lua ``table_epoch``)
    {prefix}:{ns}:routes   hash topic  -> "stamp|" + JSON [[brokerName, writeQueueNums,
                           address], ...]
    {prefix}:{ns}:meta     hash version (bumped by every visible change), hlc (the last
                           stamp given), config (JSON), config_stamp, epoch (a random id the
                           table got when it was first written), "l:<version>" the lineage
                           token of each of the last 1,024 versions (lua/lib/item.lua)
    {prefix}:{ns}:graves   hash "r#topic" / "f#broker" -> the stamp of its delete, and
    {prefix}:{ns}:graves-by-time  sorted set of the same by time (kept 7 days, 65,536 most)
    {prefix}:{ns}:ends     sorted set broker -> availableAt: the eviction index
    {prefix}:{ns}:writers  hash replica -> sequence high-water mark, and replica|gaps
    {prefix}:{ns}:writers-seen  sorted set replica -> last write ms (bounds the writers)
    {prefix}:{ns}:ids      hash "scope#reportId" -> first seen, fingerprint, first answer
    {prefix}:{ns}:ids-index  sorted set of "scope#ms#reportId" (each scope's oldest first)
    {prefix}:{ns}:ids-forgotten  hash scope -> the newest first sighting of an id it dropped
    {prefix}:{ns}:latency-log  stream: reports and summaries (trimmed, ``latency_log_max``)
    {prefix}:{ns}:events   stream: the event log (trimmed, ``events_max``)
    {prefix}:{ns}:changes  pub/sub channel: one message per visible change

Writes are Lua scripts (one round trip, atomic, Redis's clock), each write stamped by a
hybrid logical clock. A report that changes no window bumps nothing and pushes nothing.
This module holds the commands and the decision to merge; ``follower`` keeps the view
current, ``merge`` says what a merge sends, ``topology`` knows Sentinel and Cluster,
``journal`` holds and replays reports taken while Redis did not answer, ``replies`` names
the scripts' reply fields.

Integrity (docs/reliability.md): Redis is the meeting point, not the only copy. Every
replica holds the table; when there is any sign that Redis lost or rolled back data (the
server under a reconnection lost this replica's mark, the table's epoch is gone or another,
a hash of the table lacks the epoch's mark (``~epoch``: Redis dropped it whole),
this replica's acknowledged sequence numbers, the table's version or its last stamp went
back, the table's history no longer holds the lineage pair this replica reached (a rollback
in place that later writes took past this replica's version), a config older than this
replica's, a Sentinel master change, another replica's merge), the replica merges what it
holds into the table by detour.merge's rules, which only ever move the table forward. Before
an operator write it runs these checks itself (``confirm``). Reports carry this replica's
sequence number and the producer's id, so a replayed or retried one is applied once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from detour import policy, strategy
from detour.clock import mono_ms
from detour.model import MAX_REPORT_AGE_MS, Config, FaultItem, Route
from detour.profiles import PROFILES
from detour.view import Graves, Snapshot, TableView
from service import metrics
from service.errors import ReportIdReused, StoreUnavailable, TableFull
from service.store import codec, scripts
from service.store.aggregate import Summary
from service.store.base import (
    REPORT_ID_CAP,
    REPORT_ID_MARGIN_MS,
    REPORT_ID_WINDOW_MS,
    Event,
    LogEntry,
    ReportIn,
    ReportOutcome,
)
from service.store.connect import StoreClients, parse_redis_url
from service.store.follower import Follower, FollowerTimes, RedisClock
from service.store.journal import Journal, replay
from service.store.kept import Kept, summary_args
from service.store.local import apply_locally, outcome
from service.store.merge import Candidates, calls, candidates
from service.store.options import StoreOptions
from service.store.reads import ReadTier, ReplicaBehind
from service.store.replies import (
    ID_REUSED,
    STALE_CONFIG,
    TABLE_FULL,
    TABLE_LOST,
    PollReply,
    ReportReply,
    ReseedReply,
    SnapshotReply,
)
from service.store.topology import Topology

log = logging.getLogger("detour.store")

_QUORUM_STATES: tuple[str | None, ...] = (None, "suspected", "reached")
_PROBE_STATES: tuple[str | None, ...] = (None, "passed", "failed")

#: Gaps (sequence numbers below the high-water mark not applied yet: a call that failed or
#: is still in flight) report.lua keeps per writer; an older gap counts as applied. A
#: replica's calls in flight at once stay far below it.
SEQ_WINDOW = 256
#: Summaries per flush call (Lua's unpack takes at most about 8,000 values; a call stays
#: short): a namespace of 10,000 brokers flushes in ten calls.
#: Writers remembered: a replica silent longer than a journal keeps a report is forgotten.
WRITER_CAP = 10_000


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


def _vote(config: Config, report: ReportIn, duration_ms: int) -> int:
    """report.lua's quorum value for a report: 1 a failure that waits for the isolation
    quorum, 2 a slow answer that waits for the latency quorum, 3 an in-flight signal, 0 none
    of these."""
    if report.pending:
        return 3
    if policy.counts_toward_quorum(config, report.isolation, report.origin):
        return 1
    if policy.counts_toward_latency_quorum(config, report.isolation, duration_ms, report.origin):
        return 2
    return 0


def integrity_arg(acked: int) -> str:
    """report.lua's ARGV[9]: what the writer saw applied, and the bounds of the identities."""
    return ",".join(
        str(x)
        for x in (
            acked,
            SEQ_WINDOW,
            REPORT_ID_WINDOW_MS,
            REPORT_ID_CAP,
            MAX_REPORT_AGE_MS,
            WRITER_CAP,
            REPORT_ID_MARGIN_MS,
        )
    )


@contextlib.asynccontextmanager
async def _wrap_errors() -> AsyncIterator[None]:
    """Callers handle one error type whatever went wrong on the wire."""
    try:
        yield
    except (TimeoutError, RedisError, RedisClusterException, OSError) as exc:
        raise StoreUnavailable(f"redis: {exc.__class__.__name__}: {exc}") from exc


def _log_entry(entry_id: str, f: Mapping[str, str]) -> LogEntry:
    """A latency-log entry: one report, or one replica's histogram of quiet reports."""
    if "h" in f:
        counts = tuple(int(c) for c in f["h"].split(",") if c)
        return LogEntry(entry_id, f["b"], -1, False, f["p"], int(f["t"]), counts, int(f["s"]))
    return LogEntry(entry_id, f["b"], int(f["l"]), f["i"] == "1", f["p"], int(f["t"]))


class ConfigChanged(StoreUnavailable):
    """The config changed between reading it and writing a change made on it (another
    replica's write): nothing was written; the caller reads it again and retries."""

    def __init__(self, stamp: int) -> None:
        super().__init__(f"the config changed meanwhile (stamp {stamp}); retry")
        self.stamp = stamp


class RedisStore:
    kind = "redis"

    def __init__(self, options: StoreOptions | object, namespace: str | None = None) -> None:
        settings = StoreOptions.of(options)
        assert settings.redis_url
        self._settings = settings
        self.namespace = namespace or settings.namespace
        base = f"{settings.redis_prefix}:{{{self.namespace}}}"
        self._faults, self._routes, self._meta = f"{base}:faults", f"{base}:routes", f"{base}:meta"
        self._channel = f"{base}:changes"
        #: the channel as the scripts take it: a Cluster's is sharded (SPUBLISH, Redis 7)
        self._sharded = parse_redis_url(settings.redis_url).mode == "cluster"
        self._push_channel = scripts.channel_arg(self._channel, sharded=self._sharded)
        self._log = f"{base}:latency-log"
        self._log_max = settings.latency_log_max
        self._events = f"{base}:events"
        self._lease = f"{base}:detector"
        self._ends = f"{base}:ends"
        self._writers = f"{base}:writers"
        self._writers_seen = f"{base}:writers-seen"
        self._ids, self._ids_index = f"{base}:ids", f"{base}:ids-index"
        self._ids_forgotten = f"{base}:ids-forgotten"
        self._graves, self._graves_index = f"{base}:graves", f"{base}:graves-by-time"
        self._replica_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._events_max = settings.events_max
        # Reports are on the producers' send path: they get their own connections
        # (``fast``) with a short timeout, and fall back to the journal when it passes.
        self._conn = StoreClients(
            parse_redis_url(settings.redis_url),
            settings.redis_timeout_s,
            settings.redis_call_timeout_s,
            settings.redis_max_connections,
            settings.redis_idle_close_s,
        )
        self._client = self._conn.main
        self._scripts: dict[str, AsyncScript] = {
            name: self._client.register_script(scripts.source(name)) for name in scripts.NAMES
        }
        self._fast = self._conn.fast
        self._fast_report = self._fast.register_script(self._scripts["report"].script)
        self._journal = Journal(settings.journal_max)
        self._clock = RedisClock()
        self.view = TableView(self._clock.now_ms, self.namespace, PROFILES[settings.profile])
        self.synced = asyncio.Event()
        self._ever_synced = False
        #: the epoch of the table this replica's view is a copy of ("" until it has one: a
        #: new table gets one with its first write, so an untouched namespace stays empty)
        self._epoch = ""
        self._candidate = uuid.uuid4().hex
        #: this replica's last sequence number given, and the highest Redis confirmed applied
        #: in the table as it is now (after a merge: what the table still has)
        self._seq = 0
        self._acked = 0
        #: the highest stamp this replica saw the table give: the floor of its writes' stamps
        #: (a hybrid logical clock), and a table whose last stamp is below it lost writes
        self._seen_stamp = 0
        #: the lineage pair (version, token) this replica's view reached (lib/item.lua): a
        #: table whose history does not hold it is not the one this replica holds (a
        #: rollback in place, which versions, stamps and the epoch recover from by themselves)
        self._lineage: tuple[int, str] = (0, "")
        #: this replica's mark in the Redis process it talks to, and whether it was ever set
        self._marker = self._client.register_script(scripts.marker(self._replica_id))
        self._marked = False
        #: why the next resync merges whatever it finds (a sign of a discontinuity that the
        #: table itself may not show: another process at the address, a Sentinel master
        #: change, another replica's merge), None when there is none
        self._doubt: str | None = None
        #: a merge is under way: the table in Redis may lack what this replica holds
        self._recovering = False
        #: one resync at a time (``resync``): each reads and sets the replica's epoch,
        #: lineage and acknowledgements, and raises and lowers ``_recovering``
        self._resync_lock = asyncio.Lock()
        #: resyncs begun, and the count when the last one that ended well began
        self._resyncs_begun = 0
        self._resynced = 0
        self._topology = Topology(self._conn, settings.redis_timeout_s, self._meta)
        #: the fan-out tier: the replica the follower reads from (writes stay on the primary)
        self._tier = ReadTier(
            self._conn,
            settings.redis_replicas,
            self.namespace,
            max_lag_s=settings.redis_replica_max_lag_s,
            primary_poll_s=settings.redis_primary_poll_s,
            retry_s=settings.redis_replica_retry_s,
        )
        self._follower = Follower(
            self,
            self._topology,
            self._channel,
            FollowerTimes(settings.sync_interval_s, settings.redis_timeout_s),
            _wrap_errors,
            sharded=self._sharded,
            tier=self._tier,
        )
        self._follower.on_master_change = self._master_changed
        self._task: asyncio.Task[None] | None = None
        #: reports kept local (policy.quiet), summed until the next flush; the summaries of
        #: a flush that did not answer, kept with their sequence numbers for the retry
        self._flush_ms = settings.report_flush_ms
        self._kept = Kept(settings.max_brokers, settings.journal_max)
        self._flusher: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------
    async def start(self) -> None:
        """Load the scripts and take a first snapshot; keep syncing in the background.

        An unreachable Redis does not stop the process: the background task
        retries with backoff and /readyz reports not ready meanwhile.
        """
        try:
            async with _wrap_errors():
                for script in self._scripts.values():
                    await self._client.script_load(script.script)
                await self.check_identity()
                await self.resync()
        except StoreUnavailable as exc:
            log.warning("redis not reachable at start, will retry: %s", exc.message)
        self._task = asyncio.create_task(self._follower.run_forever(), name="detour-redis-sync")
        if self._flush_ms > 0:
            self._flusher = asyncio.create_task(self._flush_forever(), name="detour-flush")

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        # Graceful stop: one bounded attempt to write what was kept local.
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self._settings.redis_timeout_s * 2):
                await self.flush_reports()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._journal:
            # Graceful stop: one bounded attempt to hand the journal to Redis.
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                async with asyncio.timeout(self._settings.redis_timeout_s * 2):
                    await self.replay_journal()
            if self._journal:
                log.warning("stopping with %d journaled reports not in redis", len(self._journal))
        await self._tier.close()
        await self._conn.aclose()

    @property
    def degraded(self) -> bool:
        """Redis is not answering, a merge is under way, or reports taken meanwhile are not
        replayed yet."""
        return not self.synced.is_set() or self._recovering or bool(self._journal)

    @property
    def has_epoch(self) -> bool:
        """Whether this replica knows which table (epoch) its view is a copy of."""
        return bool(self._epoch)

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
        client: Redis | None = None,
    ) -> Any:
        """Run a script on the primary, or on ``client`` (a replica: read-only scripts)."""
        start = time.perf_counter()
        try:
            async with _wrap_errors():
                run = script or self._scripts[name]
                return await run(keys=list(keys), args=list(args), client=client)
        except StoreUnavailable:
            metrics.STORE_ERRORS.labels(name).inc()
            raise
        finally:
            metrics.STORE_ROUNDTRIP.labels(name).observe(time.perf_counter() - start)

    def _epoch_arg(self) -> str:
        """The epoch the scripts check: the one held, or "+candidate" before there is one."""
        return self._epoch or f"+{self._candidate}"

    def _wrote(self) -> None:
        """A script accepted the epoch argument: a table that had none now has the candidate."""
        if not self._epoch:
            self._epoch = self._candidate

    def saw(self, stamp: int) -> None:
        """The table gave ``stamp`` (a reply, a push): the floor of this replica's writes."""
        if stamp > self._seen_stamp:
            self._seen_stamp = stamp

    def _number(self, reports: Sequence[ReportIn]) -> list[ReportIn]:
        """Give each report this replica's next sequence number: its identity for replay."""
        out = []
        for r in reports:
            if r.seq == 0:
                self._seq += 1
                r = replace(r, seq=self._seq)
            out.append(r)
        return out

    async def report_many(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        """One atomic script; when Redis does not answer in time, the journal takes them.

        While the journal holds reports, new ones queue behind them so Redis
        receives every report in the order this replica accepted it.

        Each report is dated once, here, on the table's clock as this replica knows it (a
        lower bound of Redis's, ``RedisClock``): Redis running the call late, the answer
        made from the copy when its reply is late, and the journal's replay all open the
        window from that date, so what the producer was answered is what every copy holds.
        """
        accepted = self.view.now_ms()
        reports = [r.dated(accepted) for r in reports]
        if not self._journal and self.synced.is_set() and not self._recovering:
            kept = self._kept.keep(self.view, reports, accepted) if self._flush_ms > 0 else {}
            # A retry of a report this replica answered is answered here, as the first time,
            # before Redis is asked: Redis's memory of ids is lost with its data (a flush, a
            # restart from an older copy: a merge does not carry ids), this replica's is not.
            ids = self._kept.ids
            done = ids.sort(
                [r for i, r in enumerate(reports) if i not in kept], accepted, self.view.window_end
            )
            if done.duplicates:
                metrics.DUPLICATE_REPORTS.inc(done.duplicates)
            if done.expired:
                metrics.EXPIRED_REPORTS.inc(done.expired)
            for i, first in enumerate(done.out):
                if first is not None and first.degraded:
                    # first answered from the journal, which is empty now: it is in Redis
                    done.out[i] = replace(first, degraded=False)
            sent = self._number([r for _, r in done.fresh])
            answers: list[ReportOutcome] = []
            if sent:
                try:
                    answers = await self._report_remote(sent, self._fast_report)
                except StoreUnavailable as exc:
                    log.warning("report falls back to the journal: %s", exc.message)
                    answers = self._report_locally(sent)
                else:
                    now = self.view.now_ms()
                    for r in sent:
                        self._kept.written(r.broker_name, r.at(now))
            outcomes = iter(ids.settle(done, answers, self.view.now_ms()))
            return [kept[i] if i in kept else next(outcomes) for i in range(len(reports))]
        return self._report_locally(self._number(reports))

    def report_now(self, reports: Sequence[ReportIn]) -> list[ReportOutcome] | None:
        """A single report this replica keeps local (service/store/kept.py): answered without a
        round trip. Anything else (a window to write, a batch, the journal in use) is
        None, with nothing changed, and goes through ``report_many``."""
        if (
            len(reports) != 1
            or self._flush_ms <= 0
            or self._journal
            or self._recovering
            or not self.synced.is_set()
        ):
            return None
        r = reports[0]
        view = self.view
        now = view.now_ms()
        old = view.faults.get(r.broker_name)
        if not self._kept.has_room(r.broker_name, r.producer) or not policy.quiet(
            old, r.latency_ms, r.isolation, r.at(now), view.config, r.pending
        ):
            return None
        # Quiet with room (or a duplicate): kept, at the same ``now``.
        return [self._kept.keep(view, reports, now)[0]]

    async def _flush_forever(self) -> None:
        """Write the reports kept local every ``report_flush_ms`` (a bounded staleness)."""
        while True:
            await asyncio.sleep(self._flush_ms / 1000)
            try:
                await self.flush_reports()
            except StoreUnavailable as exc:
                log.warning("flush of local reports failed, retried next interval: %s", exc)

    async def flush_reports(self) -> None:
        """Write the summaries of the reports kept local (service/store/kept.py), in calls of
        ``FLUSH_CHUNK``; while Redis does not answer they wait, numbered, at most
        ``journal_max`` of them."""
        self._kept.number(self._next_seq)
        if not self.synced.is_set() or self._recovering:
            return
        for batch in self._kept.chunks():
            await self._flush_chunk(batch)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _flush_chunk(self, batch: Sequence[Summary]) -> None:
        keys = self._report_keys()
        for _ in range(3):
            now = self.view.now_ms()
            args = self._head_args(self.view.config, now) + summary_args(batch, now)
            reply = ReportReply.decode(
                await self._eval("flush", keys, args, self._scripts["report"])
            )
            self._clock.observe(reply.now_ms, mono_ms())
            if reply.status in (STALE_CONFIG, TABLE_LOST):
                await self.resync()
                continue
            self._wrote()
            self._saw_values(reply.values)
            self._acked = max(self._acked, *(sm.seq for sm in batch))
            metrics.FLUSHES.inc()
            return
        raise StoreUnavailable("the table kept changing during the flush; retry")

    def _report_locally(self, reports: Sequence[ReportIn]) -> list[ReportOutcome]:
        """Apply to this replica's view at once (the one rule, ``detour.apply``) and journal
        for replay. Items dropped to make room had ended windows: selects see no change, and
        the next snapshot brings the copy in line with Redis.

        Ids follow the memory store's rule (``ReportIds.sort``): a retry of a report this
        replica answered (kept, sent or journaled) is answered as the first time and is
        neither applied nor journaled again; an id reused with other content is refused."""
        view = self.view
        now, config = view.now_ms(), view.config
        ids = self._kept.ids
        done = ids.sort(reports, now, view.window_end)
        if done.duplicates:
            metrics.DUPLICATE_REPORTS.inc(done.duplicates)
        if done.expired:
            metrics.EXPIRED_REPORTS.inc(done.expired)
        fresh = [r for _, r in done.fresh]
        applied = apply_locally(
            view,
            fresh,
            now,
            self._settings.max_brokers,
            view.drop_local_fault,
            view.set_local_fault,
            self.namespace,
        )
        answers = []
        for r, e in zip(fresh, applied.effects, strict=True):
            self._journal.append(r.dated(now))
            answers.append(outcome(r, e, now, config, degraded=True))
            if not r.pending:
                view.observe_latency(r.broker_name, r.latency_ms, now)
        return ids.settle(done, answers, now)

    def _keep_journaled(self) -> None:
        """Put the journal's reports back on a view a snapshot just replaced.

        The snapshot cannot hold them (they have not reached Redis), and a report taken
        while a resync ran (a merge under way, a snapshot in flight) is journaled and
        answered from this view: without this, the replica would forget a window it had
        just answered until the replay's push brought it back. Applying them again is the
        one rule on the snapshot's items (``apply_locally``); the items stay local until
        the store's copies replace them."""
        if not self._journal:
            return
        view = self.view
        now = view.now_ms()
        try:
            apply_locally(
                view,
                self._journal.take(len(self._journal), now),
                now,
                self._settings.max_brokers,
                view.drop_local_fault,
                view.set_local_fault,
                self.namespace,
            )
        except TableFull:
            log.warning("journaled reports not put back on the new copy: its table is full")

    async def replay_journal(self) -> None:
        """Hand journaled reports to Redis in order (their identities make it once only)."""
        await replay(self._journal, self._report_remote, self.view.now_ms)

    def _report_args(
        self, reports: Sequence[ReportIn], config: Config
    ) -> tuple[list[Any], list[int | None]]:
        """report.lua's ARGV for ``reports`` under ``config``, and each report's tier. The
        ages are from one reading of the table's clock, sent with them (``_head_args``):
        report.lua dates each report as this replica did, whenever it runs the call."""
        enabled = config.send_latency_fault_enable
        base = self.view.now_ms()
        tiers = [
            None
            if not enabled
            else (policy.pending_tier(config, r.latency_ms) if config.pending_quorum else None)
            if r.pending
            else strategy.tier(config, r.latency_ms, r.isolation)
            for r in reports
        ]
        args = self._head_args(config, base)
        for r, t in zip(reports, tiers, strict=True):
            duration = 0 if t is None else config.not_available_duration[t]
            args += [
                r.broker_name,
                r.latency_ms,
                duration,
                base - r.at(base),
                int(r.isolation and not r.pending),
                r.producer,
                _vote(config, r, duration),
                random.randrange(policy.JITTER_SCALE) if config.jitter_percent else 0,
                "" if t is None else config.latency_max[t],
                r.voter_id,
                r.seq,
                r.report_id,
                r.scope,
                r.fingerprint if r.report_id else "",
            ]
        return args, tiers

    def _head_args(self, config: Config, base: int) -> list[Any]:
        """report.lua's ARGV[1..11]: the config, rule, bounds, epoch, writer, integrity, the
        stamp floor and ``base``, the reading of the table's clock the entries' ages are
        from."""
        enabled = config.send_latency_fault_enable
        rule = ("overwrite" if config.last_report_wins else "extend") if enabled else "off"
        return [
            max(self.view.config_stamp, 0),
            rule,
            self._push_channel,
            self._log_max,
            self._settings.max_brokers,
            _policy_arg(config, self._events_max),
            self._epoch_arg(),
            self._replica_id,
            integrity_arg(self._acked),
            self._seen_stamp,
            base,
        ]

    def _report_keys(self) -> tuple[str, ...]:
        return (
            self._faults,
            self._meta,
            self._log,
            self._events,
            self._ends,
            self._writers,
            self._writers_seen,
            self._ids,
            self._ids_index,
            self._ids_forgotten,
            self._routes,
            self._graves,
        )

    def _saw_values(self, values: Sequence[str]) -> None:
        for value in values:
            if value:
                self.saw(codec.item_stamp(value))

    async def _report_remote(
        self, reports: Sequence[ReportIn], script: AsyncScript | None = None
    ) -> list[ReportOutcome]:
        view = self.view
        keys = self._report_keys()
        for _ in range(3):
            config = view.config
            args, tiers = self._report_args(reports, config)
            reply = ReportReply.decode(await self._eval("report", keys, args, script))
            self._clock.observe(reply.now_ms, mono_ms())
            if reply.status == STALE_CONFIG:
                # Another replica changed the config and its push has not
                # arrived yet: take the table as it is now and recompute.
                await self.resync()
                continue
            if reply.status == TABLE_LOST:
                # The table is not the one this replica holds: merge, then write.
                await self.resync()
                continue
            if reply.status == ID_REUSED:
                index = int(reply.extra) - 1
                raise ReportIdReused(reports[index].report_id, index)
            if reply.extra:
                metrics.EVICTED.labels(self.namespace).inc(int(reply.extra))
            self._wrote()
            if reply.status == TABLE_FULL:
                raise TableFull(self.namespace, self._settings.max_brokers)
            self._saw_values(reply.values)
            self._acked = max(self._acked, *(r.seq for r in reports))
            return [
                self._outcome(r, t, reply, i, config)
                for i, (r, t) in enumerate(zip(reports, tiers, strict=True))
            ]
        raise StoreUnavailable("the table kept changing during the report; retry")

    def _outcome(
        self, r: ReportIn, t: int | None, reply: ReportReply, i: int, config: Config
    ) -> ReportOutcome:
        """One report's outcome from the script's reply; the view takes a changed item."""
        view = self.view
        tier_ms = None if t is None else config.latency_max[t]
        if reply.expired[i]:
            # its id may be one its scope forgot (ids.py): not applied, never twice
            metrics.EXPIRED_REPORTS.inc()
            return ReportOutcome(r.broker_name, r.latency_ms, 0, reply.ends[i], reply.now_ms,
                                 r.isolation, expired=True)  # fmt: skip
        if reply.duplicates[i]:
            # applied before: the first answer, as the script kept it
            metrics.DUPLICATE_REPORTS.inc()
            return ReportOutcome(
                r.broker_name,
                r.latency_ms,
                reply.durations[i],
                reply.ends[i],
                reply.now_ms,
                r.isolation,
                tier_ms,
                strategy.WindowChange(reply.changes[i]),
                quorum=_QUORUM_STATES[reply.quorums[i]],
                probe=_PROBE_STATES[reply.probes[i]],
                duplicate=True,
                pending=r.pending,
            )
        if reply.versions[i]:
            view.apply_fault(
                r.broker_name, codec.decode_fault(r.broker_name, reply.values[i]), reply.versions[i]
            )
        elif reply.values[i] and r.broker_name not in view.faults:
            # A broker's first report creates its item without a push (no window): this
            # replica learns it from the reply, so its next reports can be kept local
            # (policy.quiet needs the item). No version: the next snapshot or push replaces it.
            view.learn_fault(codec.decode_fault(r.broker_name, reply.values[i]))
        if not r.pending:
            view.observe_latency(r.broker_name, r.latency_ms, reply.now_ms)
        return ReportOutcome(
            r.broker_name,
            r.latency_ms,
            reply.durations[i],
            reply.ends[i],
            reply.now_ms,
            r.isolation,
            tier_ms,
            strategy.WindowChange(reply.changes[i]),
            quorum=_QUORUM_STATES[reply.quorums[i]],
            probe=_PROBE_STATES[reply.probes[i]],
            pending=r.pending,
        )

    async def latency_log(self, after: str | None, limit: int) -> list[LogEntry]:
        async with _wrap_errors():
            rows: list[tuple[str, dict[str, str]]] = await self._client.xrange(
                self._log, min=f"({after}" if after else "-", max="+", count=limit
            )  # type: ignore[assignment]
        return [_log_entry(entry_id, f) for entry_id, f in rows]

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
        self,
        key: str,
        kind: str,
        field: str,
        value: str,
        events: bool = False,
        expected: int | None = None,
        held: bool = False,
    ) -> tuple[int, int]:
        """One entry written into the table this replica holds (merged first if lost, or
        if it cannot be confirmed to be that table: ``confirm``); (version, stamp).
        ``expected``: the config stamp the change was made on (a table whose config changed
        meanwhile is not written: raises ConfigChanged). ``held``: a delete of an entry this
        replica's copy holds, which leaves its grave even where the table lacks it."""
        keys = (
            key,
            self._meta,
            self._events,
            self._ends,
            self._graves,
            self._graves_index,
            self._faults,
            self._routes,
        )
        for _ in range(3):
            await self.confirm()
            args = (
                self._push_channel,
                kind,
                field,
                value,
                self._events_max if events else 0,
                self._epoch_arg(),
                self._seen_stamp,
                "" if expected is None else expected,
                Graves.TTL_MS,
                Graves.CAP,
                int(held),
            )
            version, stamp = (int(x) for x in await self._eval("set_entry", keys, args))
            if version >= 0:
                self._wrote()
                self.saw(stamp)
                return version, stamp
            if version == -2:
                raise ConfigChanged(stamp)
            await self.resync()
        raise StoreUnavailable("the table kept changing during the write; retry")

    async def detector_lease(self, ttl_ms: int) -> bool:
        """One replica per namespace runs the detector: a lease it renews each round."""
        held = await self._eval("lease", (self._lease,), (self._replica_id, ttl_ms))
        return int(held) == 1

    async def set_reachability(self, readings: Mapping[str, bool]) -> None:
        config = self.view.config
        early = config.early_recovery and config.send_latency_fault_enable
        args: list[str | int] = [self._push_channel, int(early), self._seen_stamp]
        for broker, reachable in readings.items():
            args += [broker, int(reachable)]
        changed = await self._eval("reach", (self._faults, self._meta, self._ends), args)
        for broker, version, value in changed:
            item = codec.decode_fault(broker, value)
            self.saw(item.stamp)
            self.view.apply_fault(broker, item, int(version))

    async def delete_fault(self, broker: str) -> bool:
        item = self.view.faults.get(broker)
        version, stamp = await self._set_entry(
            self._faults, "fault", broker, "", events=True, held=item is not None
        )
        if version and item is not None and item.available_at > self.view.now_ms():
            metrics.EVENTS.labels(self.namespace, "ended", "operator").inc()
        if version:
            self.view.apply_fault(broker, None, version, stamp)
        return version > 0

    async def put_route(self, route: Route) -> None:
        encoded = codec.encode_route(route)
        version, stamp = await self._set_entry(self._routes, "route", route.topic, encoded)
        self.view.apply_route(route.topic, route, version, stamp)

    async def delete_route(self, topic: str) -> bool:
        held = topic in self.view.routes
        version, stamp = await self._set_entry(self._routes, "route", topic, "", held=held)
        if version:
            self.view.apply_route(topic, None, version, stamp)
        return version > 0

    async def put_config(self, config: Config) -> None:
        encoded = codec.encode_config(config)
        version, stamp = await self._set_entry(self._meta, "config", "config", encoded)
        self.view.apply_config(config, version, stamp)

    async def patch_config(self, update: Callable[[Config], Config]) -> Config:
        """Read, change, write only if the table's config is still the one read (its stamp):
        a change another replica made meanwhile is read and changed again, never lost."""
        for _ in range(5):
            view = self.view
            config, stamp = update(view.config), max(view.config_stamp, 0)
            encoded = codec.encode_config(config)
            try:
                version, written = await self._set_entry(
                    self._meta, "config", "config", encoded, expected=stamp
                )
            except ConfigChanged:
                await self.resync()
                continue
            view.apply_config(config, version, written)
            return config
        raise StoreUnavailable("the config kept changing during the change; retry")

    # -- reads -------------------------------------------------------------
    async def fault_items(self) -> tuple[int, list[FaultItem]]:
        """The table as Redis holds it; one that lost data is merged first, so the answer
        never leaves out a window a replica still holds."""
        for _ in range(3):
            held = self.held()
            now, flat, epoch, version, high_water, hlc, known = await self._eval(
                "fault_items",
                (self._faults, self._meta, self._writers, self._routes, self._graves),
                (self._replica_id, *self._lineage),
            )
            lost = self._loss(epoch, int(high_water), int(version), int(hlc), held, int(known) == 1)
            if lost is None:
                return int(now), [codec.decode_fault(b, v) for b, v in codec.pairs(flat)]
            await self.resync()
        raise StoreUnavailable("the table kept changing during the read; retry")

    # -- sync and merges ---------------------------------------------------
    async def _snapshot(self, *, primary: bool = False) -> tuple[Snapshot, SnapshotReply]:
        """The table from the server the follower reads (a replica of the fan-out tier), or
        from the primary when ``primary``."""
        replica = None if primary else self._tier.client
        raw = await self._eval(
            "snapshot",
            (self._faults, self._routes, self._meta, self._writers, self._graves),
            (self._replica_id, *self._lineage),
            client=replica,
        )
        reply = SnapshotReply.decode(raw)
        if replica is None:
            # (Redis time is the primary's: a replica's host clock may differ.)
            self._clock.observe(reply.now_ms, mono_ms())
        routes = codec.pairs(reply.routes)
        snap = Snapshot(
            version=reply.version,
            # none written yet: the one a new table starts with (written by start())
            config=codec.decode_config(reply.config) if reply.config else self.view.initial_config,
            config_version=reply.version if reply.config else 0,
            routes={t: codec.decode_route(t, r) for t, r in routes},
            faults={b: codec.decode_fault(b, v) for b, v in codec.pairs(reply.faults)},
            # a table without a config: -1, so that a config this replica holds goes back
            config_stamp=reply.config_stamp if reply.config else -1,
            route_stamps={t: codec.route_stamp(r) for t, r in routes},
        )
        return snap, reply

    def held(self) -> tuple[int, int, int]:
        """What this replica knows Redis had: its highest acknowledged report, its view's
        version and the highest stamp it saw. Taken before a read is sent: a report
        acknowledged or a push applied while the read is in flight must not make its older
        answer look lost."""
        return self._acked, self.view.version, self._seen_stamp

    def _loss(
        self,
        epoch: str,
        high_water: int,
        version: int,
        hlc: int,
        held: tuple[int, int, int],
        known: bool,
    ) -> str | None:
        """Why the table in Redis may not be (all of) the one this replica holds, or None.

        ``held`` is ``held()`` from before the read; ``known``: whether the table's history
        holds this replica's lineage pair, sent with the read (not so: the table followed
        another history since, as after a rollback in place that later writes took past
        this replica's version; counted as ``behind``). Each sign leads to a merge, which is
        harmless and cheap when nothing was lost.
        """
        if not self._epoch:
            return None  # the first sync: nothing held yet
        if not epoch:
            return "empty"
        if epoch != self._epoch:
            return "epoch"
        acked, view_version, seen_stamp = held
        if high_water < acked or version < view_version or hlc < seen_stamp or not known:
            return "behind"
        return self._doubt

    def table_lost(
        self, reply: PollReply, held: tuple[int, int, int], *, primary: bool = True
    ) -> bool:
        """The follower's poll: does Redis's table lack what this replica held when it
        sent the poll (``held()``)? ``primary``: the poll was the primary's (whose clock
        is Redis time)."""
        if primary:
            self._clock.observe(reply.now_ms, mono_ms())
        if not self._epoch and reply.epoch:
            # Another replica's first write gave the table its epoch: this view, kept by
            # its pushes, is a copy of that table now.
            self._epoch = reply.epoch
        lost = self._loss(
            reply.epoch, reply.high_water, reply.version, reply.hlc, held, reply.known
        )
        return lost is not None

    async def poll(self, *, primary: bool = False) -> PollReply:
        """The table's identity from the server the follower reads, or the primary's."""
        replica = None if primary else self._tier.client
        raw = await self._eval(
            "poll",
            (self._meta, self._writers, self._faults, self._routes, self._graves),
            (self._replica_id, *self._lineage),
            client=replica,
        )
        reply = PollReply.decode(raw)
        if replica is None:
            self._tier.primary_at(reply.version)
        return reply

    async def check_identity(self) -> None:
        """On each (re)connection: is it the Redis process this replica synced with? This
        replica's mark (lua/marker.lua) lives in that process's script cache, which nothing
        persists or replicates: a restart (from any copy of the data, or empty), a failover
        or another server at the address does not know it, and the next resync merges. It
        needs no command beyond the scripting ones (INFO is out of Detour's ACL)."""
        async with _wrap_errors():
            try:
                await self._client.evalsha(self._marker.sha, 1, self._meta)
            except NoScriptError:
                if self._marked:
                    self._doubt = self._doubt or "restart"
                await self._client.script_load(self._marker.script)
        self._marked = True

    async def confirm(self) -> None:
        """Before an operator write (a config, a route, a delete): make sure the Redis it
        goes to holds the table this replica knows, merging first when it may not.

        The follower notices a restart or a rollback only when it reconnects or polls; an
        operator write made in between would act on a table that lacks what this replica
        holds: a DELETE would answer 404 for an entry the merge then brings back, a PATCH
        would be computed on a config the merge then replaces. So every operator write first
        runs the follower's checks itself: this replica's mark in the Redis process
        (``check_identity``), then a poll of the primary (epoch, version, last stamp, this
        replica's acknowledged reports, the table's lineage) against what it holds, and
        merges on any sign. Two round trips, only on operator writes (rare); selects and
        reports never pay them. A loss between this check and the write is covered by the
        write itself: set_entry.lua checks the epoch, and a delete of an entry this replica
        holds leaves its grave whatever the table holds."""
        await self.check_identity()
        held = self.held()
        if self.table_lost(await self.poll(primary=True), held):
            await self.resync()

    def follow_lineage(self, version: int, token: str, prev: str) -> bool:
        """A push took the table to ``version`` (lineage ``token``, ``prev`` the one before):
        the view's lineage follows it when it is the next; False when it is the next
        version but of another history (the table was rolled back in place and written
        since): the next resync merges. A push at or below the pair reached says nothing
        (one in flight across a snapshot); one past the next is a gap, which resyncs, and
        the snapshot checks the pair."""
        reached, mine = self._lineage
        if version != reached + 1:
            return True
        if mine and prev != mine:
            self._doubt = self._doubt or "behind"
            return False
        self._lineage = (version, token)
        return True

    def doubt(self, cause: str, replica: str = "") -> None:
        """The next resync merges: another replica announced a merge (its own announcement
        ``replica`` is this one's is ignored)."""
        if replica != self._replica_id:
            self._doubt = self._doubt or cause

    async def _master_changed(self) -> None:
        self.doubt("failover")

    async def resync(self) -> None:
        """Replace the view with Redis's table; a table that may have lost data is merged
        with what this replica holds first.

        One at a time. The follower (a push out of order, a poll) and a request (a write's
        reply, a read that saw the loss) may each ask for one at the same moment, as after
        a FLUSHALL. Two interleaved, the second to finish set the epoch, the lineage and
        the acknowledged reports from a snapshot older than the first one's merge, and
        ended the first one's ``_recovering`` while its merge was still on its way. A caller
        that waited is done when a resync that began after it asked ended well: that one
        read Redis after whatever made the caller ask (a reply it had already received)."""
        asked = self._resyncs_begun
        async with self._resync_lock:
            if self._resynced > asked:
                return
            self._resyncs_begun += 1
            began = self._resyncs_begun
            await self._resync()
            self._resynced = began

    async def _resync(self) -> None:
        held = self.held()
        snap, reply = await self._snapshot()
        cause = self._loss(
            reply.epoch, reply.high_water, snap.version, reply.hlc, held, reply.known
        )
        if self._tier.on_replica:
            snap, reply, cause = await self._replica_snapshot(snap, reply, cause, held)
        if cause is not None or (not reply.epoch and snap.version > 0):
            # (a table written before epochs existed gets one now; a new one, with its
            # first write)
            self._recovering = True
            try:
                wrote = await self._merge(cause, snap, needs_epoch=not reply.epoch)
            finally:
                self._recovering = False
            if wrote:
                snap, reply = await self._snapshot()
        self.view.replace(snap, reset=cause is not None)
        self._keep_journaled()
        self._epoch = reply.epoch
        if cause is not None or reply.version >= self._lineage[0]:
            # (a push that chained past this snapshot while it was in flight is kept: the
            # snapshot showed the pair it chained from is the table's)
            self._lineage = (reply.version, reply.token)
        if cause is not None:
            # The table as it is now is the one this replica holds: what Redis lost of this
            # replica's reports is no longer expected of it (the merge put their windows
            # back; the journal replays what was never acknowledged).
            self._acked = reply.high_water
            self._seen_stamp = reply.hlc
            self._doubt = None
        self.saw(reply.hlc)
        self.synced.set()
        self._ever_synced = True
        metrics.RESYNCS.inc()

    async def _replica_snapshot(
        self, snap: Snapshot, reply: SnapshotReply, cause: str | None, held: tuple[int, int, int]
    ) -> tuple[Snapshot, SnapshotReply, str | None]:
        """A snapshot read on a replica that seems to lack what this replica holds may only
        lag: read it again until ``redis_replica_max_lag_s`` passed. Only the primary decides
        that the table lost data (raises ReplicaBehind then); a table without an epoch
        gets it from the primary too."""
        deadline = time.monotonic() + self._tier.max_lag_s
        while cause is not None or (not reply.epoch and snap.version > 0):
            if cause is not None and cause == self._doubt:
                raise ReplicaBehind(f"a merge is due ({cause}): the primary's table decides")
            if time.monotonic() >= deadline:
                raise ReplicaBehind(f"a snapshot on the replica looks {cause or 'unstamped'}")
            await asyncio.sleep(0.05)  # pacing a retry of a lagging replica, bounded above
            snap, reply = await self._snapshot()
            cause = self._loss(
                reply.epoch, reply.high_water, snap.version, reply.hlc, held, reply.known
            )
        return snap, reply, cause

    async def _merge(self, cause: str | None, snap: Snapshot, needs_epoch: bool) -> bool:
        """Merge what this replica holds into the table (service/store/merge.py says what,
        reseed.lua applies it by detour.merge's rules), in calls of ``merge.CHUNK`` items so
        none holds Redis long; the last one announces it, so every other replica merges
        what it holds too.

        ``cause`` None: the table has no epoch but was written (a new one, or one written
        before epochs): it only gets one. The latency log and the event log are held by no
        replica: what Redis lost of them is gone (counted). A merge that finds nothing to
        send into a table that has its epoch costs no call at all (False: nothing written).
        """
        now = self.view.now_ms()
        c = candidates(self.view, snap, now) if cause is not None else None
        if cause is not None and not c and not needs_epoch:
            metrics.RESEEDS.labels(cause).inc()
            return False
        keys = (
            self._faults,
            self._routes,
            self._meta,
            self._events,
            self._ends,
            self._graves,
            self._graves_index,
        )
        head = [self._push_channel, uuid.uuid4().hex, self._events_max, self._replica_id]
        # A merge this replica saw the cause of is announced, so that every replica merges
        # what it holds; one made on another's announcement is not (it would echo back).
        announce = cause is not None and cause != "merge"
        written = [0, 0, 0, 0, 0]
        for args in calls(c or Candidates(), head, self._settings.max_brokers, announce):
            reply = ReseedReply.decode(await self._eval("reseed", keys, args))
            for i, n in enumerate(
                (reply.config, reply.routes, reply.items, reply.graves, reply.refused)
            ):
                written[i] += n
        if cause is None:
            return True
        log.warning(
            "redis table may have lost data (%s): merged config %d, routes %d, items %d, "
            "deletes %d (%d items found no room)",
            cause,
            *written,
        )
        metrics.RESEEDS.labels(cause).inc()
        for kind, count in zip(("config", "route", "window", "delete"), written, strict=False):
            metrics.RESEEDED.labels(kind).inc(count)
        if cause in ("empty", "epoch"):
            metrics.UNRECOVERABLE.labels("latency_log").inc()
            metrics.UNRECOVERABLE.labels("events").inc()
        return True
