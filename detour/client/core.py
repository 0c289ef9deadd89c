"""What the sync and async clients share: state and decisions, no I/O.

Each client is a thin shell doing the HTTP calls its own way (blocking or
awaiting); every rule about *when* to call Detour, what to do when it does not
answer, how reports are kept and which table a local select reads lives here
once.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from detour.client import wire
from detour.client.cached import FLUSH_AT, FLUSH_INTERVAL_S, ServiceClock, StreamApplier
from detour.client.calls import MIN_BUDGET_SHARE, Calls
from detour.client.circuit import CircuitBreaker
from detour.client.errors import DetourBadAnswer, DetourUnavailable
from detour.client.inflight import InFlight
from detour.client.local import LocalTable, RouteStamp
from detour.client.pending import Pending, PendingReports
from detour.client.sse import MAX_EVENT_BYTES
from detour.client.values import ClientStats, Mode, Report, SelectedQueue
from detour.clock import mono_ms
from detour.model import Config, Route

#: A known route (and the config) is fetched again at most this often in remote mode (s).
ROUTE_REFRESH_S = 30.0
#: Rounds one background refresh makes at most: its own, and again while a route fell
#: due meanwhile (``release_refresh``). Bounded: with Detour away a route it never had
#: stays due.
REFRESH_ROUNDS = 3
#: Remote mode: how long a send waits for Detour's select (or report) before it decides
#: locally (s); the call goes on and its answer still teaches the local table. The 5 ms a
#: producer should ever wait for advice, less the waiting thread's wake-up on a busy
#: machine (over 1 ms at p99: docs/BENCHMARKS.md, "Overload as producers see it").
DECIDE_WITHIN_S = 0.003
#: The smallest report batch the flusher falls back to when Detour does not keep up.
MIN_BATCH = 50
#: Topics found stale (``route_stale``) whose mark a client keeps at most: a producer may
#: name any topic, and a route fetch that fails leaves its mark until a later one ends.
MAX_STALE_MARKS = 1024
#: Topics whose last route check a client keeps at most (the newest): a topic whose check
#: went is due again, and fetched on its next remote select.
MAX_ROUTE_CHECKS = 4096
#: Topics whose route a client fetches at one time at most (a fetch per topic at a time:
#: ``DetourClient._fetch_route``); a topic beyond them is not fetched, and fails open.
MAX_ROUTE_FETCHES = 64
#: A broker a Detour answer names as avoided is avoided by local selects for this long
#: after that answer (ms): what the remote client's own table knows of the shared one.
HINT_MS = 10_000


class RouteAsk(NamedTuple):
    """``ClientCore.route_asking``: taken as a route fetch is asked for."""

    #: the newest ``route_stale`` mark then
    mark: int
    #: the topic's route writes then (``LocalTable.route_stamp``)
    stamp: RouteStamp


def _after_fork(core: ClientCore) -> None:
    """``core.after_fork`` in every child ``os.fork`` makes while ``core`` lives (a weak
    reference: a closed client is not kept alive for it)."""
    ref = weakref.ref(core)

    def child() -> None:
        alive = ref()
        if alive is not None:
            alive.after_fork()

    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=child)


def wall_ms() -> int:
    """The process wall clock, epoch ms: the remote client's local table runs on it."""
    return time.time_ns() // 1_000_000


