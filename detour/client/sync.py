"""``DetourClient``: the blocking producer SDK, for threads and plain scripts.

One ``httpx.Client`` (pooled keep-alive connections) shared by every thread
that produces. Detour is asked for every select in remote mode; in cached mode
selects never leave the process. Either way a producer keeps sending when
Detour is down (see ``detour.client`` for the rules).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from detour.client import wire
from detour.client.cached import FLUSH_AT
from detour.client.circuit import Ticket
from detour.client.core import (
    DECIDE_WITHIN_S,
    MAX_ROUTE_FETCHES,
    REFRESH_ROUNDS,
    ClientCore,
)
from detour.client.errors import (
    DetourBadAnswer,
    DetourLate,
    DetourRequestError,
    DetourUnavailable,
    TopicNotFound,
)
from detour.client.http import LIMITS, Parse, SyncHTTP, headers, json_object
from detour.client.pending import Pending
from detour.client.send import ExcTypes, send_sync
from detour.client.sse import MAX_EVENT_BYTES
from detour.client.threads import FlushThread, SignalThread, StreamThread, flush_once
from detour.client.values import ClientStats, Mode, Report, SelectedQueue, SendResult
from detour.clock import mono_ms

log = logging.getLogger("detour.client")

P = TypeVar("P")
R = TypeVar("R")
#: What a late call's outcome is handed to: its answer, or its error.
Late = Callable[[Any, BaseException | None], None]


def _after_fork(ref: weakref.ref[DetourClient]) -> None:
    client = ref()
    if client is not None:
        client._after_fork()


class _RouteFetch:
    """A fetch of one topic's route under way; ``missing``: Detour's 404 message;
    ``failed``: why Detour could not be asked (for the error a select raises without it)."""

    __slots__ = ("done", "failed", "missing")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.missing: str | None = None
        self.failed: BaseException | None = None


class DetourClient:
    """A blocking Detour client. Thread-safe; use it as a context manager or ``close()`` it.

    ``url``: Detour's base URL. ``timeout``: seconds per call to Detour, in total:
    connecting, headers and body (default 0.2). ``token``: sent as
    ``Authorization: Bearer <token>``. ``mode``: ``"remote"`` (default) or
    ``"cached"``. ``retries``: extra attempts per send (default 2, RocketMQ's
    ``retryTimesWhenSendFailed``). ``deadline``: seconds for all attempts of one
    send (default 3, RocketMQ's send timeout); the send's calls to Detour end by
    it too. ``max_pending``: reports kept while Detour is unreachable (oldest
    dropped). ``backoff_initial``/``backoff_max``: seconds the circuit breaker
    stays open (no call to Detour) after a failure, doubling per failure.
    ``producer``: this producer's id (host, pod, executor), sent with every report
    for Detour's latency log. ``max_event_bytes``: cached mode's bound on one
    event-stream line or event. ``transport``: an httpx transport replacing the
    one that enforces the total timeout (tests). ``pending_factor``/``pending_floor_ms``:
    a send outstanding ``max(floor, factor x the broker's recent p99)`` tells Detour
    (an in-flight signal, only while Detour's config has ``pendingQuorum`` > 0; factor
    0 = never), see ``detour.client.inflight``. ``decide_within``: remote mode, seconds a
    send waits for Detour's select or report before it decides locally (default 0.003;
    None: the whole ``timeout``); the call goes on in the background and its answer still
    teaches the client (the brokers it avoided, the circuit). A topic whose route the
    client does not know yet waits for the whole call.

    Raises ValueError for an invalid setting.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 0.2,
        token: str | None = None,
        mode: Mode = "remote",
        retries: int = 2,
        deadline: float = 3.0,
        max_pending: int = 10_000,
        backoff_initial: float = 0.5,
        backoff_max: float = 5.0,
        producer: str | None = None,
        max_event_bytes: int = MAX_EVENT_BYTES,
        transport: httpx.BaseTransport | None = None,
        pending_factor: float = 4.0,
        pending_floor_ms: float = 50.0,
        decide_within: float | None = DECIDE_WITHIN_S,
    ) -> None:
        self._core = ClientCore(
            mode,
            timeout=timeout,
            retries=retries,
            deadline=deadline,
            max_pending=max_pending,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            producer=producer,
            max_event_bytes=max_event_bytes,
            pending_factor=pending_factor,
            pending_floor_ms=pending_floor_ms,
            decide_within=decide_within,
        )
        self.url = url.rstrip("/")
        self._http = SyncHTTP(self.url, timeout, token, transport)
        self._token, self._transport = token, transport
        #: Calls a send stopped waiting for (and background refreshes) finish here.
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._flusher: FlushThread | None = None
        self._stream: StreamThread | None = None
        self._signals: SignalThread | None = None
        #: route fetches under way, by topic (``_fetch_route``)
        self._route_fetches: dict[str, _RouteFetch] = {}
        self._closed = False
        if self._core.cached:
            self._stream = StreamThread(self._core, self.url, headers(token))
            self._flusher = FlushThread(self._core, self._background_call)
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    def _after_fork(self) -> None:
        """In a forked child (remote mode): the parent's threads are not here, and its
        pooled connections are the parent's (two processes on one keep-alive socket read
        each other's answers). So: new locks, a new connection pool, calls and the
        flusher started anew when needed. The core has already taken a new report id
        prefix, an empty queue and fresh counters (``ClientCore.after_fork``). A cached
        client's stream is not restarted: fork before making one, or make one per child."""
        self._lock = threading.Lock()
        self._pool = None
        self._signals = None
        self._route_fetches = {}
        if self._stream is None:
            self._flusher = None
        if not self._closed:
            self._http = SyncHTTP(self.url, self._core.timeout, self._token, self._transport)

    # -- lifecycle ---------------------------------------------------------------
    def __enter__(self) -> DetourClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self, flush_timeout: float | None = None) -> None:
        """Stop the background threads, send what is pending, close the connections.

        The final flush takes at most ``flush_timeout`` seconds (default: the call
        timeout); reports still unsent then are logged and counted as dropped.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        core = self._core
        if self._stream is not None:
            self._stream.stop(core.timeout + 1.0)
        if self._signals is not None:
            self._signals.stop(core.timeout + 1.0)
        if self._flusher is not None:
            self._flusher.stop(core.timeout + 1.0)
        if self._pool is not None:
            # Calls still going on end within the call timeout; a late report that failed
            # is queued, and the final flush sends it.
            self._pool.shutdown(wait=True)
        self.flush(core.timeout if flush_timeout is None else flush_timeout)
        left = core.pending.abandon()
        if left:
            log.warning("detour client closed with %d reports unsent", left)
        self._http.close()

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the client can decide: in cached mode the
        first snapshot has arrived, in remote mode Detour answers ``/readyz``."""
        if self._stream is not None:
            return self._stream.synced.wait(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._http.call("GET", "/readyz")
                return True
            except (DetourUnavailable, DetourRequestError):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def flush(self, timeout: float) -> bool:
        """Send every pending report now, for at most ``timeout`` seconds, calls to Detour
        included; True when none is left."""
        deadline = time.monotonic() + timeout

        def call(method: str, path: str, body: object, parse: Parse[Any]) -> Any:
            return self._call(method, path, body, parse, ends=deadline, background=True)

        pending = self._core.pending
        while len(pending):
            if pending.queued() and flush_once(self._core, call):
                continue
            # Refused or failed: wait out the open circuit (it is what refused) and try
            # again until the deadline, instead of dropping what is pending. Or the
            # background flusher has the last batch in flight: see how it ends.
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, max(0.01, self._core.circuit.remaining_s())))
        return len(pending) == 0

    def stats(self) -> ClientStats:
        return self._core.stats(self._stream is not None and self._stream.connected.is_set())

    # -- the calls ---------------------------------------------------------------
    def _call(
        self,
        method: str,
        path: str,
        body: object = None,
        parse: Parse[Any] = json_object,
        ends: float | None = None,
        background: bool = False,
    ) -> Any:
        """One call through the circuit, within the timeout (longer for a ``background``
        report batch) and, when ``ends`` (monotonic s) is given, the send's deadline.
        Raises DetourUnavailable (also while the circuit is open) or DetourRequestError."""
        core = self._core
        ticket, budget = core.calls.begin(ends, background)
        error: BaseException | None = None
        try:
            return self._http.call(method, path, body, parse, budget)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._end(ticket, error)

    def _end(self, ticket: Ticket, error: BaseException | None) -> None:
        core = self._core
        if core.calls.end(ticket, error) and core.pending.queued():
            self._wake_flusher()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        LIMITS.max_connections, thread_name_prefix="detour-call"
                    )
        return self._pool

    def _deciding_call(
        self,
        method: str,
        path: str,
        body: object,
        parse: Parse[Any],
        ends: float | None,
        late: Late,
    ) -> Any:
        """A call a send waits for at most the decision deadline (``decide_within``).

        Its answer, or DetourLate (a DetourUnavailable: decide locally) while the call goes
        on in the background; ``late(answer, error)`` then gets its outcome, and the circuit
        its verdict. Raises as ``_call`` otherwise."""
        core = self._core
        wait = core.decide_within
        if wait is None:
            return self._call(method, path, body, parse, ends)
        ticket, budget = core.calls.begin(ends)
        try:
            future = self._executor().submit(self._http.call, method, path, body, parse, budget)
        except RuntimeError as exc:  # closed meanwhile
            self._end(ticket, DetourUnavailable(str(exc)))
            raise DetourUnavailable(f"{method} {path}: the client is closed") from exc
        try:
            answer = future.result(timeout=min(wait, budget))
        except TimeoutError:
            core.late()
            future.add_done_callback(lambda done: self._finish_late(ticket, done, late))
            raise DetourLate(
                f"{method} {path}: no answer within {wait * 1000:.0f} ms; deciding locally"
            ) from None
        except BaseException as exc:
            self._end(ticket, exc)
            raise
        self._end(ticket, None)
        return answer

    def _finish_late(self, ticket: Ticket, done: Future[Any], late: Late) -> None:
        error = done.exception()
        try:
            late(None if error is not None else done.result(), error)
        except Exception:  # noqa: BLE001 - a background thread: log, carry on
            log.exception("a late answer from Detour could not be taken")
        finally:
            # Taught first, then calls resume (and the circuit has the call's verdict).
            self._end(ticket, error)
            self._core.late_ended()

    def _background_call(self, method: str, path: str, body: object, parse: Parse[Any]) -> Any:
        """The flusher's call: a report batch, which no send waits for."""
        return self._call(method, path, body, parse, background=True)

    def _wake_flusher(self) -> None:
        flusher = self._flusher
        if flusher is None:
            with self._lock:
                if self._flusher is None and not self._closed:
                    self._flusher = FlushThread(self._core, self._background_call)
                flusher = self._flusher
        if flusher is not None:
            flusher.wake()

    def select(
        self, topic: str, last_broker: str | None = None, sharding_key: str | None = None
    ) -> SelectedQueue:
        """The queue for one send attempt; ``last_broker`` is the broker of this message's
        previous attempt (None for the first); ``sharding_key`` for ordered messages (the
        key's queue, see ``orderedFallback`` in docs/policy.md).

        Remote mode asks Detour and falls back to the local table when it does not
        answer, rejects the call or answers something else; cached mode decides
        in-process. Raises TopicNotFound for an unknown topic, DetourRequestError for
        another 4xx from Detour, DetourUnavailable when Detour cannot be followed and
        the topic's route has never been seen, ValueError for an invalid sharding key.
        """
        if sharding_key is not None:
            wire.check_sharding_key(sharding_key)
        core = self._core
        if self._stream is not None:
            # Cached mode, the table first and no call around it: a producer thread that
            # slept runs its first microseconds cold, and every call costs it
            # (docs/BENCHMARKS.md, "Cached decide in fewer calls"). None: no route known
            # yet, which ``_select`` waits for or fetches.
            selected = core.table.select(topic, last_broker, sharding_key)
            if selected is not None:
                core.local_selects += 1
                return selected
        return self._select(topic, last_broker, None, sharding_key)

    def _select(
        self,
        topic: str,
        last_broker: str | None,
        ends: float | None,
        sharding_key: str | None = None,
    ) -> SelectedQueue:
        core = self._core
        if self._stream is not None:
            if not core.table.has_route(topic):
                if not self._stream.synced.is_set():
                    self._stream.synced.wait(core.snapshot_wait_s(ends))
                if not core.table.has_route(topic):
                    cause = self._fetch_route(topic, ends)
                    return core.local_select(topic, last_broker, cause, sharding_key=sharding_key)
            return core.local_select(topic, last_broker, sharding_key=sharding_key)
        # A topic the client could not decide for waits for the whole call (below).
        known = core.knows(topic)
        if not core.table.has_route(topic):
            # Detour's answer is followed only if the route agrees with it: the route first.
            cause = self._fetch_route(topic, ends)
            if not core.table.has_route(topic):
                return core.local_select(topic, last_broker, cause, sharding_key=sharding_key)
        body = wire.select_body(topic, last_broker, core.producer, sharding_key)

        def parse(answer: Any) -> SelectedQueue:
            return wire.selected(answer, topic)

        def late(answer: Any, error: BaseException | None) -> None:
            if answer is not None:
                self._take_answer(topic, answer)

        try:
            if known:
                if core.slow():
                    raise DetourLate("a call to Detour is late: deciding locally meanwhile")
                selected = self._deciding_call("POST", "/select", body, parse, ends, late)
            else:  # nothing to decide with locally: the whole call
                selected = self._call("POST", "/select", body, parse, ends)
        except DetourUnavailable as exc:
            return core.local_select(topic, last_broker, cause=exc, sharding_key=sharding_key)
        except DetourRequestError as exc:
            if exc.status == 404:
                raise TopicNotFound(topic, exc.message) from None
            raise
        if not self._take_answer(topic, selected):
            return core.local_select(topic, last_broker, cause=None, sharding_key=sharding_key)
        core.remote_selects += 1
        if not core.knows(topic):
            self._refresh(topic, ends)  # what a local select will need, before it is needed
        elif any(core.refresh_due(topic)) and core.claim_refresh(topic):
            self._executor().submit(self._refresh_in_background, topic)
        return selected  # type: ignore[no-any-return]

    def _refresh_in_background(self, topic: str) -> None:
        rounds = REFRESH_ROUNDS
        try:
            while True:
                rounds -= 1
                self._refresh(topic, None)
                if self._core.release_refresh(topic, rounds):
                    return
        except BaseException:
            self._core.release_refresh(topic)
            raise

    def _take_answer(self, topic: str, selected: SelectedQueue) -> bool:
        """Whether Detour's answer (on time or late) is one to follow: its queue is in the
        known route. If so it teaches the local table; if not it is refused (a bad answer)
        and the route fetched again."""
        core = self._core
        try:
            core.check_answer(selected)
        except DetourBadAnswer as exc:
            core.calls.refused(exc)
            core.route_stale(topic)
            return False
        core.learn(selected)
        return True

    def _fetch_route(self, topic: str, ends: float | None) -> BaseException | None:
        """The route of a topic this client knows none of, by ``ends``: a remote select
        checks Detour's answer against it, a cached one decides with it (no snapshot yet,
        or a route the copy has not been pushed yet).

        One fetch per topic at a time (``MAX_ROUTE_FETCHES`` topics at most): a select
        that finds one under way waits for it, within its send. Raises TopicNotFound when
        Detour answers 404 for the route (DetourRequestError for another of its 4xx);
        otherwise returns why Detour could not be asked for it (None when it answered)."""
        core = self._core
        with self._lock:
            fetch = self._route_fetches.get(topic)
            mine = fetch is None and len(self._route_fetches) < MAX_ROUTE_FETCHES
            if mine:
                fetch = self._route_fetches[topic] = _RouteFetch()
        if fetch is None:
            return None  # too many under way: fail open
        if not mine:
            fetch.done.wait(core.left_s(ends))
        else:
            try:
                fetch.missing, fetch.failed = self._get_route(topic, ends)
            finally:
                with self._lock:
                    del self._route_fetches[topic]
                fetch.done.set()
        if fetch.missing is not None:
            raise TopicNotFound(topic, fetch.missing)
        return fetch.failed

    def _get_route(self, topic: str, ends: float | None) -> tuple[str | None, BaseException | None]:
        """GET the route into the table; Detour's 404 message when it has none, else None.
        Raises DetourRequestError for Detour's other 4xx."""
        core = self._core
        answered, asked = False, core.route_asking(topic)
        try:
            path = f"/routes/{quote(topic, safe='')}"
            core.route_fetched(topic, self._call("GET", path, parse=wire.route, ends=ends), asked)
            answered = True
        except DetourRequestError as exc:
            answered = True
            if exc.status == 404:
                return exc.message, None
            raise  # Detour's own 4xx: a wrong request (an invalid topic name)
        except DetourUnavailable as exc:
            return None, exc
        finally:
            core.route_checked(topic, answered, asked)
        return None, None

    def _refresh(self, topic: str, ends: float | None) -> None:
        """Best effort: the route and config a local select needs if Detour goes away."""
        core = self._core
        route_due, config_due = core.refresh_due(topic)
        if config_due:
            answered, installed, config_asked = False, False, core.config_asking()
            try:
                installed = core.config_fetched(
                    self._call("GET", "/config", parse=wire.config, ends=ends), config_asked
                )
                answered = True
            except (DetourUnavailable, DetourRequestError):
                pass
            core.config_checked(answered, installed)
        if route_due:
            answered, asked = False, core.route_asking(topic)
            try:
                path = f"/routes/{quote(topic, safe='')}"
                core.route_fetched(
                    topic, self._call("GET", path, parse=wire.route, ends=ends), asked
                )
                answered = True
            except DetourRequestError as exc:
                answered = True
                if exc.status == 404:
                    core.route_fetched(topic, None, asked)
            except DetourUnavailable:
                pass
            core.route_checked(topic, answered, asked)

    def report(self, broker_name: str, latency_ms: float, isolation: bool = False) -> None:
        """Report one send to ``broker_name``: its latency in ms (monotonic clock), and
        ``isolation=True`` when it failed.

        Applied to the local table at once. Remote mode posts it (or queues it
        while Detour is unavailable); cached mode queues it for the next batch
        (an isolation leaves at once). Raises ValueError for a report Detour would
        refuse (name, 0..3,600,000 ms), DetourRequestError when Detour refuses it.
        """
        self._report(broker_name, latency_ms, isolation, None)

    def _report(
        self, broker_name: str, latency_ms: float, isolation: bool, ends: float | None
    ) -> None:
        core = self._core
        p = core.record(broker_name, latency_ms, isolation)
        if core.must_queue():
            self._queue([p])
            core.apply([p])
            return
        core.apply([p])
        body = wire.report_body(
            broker_name, latency_ms, bool(isolation), core.producer, core.report_id(p)
        )

        def parse(answer: Any) -> bool:
            return wire.report_result(answer, broker_name)

        def late(answer: Any, error: BaseException | None) -> None:
            if error is None:
                core.pending.answered(sent=not answer, expired=bool(answer))
            elif isinstance(error, DetourUnavailable):
                self._queue([p])  # replayed with its age and id, as any report Detour missed
            else:
                core.pending.answered(refused=1)
                log.warning("detour refused a report for %s: %s", broker_name, error)

        try:
            expired = self._deciding_call("POST", "/report-latency", body, parse, ends, late)
        except DetourLate:
            pass  # it goes on; ``late`` takes its outcome
        except DetourUnavailable:
            self._queue([p])  # (a bad answer too: the report may not have reached Detour)
        except DetourRequestError:
            core.pending.answered(refused=1)
            raise
        else:
            core.pending.answered(sent=not expired, expired=bool(expired))

    def report_batch(self, reports: Iterable[Report]) -> None:
        """Report many sends, 1,000 per ``POST /report-latency:batch``; each ``Report``'s
        ``age_ms`` says how long ago its send completed.

        Raises ValueError before anything is applied when one report is invalid,
        DetourRequestError when Detour refuses a batch.
        """
        core = self._core
        items = core.record_all(reports)
        if core.must_queue():
            self._queue(items)
            core.apply(items)
            return
        core.apply(items)
        for i in range(0, len(items), wire.MAX_BATCH):
            chunk = items[i : i + wire.MAX_BATCH]
            names = [p.broker_name for p in chunk]
            try:
                expired = self._call(
                    "POST",
                    "/report-latency:batch",
                    core.batch_body(chunk),
                    parse=functools.partial(_batch_result, names=names),
                )
            except DetourUnavailable:
                self._queue(items[i:])  # (a bad answer too: replayed, the same ids)
                return
            except DetourRequestError:
                # This chunk is refused (counted); the chunks after it are queued, not lost.
                core.pending.answered(refused=len(chunk))
                if items[i + wire.MAX_BATCH :]:
                    self._queue(items[i + wire.MAX_BATCH :])
                raise
            core.pending.answered(sent=len(chunk) - sum(expired), expired=sum(expired))

    def _queue(self, items: list[Pending]) -> None:
        core = self._core
        # The flusher sleeps while nothing waits: wake it for the first report (it then
        # lingers up to 50 ms in cached mode), for an isolation, and at a full batch.
        first = core.pending.queued() == 0
        core.pending.add(items)
        if first or not core.cached or core.pending.urgent or core.pending.queued() >= FLUSH_AT:
            self._wake_flusher()

    def send(
        self,
        topic: str,
        payload: P,
        deliver: Callable[[SelectedQueue, P], R],
        *,
        no_retry: ExcTypes = (),
    ) -> SendResult[R]:
        """Send ``payload`` with RocketMQ's retry loop: ``deliver(queue, payload)`` is your
        send to the broker; up to ``1 + retries`` attempts within ``deadline`` seconds.

        Every attempt is reported (isolation when ``deliver`` raised). Calls to
        Detour end by the deadline too: past it, selects are decided locally and
        reports queued. Returns the successful queue, every attempt and what
        ``deliver`` returned. Raises SendError (every attempt's cause in
        ``attempts``), or the select's error when not even one attempt could start.
        """
        core = self._core
        ends = time.monotonic() + core.deadline
        return send_sync(
            topic,
            payload,
            self._tracked(deliver) if core.tracking() else deliver,
            select=lambda t, last: self._select(t, last, ends),
            report=lambda b, ms, iso: self._report(b, ms, iso, ends),
            retries=core.retries,
            deadline=core.deadline,
            no_retry=no_retry,
        )

    # -- in-flight signals ------------------------------------------------------
    def _tracked(self, deliver: Callable[[SelectedQueue, P], R]) -> Callable[[SelectedQueue, P], R]:
        """``deliver`` with each call tracked as an outstanding send (``core.inflight``);
        the signal thread queues a pending report when one is due. Never blocks or fails
        the send: tracking is a dict entry, the report leaves from the flusher."""
        inflight = self._core.inflight
        signals = self._signal_thread()
        wake = signals.poke if signals is not None else (lambda _due: None)

        def tracked(queue: SelectedQueue, payload: P) -> R:
            with inflight.track(queue.broker_name, mono_ms, wake):
                return deliver(queue, payload)

        return tracked

    def _signal_thread(self) -> SignalThread | None:
        if self._signals is None:
            with self._lock:
                if self._signals is None and not self._closed:
                    self._signals = SignalThread(self._core, self._queue)
        return self._signals


def _batch_result(answer: Any, names: list[str]) -> list[bool]:
    return wire.batch_result(answer, names)
