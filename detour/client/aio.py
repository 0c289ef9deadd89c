"""``AsyncDetourClient``: the asyncio producer SDK.

The same rules as ``DetourClient`` (the shared ``ClientCore`` decides them),
with one ``httpx.AsyncClient`` and asyncio tasks instead of threads. Its send
loop also cuts each ``deliver`` at the deadline's time left, which a blocking
call cannot do. Use it from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
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
from detour.client.http import AsyncHTTP, Parse, headers, json_object
from detour.client.pending import Pending
from detour.client.send import ExcTypes, send_async
from detour.client.sse import MAX_EVENT_BYTES
from detour.client.tasks import FlushTask, StreamTask, flush_once
from detour.client.values import ClientStats, Mode, Report, SelectedQueue, SendResult
from detour.clock import mono_ms

log = logging.getLogger("detour.client")

P = TypeVar("P")
R = TypeVar("R")
#: What a late call's outcome is handed to: its answer, or its error.
Late = Callable[[Any, BaseException | None], None]


class _RouteFetch:
    """A fetch of one topic's route under way; ``missing``: Detour's 404 message;
    ``failed``: why Detour could not be asked (for the error a select raises without it)."""

    __slots__ = ("done", "failed", "missing")

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.missing: str | None = None
        self.failed: BaseException | None = None


class AsyncDetourClient:
    """An asyncio Detour client; ``async with`` it or ``await aclose()``.

    Settings as ``DetourClient`` (seconds for ``timeout``, ``deadline`` and the
    circuit breaker); ``timeout`` bounds each call as a whole. Background tasks
    (cached mode's stream reader, the report flusher) start on first use inside
    the loop.

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
        transport: httpx.AsyncBaseTransport | None = None,
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
        self._headers = headers(token)
        #: Calls a send stopped waiting for, and background refreshes, still going on.
        self._background: set[asyncio.Task[Any]] = set()
        self._http = AsyncHTTP(self.url, timeout, token, transport)
        self._flusher: FlushTask | None = None
        self._stream: StreamTask | None = None
        #: route fetches under way, by topic (``_fetch_route``)
        self._route_fetches: dict[str, _RouteFetch] = {}
        self._closed = False
        #: the timer that queues the next in-flight signal, and when it fires (mono ms)
        self._signal_timer: asyncio.TimerHandle | None = None
        self._signal_at = math.inf

    # -- lifecycle ---------------------------------------------------------------
    async def __aenter__(self) -> AsyncDetourClient:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _start(self) -> None:
        if self._core.cached and self._stream is None and not self._closed:
            self._stream = StreamTask(self._core, self.url, self._headers)
            self._flusher = FlushTask(self._core, self._background_call)

    async def aclose(self, flush_timeout: float | None = None) -> None:
        """Stop the background tasks, send what is pending (at most ``flush_timeout``
        seconds, default the call timeout), close the connections."""
        if self._closed:
            return
        self._closed = True
        core = self._core
        if self._signal_timer is not None:
            self._signal_timer.cancel()
        if self._stream is not None:
            await self._stream.stop()
        if self._flusher is not None:
            await self._flusher.stop()
        if self._background:
            # They end within the call timeout; a late report that failed is queued, and
            # the final flush sends it.
            await asyncio.wait(set(self._background), timeout=core.timeout + 1.0)
        await self.flush(core.timeout if flush_timeout is None else flush_timeout)
        left = core.pending.abandon()
        if left:
            log.warning("detour client closed with %d reports unsent", left)
        await self._http.aclose()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the client can decide: cached mode has its
        first snapshot, remote mode gets an answer from ``/readyz``."""
        self._start()
        if self._stream is not None:
            try:
                async with asyncio.timeout(timeout):  # not wait_for: see tasks.FlushTask
                    await self._stream.synced.wait()
                return True
            except TimeoutError:
                return False
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._http.call("GET", "/readyz")
                return True
            except (DetourUnavailable, DetourRequestError):
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    async def flush(self, timeout: float) -> bool:
        """Send every pending report now, for at most ``timeout`` seconds, calls to Detour
        included; True when none is left."""
        deadline = time.monotonic() + timeout

        async def call(method: str, path: str, body: object, parse: Parse[Any]) -> Any:
            return await self._call(method, path, body, parse, ends=deadline, background=True)

        pending = self._core.pending
        while len(pending):
            if pending.queued() and await flush_once(self._core, call):
                continue
            # Refused or failed: wait out the open circuit (it is what refused) and try
            # again until the deadline, instead of dropping what is pending. Or the
            # background flusher has the last batch in flight: see how it ends.
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(left, max(0.01, self._core.circuit.remaining_s())))
        return len(pending) == 0

    def stats(self) -> ClientStats:
        return self._core.stats(self._stream is not None and self._stream.connected)

    # -- the calls ---------------------------------------------------------------
    async def _call(
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
            return await self._http.call(method, path, body, parse, budget)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._end(ticket, error)

    def _end(self, ticket: Ticket, error: BaseException | None) -> None:
        core = self._core
        if core.calls.end(ticket, error) and core.pending.queued():
            self._wake_flusher()

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _deciding_call(
        self,
        method: str,
        path: str,
        body: object,
        parse: Parse[Any],
        ends: float | None,
        late: Late,
    ) -> Any:
        """As ``DetourClient._deciding_call``: the answer within the decision deadline, or
        DetourLate while the call goes on; ``late(answer, error)`` gets its outcome."""
        core = self._core
        wait = core.decide_within
        if wait is None:
            return await self._call(method, path, body, parse, ends)
        ticket, budget = core.calls.begin(ends)
        task = asyncio.get_running_loop().create_task(
            self._http.call(method, path, body, parse, budget)
        )
        try:
            done, _ = await asyncio.wait({task}, timeout=min(wait, budget))
        except asyncio.CancelledError:
            self._finish_later(ticket, task, lambda answer, error: None)
            raise
        if not done:
            core.late()
            self._finish_later(ticket, task, late, counted=True)
            raise DetourLate(
                f"{method} {path}: no answer within {wait * 1000:.0f} ms; deciding locally"
            )
        try:
            answer = task.result()
        except BaseException as exc:
            self._end(ticket, exc)
            raise
        self._end(ticket, None)
        return answer

    def _finish_later(
        self, ticket: Ticket, task: asyncio.Task[Any], late: Late, counted: bool = False
    ) -> None:
        """``late`` gets the outcome of ``task`` once it ends (``counted``: a late call)."""

        def finished(done: asyncio.Task[Any]) -> None:
            error: BaseException | None
            if done.cancelled():
                error = DetourUnavailable("cancelled")
            else:
                error = done.exception()
            try:
                late(None if error is not None else done.result(), error)
            except Exception:  # noqa: BLE001 - a callback: log, carry on
                log.exception("a late answer from Detour could not be taken")
            finally:
                # Taught first, then calls resume (and the circuit has the call's verdict).
                self._end(ticket, error)
                if counted:
                    self._core.late_ended()

        self._keep(task)
        task.add_done_callback(finished)

    async def _background_call(
        self, method: str, path: str, body: object, parse: Parse[Any]
    ) -> Any:
        """The flusher's call: a report batch, which no send waits for."""
        return await self._call(method, path, body, parse, background=True)

    def _wake_flusher(self) -> None:
        if self._flusher is None and not self._closed:
            self._flusher = FlushTask(self._core, self._background_call)
        if self._flusher is not None:
            self._flusher.wake()

    async def select(
        self, topic: str, last_broker: str | None = None, sharding_key: str | None = None
    ) -> SelectedQueue:
        """The queue for one send attempt; as ``DetourClient.select``, same errors."""
        if sharding_key is not None:
            wire.check_sharding_key(sharding_key)
        core = self._core
        if self._stream is not None:  # cached mode, the table first (as DetourClient.select)
            selected = core.table.select(topic, last_broker, sharding_key)
            if selected is not None:
                core.local_selects += 1
                return selected
        return await self._select(topic, last_broker, None, sharding_key)

    async def _select(
        self,
        topic: str,
        last_broker: str | None,
        ends: float | None,
        sharding_key: str | None = None,
    ) -> SelectedQueue:
        core = self._core
        if core.cached:
            self._start()
            stream = self._stream
            assert stream is not None
            if not core.table.has_route(topic):
                if not stream.synced.is_set():
                    try:
                        async with asyncio.timeout(core.snapshot_wait_s(ends)):
                            await stream.synced.wait()
                    except TimeoutError:
                        pass
                if not core.table.has_route(topic):
                    cause = await self._fetch_route(topic, ends)
                    return core.local_select(topic, last_broker, cause, sharding_key=sharding_key)
            return core.local_select(topic, last_broker, sharding_key=sharding_key)
        # A topic the client could not decide for waits for the whole call (below).
        known = core.knows(topic)
        if not core.table.has_route(topic):
            # Detour's answer is followed only if the route agrees with it: the route first.
            cause = await self._fetch_route(topic, ends)
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
                selected = await self._deciding_call("POST", "/select", body, parse, ends, late)
            else:  # nothing to decide with locally: the whole call
                selected = await self._call("POST", "/select", body, parse, ends)
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
            await self._refresh(topic, ends)  # what a local select will need, before then
        elif any(core.refresh_due(topic)) and core.claim_refresh(topic):
            self._keep(asyncio.get_running_loop().create_task(self._refresh_in_background(topic)))
        return selected  # type: ignore[no-any-return]

    async def _refresh_in_background(self, topic: str) -> None:
        rounds = REFRESH_ROUNDS
        try:
            while True:
                rounds -= 1
                await self._refresh(topic, None)
                if self._core.release_refresh(topic, rounds):
                    return
        except BaseException:
            self._core.release_refresh(topic)
            raise

    def _take_answer(self, topic: str, selected: SelectedQueue) -> bool:
        """As ``DetourClient._take_answer``."""
        core = self._core
        try:
            core.check_answer(selected)
        except DetourBadAnswer as exc:
            core.calls.refused(exc)
            core.route_stale(topic)
            return False
        core.learn(selected)
        return True

    async def _fetch_route(self, topic: str, ends: float | None) -> BaseException | None:
        """As ``DetourClient._fetch_route``: one fetch per topic at a time, waited for by
        the others within their sends; TopicNotFound on Detour's 404."""
        core = self._core
        fetch = self._route_fetches.get(topic)
        mine = fetch is None and len(self._route_fetches) < MAX_ROUTE_FETCHES
        if mine:
            fetch = self._route_fetches[topic] = _RouteFetch()
        if fetch is None:
            return None  # too many under way: fail open
        if not mine:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(core.left_s(ends)):
                    await fetch.done.wait()
        else:
            try:
                fetch.missing, fetch.failed = await self._get_route(topic, ends)
            finally:
                del self._route_fetches[topic]
                fetch.done.set()
        if fetch.missing is not None:
            raise TopicNotFound(topic, fetch.missing)
        return fetch.failed

    async def _get_route(
        self, topic: str, ends: float | None
    ) -> tuple[str | None, BaseException | None]:
        """As ``DetourClient._get_route``."""
        core = self._core
        answered, asked = False, core.route_asking(topic)
        try:
            path = f"/routes/{quote(topic, safe='')}"
            core.route_fetched(
                topic, await self._call("GET", path, parse=wire.route, ends=ends), asked
            )
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

    async def _refresh(self, topic: str, ends: float | None) -> None:
        """Best effort: the route and config a local select needs if Detour goes away."""
        core = self._core
        route_due, config_due = core.refresh_due(topic)
        if config_due:
            answered, installed, config_asked = False, False, core.config_asking()
            try:
                installed = core.config_fetched(
                    await self._call("GET", "/config", parse=wire.config, ends=ends), config_asked
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
                    topic, await self._call("GET", path, parse=wire.route, ends=ends), asked
                )
                answered = True
            except DetourRequestError as exc:
                answered = True
                if exc.status == 404:
                    core.route_fetched(topic, None, asked)
            except DetourUnavailable:
                pass
            core.route_checked(topic, answered, asked)

    async def report(self, broker_name: str, latency_ms: float, isolation: bool = False) -> None:
        """Report one send (latency in ms, ``isolation`` when it failed); as
        ``DetourClient.report``, same errors."""
        await self._report(broker_name, latency_ms, isolation, None)

    async def _report(
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
            expired = await self._deciding_call("POST", "/report-latency", body, parse, ends, late)
        except DetourLate:
            pass  # it goes on; ``late`` takes its outcome
        except DetourUnavailable:
            self._queue([p])  # (a bad answer too: the report may not have reached Detour)
        except DetourRequestError:
            core.pending.answered(refused=1)
            raise
        else:
            core.pending.answered(sent=not expired, expired=bool(expired))

    async def report_batch(self, reports: Iterable[Report]) -> None:
        """Report many sends, 1,000 per batch call; as ``DetourClient.report_batch``."""
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
                expired = await self._call(
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
        if core.cached:
            self._start()
        if first or not core.cached or core.pending.urgent or core.pending.queued() >= FLUSH_AT:
            self._wake_flusher()

    async def send(
        self,
        topic: str,
        payload: P,
        deliver: Callable[[SelectedQueue, P], Awaitable[R]],
        *,
        no_retry: ExcTypes = (),
    ) -> SendResult[R]:
        """RocketMQ's send loop with an async ``deliver(queue, payload)``, each call cut
        at the deadline's time left (TimeoutError, reported as an isolation).

        Returns and raises as ``DetourClient.send``.
        """
        core = self._core
        ends = time.monotonic() + core.deadline
        return await send_async(
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
    def _tracked(
        self, deliver: Callable[[SelectedQueue, P], Awaitable[R]]
    ) -> Callable[[SelectedQueue, P], Awaitable[R]]:
        """``deliver`` with each call tracked as an outstanding send (``core.inflight``);
        one loop timer queues a pending report when a send is due (the sync client's
        signal thread, without a thread)."""
        inflight = self._core.inflight

        async def tracked(queue: SelectedQueue, payload: P) -> R:
            with inflight.track(queue.broker_name, mono_ms, self._arm_signal):
                return await deliver(queue, payload)

        return tracked

    def _arm_signal(self, due_ms: float) -> None:
        if due_ms >= self._signal_at or self._closed:
            return
        if self._signal_timer is not None:
            self._signal_timer.cancel()
        loop = asyncio.get_running_loop()
        self._signal_at = due_ms
        self._signal_timer = loop.call_later(
            max(0.0, (due_ms - mono_ms()) / 1000), self._fire_signals
        )

    def _fire_signals(self) -> None:
        self._signal_timer, self._signal_at = None, math.inf
        items = self._core.due_signals(mono_ms())
        if items:
            self._queue(items)
        nxt = self._core.inflight.next_due_ms()
        if nxt is not None:
            self._arm_signal(nxt)


def _batch_result(answer: Any, names: list[str]) -> list[bool]:
    return wire.batch_result(answer, names)