class ClientCore:
    def __init__(
        self,
        mode: Mode,
        *,
        timeout: float,
        retries: int,
        deadline: float,
        max_pending: int,
        backoff_initial: float,
        backoff_max: float,
        producer: str | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        pending_factor: float = 4.0,
        pending_floor_ms: float = 50.0,
        decide_within: float | None = DECIDE_WITHIN_S,
    ) -> None:
        if mode not in ("remote", "cached"):
            raise ValueError(f"mode must be 'remote' or 'cached', got {mode!r}")
        if timeout <= 0 or deadline <= 0:
            raise ValueError("timeout and deadline must be > 0 (seconds)")
        if retries < 0:
            raise ValueError("retries must be >= 0")
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be >= 1")
        if decide_within is not None and decide_within <= 0:
            raise ValueError("decide_within must be > 0 (seconds) or None")
        wire.check_producer(producer)
        #: sent with every report, for Detour's latency log
        self.producer = producer
        #: this client's part of each report's ``reportId`` (the other: the report's seq), so
        #: a batch Detour applied but whose reply was lost changes nothing when sent again
        self.report_ids = uuid.uuid4().hex[:16]
        _after_fork(self)
        self.mode: Mode = mode
        self.cached = mode == "cached"
        self.timeout = timeout
        self.retries = retries
        self.deadline = deadline
        #: cached mode: the longest event-stream line or event the reader takes (bytes).
        self.max_event_bytes = max_event_bytes
        self.service_clock = ServiceClock()
        self.table = LocalTable(self.service_clock.now_ms if self.cached else wall_ms, producer)
        self.pending = PendingReports(max_pending, self._batch_head)
        self.circuit = CircuitBreaker(backoff_initial, backoff_max)
        self.calls = Calls(timeout, MIN_BUDGET_SHARE * min(timeout, deadline), self.circuit)
        self.applier = StreamApplier(self.table, self.service_clock, self.pending)
        #: remote mode: seconds a send waits for Detour before deciding locally (None: the
        #: whole call timeout)
        self.decide_within = decide_within
        self.remote_selects = 0
        self.local_selects = 0
        self._count_lock = threading.Lock()
        self.late_answers = 0
        #: cached mode: snapshots the event stream applied (the first, then one a reconnect)
        self.stream_snapshots = 0
        self._late_under_way = 0
        #: topics whose route and config a background refresh is fetching now
        self._refreshing: set[str] = set()
        #: reports per batch the flusher sends (``batch_answered``)
        self.batch_size = wire.MAX_BATCH
        #: when each topic's route was last fetched (``route_checked``), the
        #: ``MAX_ROUTE_CHECKS`` newest at most: a producer may name any topic, a 404 too
        self._route_checked: OrderedDict[str, float] = OrderedDict()
        #: ``route_stale`` marks, numbered in order (``route_asking``), one per topic, the
        #: ``MAX_STALE_MARKS`` newest at most
        self._stale_marks = 0
        self._stale_at: dict[str, int] = {}
        self._config_checked: float | None = None
        #: outstanding sends, for in-flight signals (pendingQuorum)
        self.inflight = InFlight(pending_factor, pending_floor_ms)

    # -- selects -----------------------------------------------------------------
    def local_select(
        self,
        topic: str,
        last_broker: str | None,
        cause: BaseException | None = None,
        stream_connected: bool = False,
        sharding_key: str | None = None,
    ) -> SelectedQueue:
        """Decide in-process, as ``POST /select`` would (``LocalTable.select``).

        Raises DetourUnavailable when no route is known (Detour could not be asked for
        it). Never TopicNotFound: only Detour's own 404 for the route says a topic has
        none (the clients' ``_fetch_route``); a cached copy that lacks a route may only be
        behind (a route registered a moment ago, its push still on the way).
        ``stream_connected`` is accepted for older callers and decides nothing now.
        """
        sel = self.table.select(topic, last_broker, sharding_key)
        if sel is None:
            why = f"Detour is unavailable ({cause})" if cause else "Detour could not be asked"
            raise DetourUnavailable(f"{why} and no route is known for topic {topic!r}") from cause
        self.local_selects += 1
        return sel

    def left_s(self, ends: float | None) -> float:
        """Seconds left until ``ends`` (monotonic s; None: one call timeout)."""
        return self.timeout if ends is None else max(0.0, ends - time.monotonic())

    def snapshot_wait_s(self, ends: float | None) -> float:
        """How long a cached select of a topic it knows no route of waits for the stream's
        first snapshot: the call timeout, but never more than half of what is left of the
        send, so that the route can still be fetched (``_fetch_route``) within the send's
        deadline when no snapshot comes."""
        return min(self.timeout, self.left_s(ends) / 2 if ends is not None else self.timeout)

    def late(self) -> None:
        """A call missed the decision deadline (its send decided without it) and goes on:
        until it ends, sends decide locally and queue their reports without calling
        Detour (``slow``), as one late answer says the next would be late too."""
        with self._count_lock:
            self.late_answers += 1
            self._late_under_way += 1

    def late_ended(self) -> None:
        with self._count_lock:
            self._late_under_way -= 1

    def slow(self) -> bool:
        """A call that missed the decision deadline is still under way."""
        return self._late_under_way > 0

    def check_answer(self, selected: SelectedQueue) -> None:
        """Raises DetourBadAnswer unless Detour's answer agrees with the route this client
        knows (``LocalTable.check_answer``). A producer sends to whatever it is told, so an
        answer is followed only when its queue is in the route and its address is the one
        the route gives that broker, and it is never followed before a route is known (the
        clients fetch it first): anything at the edge could otherwise send the producer's
        messages where it likes."""
        wrong = self.table.check_answer(selected)
        if wrong is not None:
            raise DetourBadAnswer(f"POST /select: {wrong}")

    def learn(self, selected: SelectedQueue) -> None:
        """What a Detour answer (on time or late, checked by ``check_answer``) teaches the
        local table: the brokers it avoided, avoided locally for ``HINT_MS`` too; only
        brokers of the topic's known route, so one answer adds at most the route's size."""
        if selected.avoided_brokers:
            self.table.hint_avoided(
                self.table.of_route(selected.topic, selected.avoided_brokers),
                self.table.now_ms() + HINT_MS,
            )

    def refresh_due(self, topic: str) -> tuple[bool, bool]:
        """(route due, config due) for remote mode: first use, then every 30 s, and a route
        at once after an answer it did not have (``route_stale``)."""
        now = time.monotonic()
        checked = self._route_checked.get(topic)
        route_due = checked is None or now - checked >= ROUTE_REFRESH_S
        config_due = self._config_checked is None or now - self._config_checked >= ROUTE_REFRESH_S
        return route_due, config_due

    def settled(self, batch: list[Pending], accepted: bool, expired: int = 0) -> None:
        """Detour answered ``batch``: it took it (``accepted``; ``expired`` of its reports
        declined as expired) or refused it for good. Either way its reports are no longer
        re-applied to the table (``StreamApplier.settle``)."""
        self.pending.done(batch, accepted, expired)
        self.applier.settle(batch)

    def batch_answered(self, answered: bool) -> None:
        """How the last report batch ended: a batch Detour did not answer in time (busy,
        throttled, away) is followed by one half as large, down to ``MIN_BATCH``; one it
        answered lets the size double back up to ``wire.MAX_BATCH``. A batch cut by the
        call's timeout is sent again whole; a smaller one fits where the big one did not."""
        with self._count_lock:
            if answered:
                self.batch_size = min(wire.MAX_BATCH, self.batch_size * 2)
            else:
                self.batch_size = max(MIN_BATCH, self.batch_size // 2)

    def claim_refresh(self, topic: str) -> bool:
        """Whether a background refresh of ``topic`` may start (none is under way); the
        caller ``release_refresh``es it when done."""
        with self._count_lock:
            if topic in self._refreshing:
                return False
            self._refreshing.add(topic)
            return True

    def release_refresh(self, topic: str, rounds_left: int = 0) -> bool:
        """End a background refresh of ``topic``; False while ``rounds_left`` and its route
        fell due meanwhile (``route_stale``: a select refused an answer while the refresh
        ran, and could not claim one of its own), so the caller refreshes again first.

        The check and the release are one step under the lock ``claim_refresh`` takes: a
        route found stale either finds the refresh still claimed, which then fetches it,
        or finds it released and claims its own. Without this, that select's refetch was
        lost until a later select asked again, which may be 30 s away or never."""
        with self._count_lock:
            if rounds_left > 0 and self.refresh_due(topic)[0]:
                return False
            self._refreshing.discard(topic)
            return True

    def knows(self, topic: str) -> bool:
        """Whether a local select could decide for ``topic`` (its route and the config are
        known): only then may a send stop waiting for Detour at the decision deadline."""
        return self.table.has_route(topic) and self._config_checked is not None

    def route_stale(self, topic: str) -> None:
        """Fetch the route again: Detour answered with a queue the known route does not
        have, or a fetch's answer was not installed (``route_fetched``)."""
        with self._count_lock:
            self._stale_marks += 1
            self._stale_at.pop(topic, None)  # to the end: the newest
            self._stale_at[topic] = self._stale_marks
            if len(self._stale_at) > MAX_STALE_MARKS:
                # The oldest mark goes: its route stays due (not checked) all the same; only
                # a fetch asked for before that mark, if one is still on its way, may now
                # settle the route.
                del self._stale_at[next(iter(self._stale_at))]
            self._route_checked.pop(topic, None)

    def route_asking(self, topic: str) -> RouteAsk:
        """A token taken as a fetch of ``topic``'s route is asked for, handed to
        ``route_fetched`` and ``route_checked``: a route found stale after it was taken
        stays due whatever that fetch answers, since the answer may predate what the
        refused answer knew; and the answer is not written over a route written after it
        was taken."""
        with self._count_lock:
            return RouteAsk(self._stale_marks, self.table.route_stamp(topic))

    def route_fetched(self, topic: str, route: Route | None, asked: RouteAsk) -> None:
        """A fetch asked for at ``asked`` answered ``route`` (None: Detour has none): into
        the table, unless the topic's route was written while it was on its way
        (``LocalTable.set_fetched_route``). Then the route stays due, as if found stale:
        what was written meanwhile may be the older of the two (a fetch asked for later
        that Detour answered sooner), so it is asked for once more."""
        if not self.table.set_fetched_route(topic, route, asked.stamp):
            self.route_stale(topic)

    def route_checked(self, topic: str, answered: bool, asked: RouteAsk) -> None:
        """A fetch of the route, asked for at ``asked`` (``route_asking``), ended.

        Unanswered, a route checked before (a periodic refresh) waits the usual 30 s; one
        never fetched, or found stale by a refused answer (``route_stale``), stays due and
        is asked for again on the next remote select (the failure opened the circuit, which
        paces it). Marking a stale route checked after one failed fetch kept a known-wrong
        route for 30 s.

        A route found stale while the fetch was on its way stays due too, answered or not:
        otherwise the fetch under way when a select refused an answer marked the route
        checked, and the refetch that refusal asked for was lost for 30 s.
        """
        with self._count_lock:
            if self._stale_at.get(topic, 0) > asked.mark:
                return
            self._stale_at.pop(topic, None)
            checked = self._route_checked
            if answered or topic in checked:
                checked[topic] = time.monotonic()
                checked.move_to_end(topic)
                if len(checked) > MAX_ROUTE_CHECKS:
                    checked.popitem(last=False)  # the oldest check: that route is due again

    def config_asking(self) -> int:
        """A token taken as a config fetch is asked for, handed to ``config_fetched``."""
        return self.table.config_stamp()

    def config_fetched(self, config: Config, asked: int) -> bool:
        """A fetch asked for at ``asked`` answered ``config``: into the table, unless the
        config was written while it was on its way (``LocalTable.set_fetched_config``);
        whether it was. Not installed, ``config_checked`` leaves the config due, as
        ``route_fetched`` does a route: what was written may be the older of the two."""
        return self.table.set_fetched_config(config, asked)

    def config_checked(self, answered: bool, installed: bool = True) -> None:
        """A config fetch ended: ``answered`` by Detour, its answer ``installed`` or not."""
        now = time.monotonic()
        if answered and not installed:
            self._config_checked = now - ROUTE_REFRESH_S  # known, and due again at once
        elif answered or self._config_checked is not None:
            self._config_checked = now

    # -- reports -----------------------------------------------------------------
    def record(
        self, broker_name: str, latency_ms: float, isolation: bool, age_ms: int = 0
    ) -> Pending:
        """Check a report; returns it ready to queue and ``apply`` (not applied yet).

        Raises ValueError when Detour would refuse it (name, ms range, age).
        """
        wire.check_report(broker_name, latency_ms, age_ms)
        return self.pending.make(broker_name, latency_ms, bool(isolation), mono_ms() - age_ms)

    def record_all(self, reports: Iterable[Report]) -> list[Pending]:
        """``record`` for a batch: all are checked before any is returned."""
        batch = list(reports)
        for r in batch:
            wire.check_report(r.broker_name, r.latency_ms, r.age_ms)
        return [self.record(r.broker_name, r.latency_ms, r.isolation, r.age_ms) for r in batch]

    def apply(self, items: Iterable[Pending]) -> None:
        """Apply reports to the local table, each at its age.

        Cached mode queues a report *before* applying it: a stream event that
        lands in between then re-applies it instead of undoing it.
        """
        now = mono_ms()
        for p in items:
            if not p.pending:
                self.table.apply_report(p.broker_name, p.latency_ms, p.isolation, p.age_ms(now))

    def must_queue(self) -> bool:
        """Reports go to the queue, not straight to Detour: cached mode always; remote mode
        while Detour is down or late, or older reports wait (so they reach Detour in order)."""
        return self.cached or self.circuit.is_open or self.slow() or len(self.pending) > 0

    def report_id(self, p: Pending) -> str:
        """The report's identity on the wire: the same on its first post and any replay."""
        return self._report_id(p.seq)

    def _report_id(self, seq: int) -> str:
        return f"{self.report_ids}-{seq}"

    def _batch_head(
        self, seq: int, broker_name: str, latency_ms: float, isolation: bool, pending: bool
    ) -> str:
        return wire.batch_head(
            broker_name, latency_ms, isolation, self.producer, self._report_id(seq), pending
        )

    def batch_body(self, batch: Iterable[Pending]) -> bytes:
        """The batch's body: each report's entry as encoded when it was queued, with its
        age now."""
        now = mono_ms()
        return wire.batch_text((p.head, p.age_ms(now)) for p in batch)

    # -- in-flight signals -------------------------------------------------------
    def tracking(self) -> bool:
        """Sends are tracked for in-flight signals: the client's ``pending_factor`` is not 0
        and the service's config asks for them (``pendingQuorum`` > 0; remote mode reads
        the config every 30 s, cached mode as it is pushed)."""
        return self.inflight.enabled and self.table.view.config.pending_quorum > 0

    def due_signals(self, now_ms: float) -> list[Pending]:
        """The pending reports due now (``InFlight.due``), ready to queue; not applied to the
        local table. Queued behind nothing but older reports, so in both modes a signal
        reaches Detour before the report of the send's completion."""
        out = []
        for broker, outstanding in self.inflight.due(now_ms):
            try:
                wire.check_report(broker, outstanding)
            except ValueError:
                continue
            out.append(self.pending.make(broker, outstanding, False, now_ms, pending=True))
        return out

    def flush_due_in(self) -> float | None:
        """Seconds until the flusher should send (0 = now), None when nothing waits."""
        pending = self.pending
        if pending.queued() == 0:
            return None
        wait = self.circuit.remaining_s()
        # Reports wait up to FLUSH_INTERVAL_S to leave as one batch (remote mode queues
        # only while Detour is down or late, or behind older ones: no hurry then either).
        if not pending.urgent and pending.queued() < FLUSH_AT:
            oldest = pending.oldest_at_ms()
            if oldest is not None:
                wait = max(wait, FLUSH_INTERVAL_S - (mono_ms() - oldest) / 1000)
        return max(0.0, wait)

    def after_fork(self) -> None:
        """In a forked child: a new report id prefix, so the child's ids never repeat the
        parent's (the sequence was copied with the process: Detour would refuse the
        parent's next reports as ids reused, or skip them as duplicates); an empty queue
        (the parent sends what it had queued) and fresh counters (the parent's are its
        own). Locks are made anew: another thread may have held one at the fork."""
        self.report_ids = uuid.uuid4().hex[:16]
        self._count_lock = threading.Lock()
        self.pending.after_fork()
        self.calls.after_fork()
        self.remote_selects = self.local_selects = 0
        self.late_answers = self.stream_snapshots = self._late_under_way = 0
        self._refreshing = set()

    def stats(self, stream_connected: bool) -> ClientStats:
        return ClientStats(
            mode=self.mode,
            remote_selects=self.remote_selects,
            local_selects=self.local_selects,
            detour_failures=self.calls.failures,
            pending_reports=len(self.pending),
            dropped_reports=self.pending.dropped,
            expired_reports=self.pending.expired,
            sent_reports=self.pending.sent,
            stream_connected=stream_connected,
            clock_offset_ms=self.service_clock.offset_ms if self.cached else None,
            rejected_calls=self.calls.rejected,
            last_rejected_status=self.calls.last_rejected_status,
            bad_answers=self.calls.bad_answers,
            stream_too_large=self.calls.stream_too_large,
            late_answers=self.late_answers,
            stream_snapshots=self.stream_snapshots,
        )
