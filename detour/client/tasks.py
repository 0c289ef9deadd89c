"""The async client's background tasks: the report flusher and the event-stream reader.

The asyncio twins of ``detour.client.threads``: same rules (never raise,
reconnect with jitter, flush when ``ClientCore.flush_due_in`` says), stopped by
cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from detour.client import wire
from detour.client.cached import STREAM_IDLE_S, STREAM_PATH
from detour.client.core import ClientCore
from detour.client.errors import DetourRequestError, DetourUnavailable
from detour.client.http import LIMITS, Parse, check_stream
from detour.client.reconnect import Jitter, stream_connect_s, stream_jitter
from detour.client.sse import EventTooLarge, SSEParser
from detour.clock import mono_ms
from detour.view import CHANGES_PER_TURN

log = logging.getLogger("detour.client")

#: A report batch's call: (method, path, body, parse) -> the parsed answer.
AsyncCall = Callable[[str, str, object, Parse[Any]], Awaitable[Any]]


async def flush_once(core: ClientCore, call: AsyncCall) -> bool:
    """Send the oldest reports (up to ``core.batch_size``) in one batch; True when Detour
    took them.

    Never raises (but lets cancellation through, putting the batch back first).
    """
    batch = core.pending.take(core.batch_size)
    if not batch:
        return True
    names = [p.broker_name for p in batch]
    try:
        expired = await call(
            "POST",
            "/report-latency:batch",
            core.batch_body(batch),
            lambda answer: wire.batch_result(answer, names),
        )
    except DetourRequestError as exc:
        log.error("detour refused %d reports, dropped: %s", len(batch), exc)
        core.settled(batch, accepted=False)
        return False
    except DetourUnavailable as exc:
        log.debug("report batch not sent: %s", exc)
        core.pending.retry(batch)
        core.batch_answered(False)
        return False
    except BaseException as exc:
        core.pending.retry(batch)
        if not isinstance(exc, Exception):
            raise
        log.exception("report batch failed")
        return False
    core.settled(batch, accepted=True, expired=sum(expired))
    core.batch_answered(True)
    return True


class FlushTask:
    def __init__(self, core: ClientCore, call: AsyncCall) -> None:
        self._core = core
        self._call = call
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="detour-flush")

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        core = self._core
        while True:
            due = core.flush_due_in()
            if due is None or due > 0:
                # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that
                # lands as the wake-up does, and stop() would then wait forever.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(due):
                        await self._wake.wait()
                self._wake.clear()
                continue
            if not await flush_once(core, self._call) and core.circuit.remaining_s() == 0:
                await asyncio.sleep(core.timeout)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class StreamTask:
    """Follows ``GET /fault-items/stream``; ``synced`` after the first snapshot,
    ``connected`` while a stream is delivering. Bounded, and woken from its backoff by an
    answered call, as ``StreamThread``."""

    def __init__(self, core: ClientCore, base_url: str, headers: dict[str, str]) -> None:
        self._core = core
        self.synced = asyncio.Event()
        self.connected = False
        #: set by an answered call (``Calls.on_answer``, made in this loop): ends a backoff
        self._wake = asyncio.Event()
        core.calls.on_answer = self._wake.set
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers={**headers, "Accept": "text/event-stream"},
            timeout=httpx.Timeout(stream_connect_s(core.timeout), read=STREAM_IDLE_S),
            transport=httpx.AsyncHTTPTransport(limits=LIMITS),
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="detour-stream")

    async def _run(self) -> None:
        jitter = stream_jitter(random.random)
        calls = self._core.calls
        while True:
            try:
                await self._follow(jitter)
            except EventTooLarge as exc:
                calls.stream_dropped_too_large(str(exc))
            except DetourUnavailable as exc:
                calls.note(exc)  # a rejection or a bad answer is logged loudly there
                log.info("detour event stream unavailable: %s", exc)
            except (
                httpx.HTTPError,
                TimeoutError,
                KeyError,
                TypeError,
                ValueError,
                AttributeError,
            ) as exc:
                log.info("detour event stream lost: %r", exc)
            except Exception:  # noqa: BLE001 - never let the reader die
                log.exception("detour event stream failed")
            finally:
                self.connected = False
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), jitter.next_s())

    async def _follow(self, jitter: Jitter) -> None:
        core = self._core
        request = self._http.build_request("GET", STREAM_PATH)
        # connecting and the headers
        async with asyncio.timeout(stream_connect_s(core.timeout)):
            r = await self._http.send(request, stream=True)
        try:
            check_stream(r, f"GET {STREAM_PATH}")
            parser = SSEParser(core.max_event_bytes)
            applier = core.applier
            core.service_clock.reconnected()
            applied = 0
            async for chunk in r.aiter_raw():
                for event in parser.feed_bytes(chunk):
                    applier.handle(event, mono_ms())
                    if event.kind == "snapshot":
                        core.stream_snapshots += 1
                        self.connected = True
                        self.synced.set()
                        jitter.reset()
                    applied += 1
                    if applied % CHANGES_PER_TURN == 0:
                        await asyncio.sleep(0)  # (one chunk can hold hundreds of events)
        finally:
            await r.aclose()

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._http.aclose()
