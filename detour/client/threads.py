"""The sync client's background threads: the report flusher and the event-stream reader.

Daemon threads, so a producer that forgets ``close()`` can still exit; neither
ever raises (a thread's exception would only reach a log nobody reads), they
log and carry on. Both stop promptly on ``stop()``: the flusher is woken, the
reader's socket is shut down under it.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from detour.client import wire
from detour.client.cached import STREAM_IDLE_S, STREAM_PATH
from detour.client.core import ClientCore
from detour.client.deadline import DeadlineTransport, call_deadline
from detour.client.errors import DetourRequestError, DetourUnavailable
from detour.client.http import Parse, check_stream
from detour.client.pending import Pending
from detour.client.reconnect import Jitter, stream_connect_s, stream_jitter
from detour.client.sse import EventTooLarge, SSEParser
from detour.clock import mono_ms

log = logging.getLogger("detour.client")

#: A report batch's call: (method, path, body, parse) -> the parsed answer.
BatchCall = Callable[[str, str, object, Parse[Any]], Any]


def flush_once(core: ClientCore, call: BatchCall) -> bool:
    """Send the oldest reports (up to ``core.batch_size``) in one batch; True when Detour
    took them.

    Never raises: a batch Detour does not answer, or answers with something that is not
    Detour's answer for it (``wire.batch_result``: a gateway's 200), goes back to the front of the
    queue; one it refuses (4xx, which the client's own checks should prevent) is
    dropped and counted, since resending it would fail the same way.
    """
    batch = core.pending.take(core.batch_size)
    if not batch:
        return True
    names = [p.broker_name for p in batch]
    try:
        expired = call(
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
    except Exception:  # noqa: BLE001 - keep the reports, log, carry on
        log.exception("report batch failed")
        core.pending.retry(batch)
        return False
    core.settled(batch, accepted=True, expired=sum(expired))
    core.batch_answered(True)
    return True


class FlushThread:
    """Sends queued reports when due (``ClientCore.flush_due_in``), until stopped."""

    def __init__(self, core: ClientCore, call: BatchCall) -> None:
        self._core = core
        self._call = call
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="detour-flush", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        core = self._core
        while not self._stop.is_set():
            due = core.flush_due_in()
            if due is None or due > 0:
                self._wake.wait(due)
                self._wake.clear()
                continue
            if not flush_once(core, self._call) and core.circuit.remaining_s() == 0:
                # Another caller holds the probe: give it the time of one call.
                self._stop.wait(core.timeout)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)


class StreamThread:
    """Follows ``GET /fault-items/stream`` and applies it to the core's table.

    Reconnects with jittered backoff (``reconnect.stream_jitter``: 0.1 s doubling to
    1 s, reset by a snapshot), and at once when another call is answered while it
    waits. ``synced`` is set by the first snapshot; ``connected`` while a stream is
    delivering. Connecting and the answer's headers take at most
    ``stream_connect_s``; then the stream may be silent ``STREAM_IDLE_S`` at
    most, and no line or event may be longer than ``core.max_event_bytes``.
    """

    def __init__(self, core: ClientCore, base_url: str, headers: dict[str, str]) -> None:
        self._core = core
        self.synced = threading.Event()
        self.connected = threading.Event()
        self._stop = threading.Event()
        #: set by an answered call (``Calls.on_answer``) or ``stop``: ends a backoff wait
        self._wake = threading.Event()
        core.calls.on_answer = self._wake.set
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._http = httpx.Client(
            base_url=base_url,
            headers={**headers, "Accept": "text/event-stream"},
            timeout=httpx.Timeout(stream_connect_s(core.timeout), read=STREAM_IDLE_S),
            transport=DeadlineTransport(httpx.Limits(max_connections=1)),
        )
        self._thread = threading.Thread(target=self._run, name="detour-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        jitter = stream_jitter(random.random)
        calls = self._core.calls
        try:
            while not self._stop.is_set():
                try:
                    self._follow(jitter)
                except EventTooLarge as exc:
                    calls.stream_dropped_too_large(str(exc))
                except DetourUnavailable as exc:
                    calls.note(exc)  # a rejection or a bad answer is logged loudly there
                    if not self._stop.is_set():
                        log.info("detour event stream unavailable: %s", exc)
                except (httpx.HTTPError, KeyError, TypeError, ValueError, AttributeError) as exc:
                    if not self._stop.is_set():
                        log.info("detour event stream lost: %r", exc)
                except Exception:  # noqa: BLE001 - never let the reader die
                    log.exception("detour event stream failed")
                finally:
                    self.connected.clear()
                    with self._lock:
                        self._sock = None
                if not self._stop.is_set():
                    self._wake.clear()
                    self._wake.wait(jitter.next_s())
        finally:
            self._http.close()

    def _follow(self, jitter: Jitter) -> None:
        core = self._core
        request = self._http.build_request("GET", STREAM_PATH)
        # connecting and the headers; the body has no end
        with call_deadline(stream_connect_s(core.timeout)):
            r = self._http.send(request, stream=True)
        try:
            check_stream(r, f"GET {STREAM_PATH}")
            with self._lock:
                self._sock = _socket_of(r)
                if self._stop.is_set():
                    return
            parser = SSEParser(core.max_event_bytes)
            applier = core.applier
            core.service_clock.reconnected()
            for chunk in r.iter_raw():
                for event in parser.feed_bytes(chunk):
                    applier.handle(event, mono_ms())
                    if event.kind == "snapshot":
                        core.stream_snapshots += 1
                        self.connected.set()
                        self.synced.set()
                        jitter.reset()
                if self._stop.is_set():
                    return
        finally:
            r.close()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            if self._sock is not None:
                # Wakes the blocked read at once rather than at the next clock event.
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout)


def _socket_of(response: httpx.Response) -> socket.socket | None:
    stream = response.extensions.get("network_stream")
    if stream is None:
        return None
    sock = stream.get_extra_info("socket")
    return sock if isinstance(sock, socket.socket) else None


class SignalThread:
    """Queues in-flight signals when due (``ClientCore.due_signals``), until stopped.

    It sleeps until the earliest outstanding send is due; a send that starts due earlier
    than that wakes it (``poke``). Queuing never blocks: the flusher sends the signal.
    """

    def __init__(self, core: ClientCore, queue: Callable[[list[Pending]], None]) -> None:
        self._core = core
        self._queue = queue
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._planned = math.inf
        self._thread = threading.Thread(target=self._run, name="detour-inflight", daemon=True)
        self._thread.start()

    def poke(self, due_ms: float) -> None:
        """A send started that is due at ``due_ms`` (monotonic ms)."""
        with self._lock:
            if due_ms < self._planned:
                self._wake.set()

    def _run(self) -> None:
        core = self._core
        while not self._stop.is_set():
            self._wake.clear()
            try:
                items = core.due_signals(mono_ms())
                if items:
                    self._queue(items)
            except Exception:  # noqa: BLE001 - a signal is best effort: log, carry on
                log.exception("in-flight signal failed")
            with self._lock:
                nxt = core.inflight.next_due_ms()
                self._planned = math.inf if nxt is None else nxt
            self._wake.wait(None if nxt is None else max(0.0, (nxt - mono_ms()) / 1000))

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
