"""Fast failure under overload (RocketMQ's BrokerFastFailure): refuse at once, don't queue.

A producer waiting on a select that will come too late is worse off than one told
"busy" at once: the SDK then decides locally (fail-open). Two rules, both answered
with 503 ``{"error": "SYSTEM_BUSY"}`` and ``Retry-After`` and counted in
``detour_requests_shed_total{reason}``:

* ``in_flight``: more than ``max_in_flight`` requests are inside the app (a slow
  Redis makes reports pile up; the bound keeps memory and latency bounded);
* ``queue_wait``: the request waited longer than ``max_queue_wait_ms`` between
  being read off the socket and being served — the event loop is behind, like a
  send request that sat in RocketMQ's queue past ``waitTimeMillsInSendQueue``.
  The arrival time comes from ``TimedHttpToolsProtocol`` (uvicorn's protocol,
  stamping the scope when a request begins); without it only the first rule acts.

Probes and scrapes (``/healthz``, ``/readyz``, ``/metrics``) are never shed, and the
endless push stream does not count as in flight.
"""

from __future__ import annotations

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


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, noting when each request began to arrive."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        cast(dict[str, Any], self.scope)[ARRIVED] = time.monotonic_ns()


class Shedder:
    def __init__(self, app: ASGIApp, max_in_flight: int, max_queue_wait_ms: float) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.max_wait_ns = int(max_queue_wait_ms * 1_000_000)
        self.in_flight = 0
        body = json.dumps(error_body("SYSTEM_BUSY", "overloaded: retry shortly or decide locally"))
        self._body = body.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _EXEMPT:
            await self.app(scope, receive, send)
            return
        if scope["path"] in _UNCOUNTED:
            await self.app(scope, receive, send)
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

    async def _refuse(self, send: Send, reason: str) -> None:
        metrics.SHED.labels(reason).inc()
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
