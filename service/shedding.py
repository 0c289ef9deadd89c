"""Fast failure under overload (RocketMQ's BrokerFastFailure): refuse at once, don't queue.

A producer waiting on a select that will come too late is worse off than one told
"busy" at once: the SDK then decides locally (fail-open). Two rules, both answered
with 503 ``{"error": "SYSTEM_BUSY"}`` and ``Retry-After`` and counted in
``detour_requests_shed_total{reason}``:

* ``in_flight``: ``max_in_flight`` requests are already being handled (a slow
  Redis makes reports pile up; a burst fills the event loop). The server protocol
  checks this as soon as a request's headers are read and hands the request to a
  tiny refusing app instead of Detour's, so a refusal costs a few µs and leaves in
  the same loop turn, and one turn of the loop never holds more than
  ``max_in_flight`` requests' worth of work: that bounds both how late an answer
  can be and how late a refusal is (docs/BENCHMARKS.md, overload);
* ``queue_wait``: the request waited longer than ``max_queue_wait_ms`` between
  being read off the socket and being served — the event loop is behind, like a
  send request that sat in RocketMQ's queue past ``waitTimeMillsInSendQueue``.
  The arrival time comes from ``TimedHttpToolsProtocol`` (uvicorn's protocol,
  stamping the scope when a request begins); without it only the first rule acts.

Probes and scrapes (``/healthz``, ``/readyz``, ``/metrics``) are never shed, and the
endless push stream does not count as in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service import metrics
from service.errors import error_body

#: The scope key the protocol stamps (monotonic ns when the request began).
ARRIVED = "detour.arrived_ns"
_EXEMPT = frozenset({"/healthz", "/readyz", "/metrics"})
_UNCOUNTED = frozenset({"/fault-items/stream"})


_EXEMPT_RAW = frozenset(p.encode() for p in _EXEMPT | _UNCOUNTED)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, noting when each request began to arrive and
    refusing at once, before Detour's app runs, when too many are being handled."""

    #: The Shedder of the app this process serves (set when the app is built).
    shedder: Shedder | None = None
    _refused = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._refused = False
        cast(dict[str, Any], self.scope)[ARRIVED] = time.monotonic_ns()

    def on_headers_complete(self) -> None:
        shedder = TimedHttpToolsProtocol.shedder
        if (
            shedder is None
            or not shedder.over_bound(self.tasks)
            or self.url.partition(b"?")[0] in _EXEMPT_RAW
        ):
            super().on_headers_complete()
            return
        if self.cycle is None or self.cycle.response_complete:
            # Nothing of this connection is being answered: write the refusal now,
            # in this loop turn, without a task; the body, if any, is read and dropped.
            self._refused = True
            shedder.count_refusal("in_flight")
            self.transport.write(shedder.busy_response)
            if self.parser.should_keep_alive():
                self.on_response_complete()
            else:
                self.transport.close()
            return
        # A pipelined request behind one being answered: refuse in order, through
        # uvicorn's own queue, with a refusing app in place of Detour's.
        app, self.app = self.app, shedder.refuse_in_flight
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()


class Shedder:
    def __init__(self, app: ASGIApp, max_in_flight: int, max_queue_wait_ms: float) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.max_wait_ns = int(max_queue_wait_ms * 1_000_000)
        self.in_flight = 0
        #: Open push streams: endless requests that do not count as work in flight.
        self.streams = 0
        TimedHttpToolsProtocol.shedder = self
        body = json.dumps(error_body("SYSTEM_BUSY", "overloaded: retry shortly or decide locally"))
        self._body = body.encode()
        #: The whole HTTP/1.1 answer, for refusals written by the protocol itself.
        self.busy_response = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(self._body), self._body)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _EXEMPT:
            await self.app(scope, receive, send)
            return
        if scope["path"] in _UNCOUNTED:
            self.streams += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.streams -= 1
            return
        arrived = scope.get(ARRIVED)
        if arrived is not None and time.monotonic_ns() - arrived > self.max_wait_ns:
            await self._refuse(send, "queue_wait")
            return
        if self.in_flight >= self.max_in_flight:
            await self._refuse(send, "in_flight")
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def refuse_in_flight(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._refuse(send, "in_flight")

    def over_bound(self, tasks: set[asyncio.Task[None]]) -> bool:
        """Whether ``max_in_flight`` requests are being handled, from uvicorn's set of
        request tasks (started or not yet). A task whose answer went out stays in the set
        until its done-callback runs, a loop turn later: near the bound, count only the
        unfinished ones (O(n) only then)."""
        if len(tasks) - self.streams < self.max_in_flight:
            return False
        return sum(not t.done() for t in tasks) - self.streams >= self.max_in_flight

    def count_refusal(self, reason: str) -> None:
        metrics.SHED.labels(reason).inc()

    async def _refuse(self, send: Send, reason: str) -> None:
        self.count_refusal(reason)
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self._body)).encode()),
                    (b"retry-after", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": self._body})
