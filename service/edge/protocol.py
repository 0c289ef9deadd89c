"""The HTTP/1.1 protocol Detour runs under uvicorn: its httptools protocol, bounded at the edge.

uvicorn's httptools protocol (the fast one; h11's is the other) has no limit on a
request's head and no read deadline: a 20 MB head is parsed into memory, and a client
that sends one byte a second holds its connection for ever. This subclass adds what
nginx and Envoy have (docs/security.md, "The HTTP edge"), each a setting:

* **Head size and count** (``DETOUR_MAX_HEADER_BYTES``, ``DETOUR_MAX_HEADERS``): the
  bytes of a request line plus headers are counted *before* they reach the parser
  (httptools buffers a header whole before handing it over), and past the bound the
  request is answered ``431`` and the connection closed. Memory per connection stays
  within about twice the bound, whatever the client sends.
* **Read deadlines** (``DETOUR_HEADER_TIMEOUT_S``, ``DETOUR_BODY_TIMEOUT_S``): a head
  must arrive whole within its deadline from its first byte (or from the connection's
  opening), a body within its own from the end of the head; else ``408`` and close.
* **Open connections** (``DETOUR_MAX_CONNECTIONS``): a connection past the bound is
  closed as soon as it is accepted, like Envoy's listener ``max_connections``.
* **A body still arriving is not in flight**: the shedder's in-flight bound counts
  requests that work, so slow bodies cannot fill it (they are bounded by the body
  deadline and the connection bound instead).

It also keeps what shedding needs (service/shedding.py): each request's arrival time in
its scope, and the shedder's refusals written before Detour's app runs. While the
service is shedding, refusals skip the parser too (``_refuse_fast``): at a message
boundary the raw bytes are scanned for whole simple requests, and all the refusals of
one read go out in one write. At 5x overload a refusal through uvicorn's callbacks
costs about a fifth of a select, so refusals alone would eat the CPU
(docs/BENCHMARKS.md, "Overload"). The shedder and
the limits come from the app's lifespan state (``EDGE_STATE``), so the protocol has no
global of its own; without them it behaves as uvicorn's.

Selects, and reports the replica keeps, skip ASGI altogether: once such a request's
body is in, ``DirectLane`` (service/api/direct.py) answers it in the same callback, or
hands it back and uvicorn's cycle starts with the body complete. Its answers, and the
refusals, are written when the loop's turn has read everything (``Outbox``).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service import metrics
from service.edge.bodies import HostNames
from service.edge.direct import DirectLane
from service.edge.shedding import ARRIVED, EXEMPT_RAW, STREAMS_RAW, Shedder
from service.errors import error_body

#: Paths any Host may reach: the probes (kubelet sends the pod's address, and they tell
#: nothing and change nothing).
_ANY_HOST = frozenset({b"/healthz", b"/readyz"})
#: The lifespan state key holding this process's ``Edge`` (set by service/app.py).
EDGE_STATE = "edge"

#: Pending answers of one connection past which they are written at once (and the
#: transport's own flow control takes over: a paused writer sends requests the ASGI way).
_OUT_MAX = 64 * 1024
#: Bytes an endless response's transport holds above the kernel's buffer before the
#: writer waits (asyncio's default is 64 KiB); a snapshot is written in slices this size.
_STREAM_HIGH_WATER = 16 * 1024

# Where a connection is in its current request.
_IDLE, _HEAD, _BODY = 0, 1, 2

#: A whole simple HTTP/1.1 head, for the refusal fast path: a request line with an
#: origin-form target, then ``name:value`` lines whose names are tokens, then the empty
#: line. Anything else (HTTP/1.0, folded or malformed lines) is left to the parser.
_SIMPLE_HEAD = re.compile(
    rb"[A-Z]{1,16} (/[^ ?\r\n]*)[^ \r\n]* HTTP/1\.1\r\n"
    rb"((?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[^\r\n]*\r\n)*)\r\n"
)
#: Headers that change how a request is framed or whether the connection stays open:
#: a head carrying any of them (even inside a value) is left to the parser.
_NOT_SIMPLE = (b"transfer-encoding", b"connection", b"expect", b"upgrade")
_CONTENT_LENGTH = re.compile(rb"(?:^|\n)content-length:[ \t]*([0-9]{1,12})[ \t]*\r\n")
#: The longest head a connection remembers for the fast path (``_known_head``): a
#: producer's head is a few hundred bytes, and a connection's memory stays within the
#: head bound's as before.
_KNOWN_HEAD_MAX = 1024


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The protocol's bounds (the settings of the same names)."""

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_s: float = 5.0
    body_timeout_s: float = 5.0
    max_connections: int = 512
    #: Kernel send buffer of an endless response's socket (``stream_send_buffer_bytes``):
    #: fixed, so a client that stops reading stalls the writes after this much, where
    #: autotuning would queue megabytes.
    stream_send_buffer: int = 64 * 1024
    #: The Host names requests may carry; None: any (not checked).
    hosts: HostNames | None = None


class Outbox:
    """Whole answers written when the event loop's turn has read everything, not at once.

    Why: writing an answer to a loopback client that sleeps wakes it, and the wake-up is
    paid in the writer's system call. Written one by one as requests are read, each
    answer paid one (measured: direct-lane selects went from 70 to 38 µs of CPU each
    when their writes moved to the end of the turn, docs/BENCHMARKS.md, "Hot path").
    uvicorn's own answers come from tasks, which run after the turn's reads too.

    A connection's answers keep their order: each protocol sends its pending bytes
    before anything else it writes or closes (``EdgeProtocol._flush_out``).
    """

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: list[EdgeProtocol] = []

    def add(self, protocol: EdgeProtocol) -> None:
        if not self._waiting:
            protocol.loop.call_soon(self.flush)
        self._waiting.append(protocol)

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        for protocol in waiting:
            protocol._flush_out()


@dataclass(slots=True)
class Edge:
    """What the protocol reads from the lifespan state: the limits and the shedder."""

    limits: EdgeLimits
    shedder: Shedder | None = None
    #: The hot routes answered without ASGI when they never wait (service/api/direct.py).
    direct: DirectLane | None = None
    outbox: Outbox = field(default_factory=Outbox)


def _answer(status: bytes, code: str, message: str, field: str | None) -> bytes:
    """A whole HTTP/1.1 error answer in the Error schema, closing the connection."""
    body = json.dumps(error_body(code, message, field)).encode()
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, len(body), body)
    )


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the edge's bounds and the shedder's refusals."""

    _edge: Edge | None = None
    _phase = _IDLE
    #: Bytes of the current head read so far (counted before parsing).
    _head_bytes = 0
    _headers_seen = 0
    _too_many = False
    _completed = False
    _deadline: asyncio.TimerHandle | None = None
    _deadline_phase = -1
    #: This connection's request counts as waiting for its body (not in flight).
    _awaiting_body = False
    _refused = False
    #: The next message was already admitted by the refusal fast path: the shedder is
    #: not asked again for it.
    _admitted = False
    #: The hot path the direct lane is reading a body for (None: the ASGI way).
    _direct: bytes | None = None
    _direct_body: list[bytes]
    #: Whole answers waiting for the end of the loop's turn (``Outbox``), and their size.
    _out: list[bytes] | None = None
    _out_bytes = 0
    #: The server is stopping: the request being read is answered, then the connection
    #: closes.
    _close_after = False
    #: The last simple head the refusal fast path analysed on this connection, and its
    #: body's length: a client repeats its head byte for byte, so a repeat is not
    #: scanned again (identical bytes, identical verdict).
    _known_head = b""
    _known_body = 0
    #: When the connection last became idle after fast-path refusals (loop time): the
    #: keep-alive timer already running is moved, not replaced (``_refuse_fast``).
    _idle_from = 0.0

    # Connection --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        edge = self.app_state.get(EDGE_STATE)
        self._edge = edge if isinstance(edge, Edge) else None
        if self._edge is None:
            return
        if len(self.connections) > self._edge.limits.max_connections:
            metrics.EDGE_REFUSED.labels("connections").inc()
            transport.close()
            return
        # A connection that never sends a byte is bounded too.
        self._arm(_IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self._out = None
        self._disarm()
        self._stop_awaiting_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        edge = self._edge
        if edge is None:
            super().data_received(data)
            return
        shedder = edge.shedder
        if (
            shedder is not None
            and self._phase == _IDLE
            and (self.cycle is None or self.cycle.response_complete)
            and time.monotonic_ns() < shedder.shedding_until
        ):
            data = self._refuse_fast(data, edge, shedder)
            if not data:
                return
        limit = edge.limits.max_header_bytes
        while data:
            if self._phase == _BODY:
                super().data_received(data)
                break
            room = limit - self._head_bytes
            if room <= 0:
                self._refuse_head("headers_too_large")
                return
            if len(data) > room:
                piece, data = data[:room], data[room:]
            else:
                piece, data = data, b""
            self._completed = False
            super().data_received(piece)
            if self.transport.is_closing():
                return
            if self._too_many:
                self._refuse_head("too_many_headers")
                return
            if self._phase == _HEAD and not self._completed:
                # The whole piece belonged to this head. (A piece in which a request
                # completed is not counted: the next head's share of it is at most
                # ``room``, so a head is still cut within twice the bound.)
                self._head_bytes += len(piece)
        if self.transport.is_closing():
            return
        phase = self._phase
        cycle = self.cycle
        if phase == _BODY and cycle is not None and not cycle.response_complete:
            if not self._refused:
                self._start_awaiting_body()
        if phase == _IDLE:
            self._disarm()  # between requests: uvicorn's keep-alive timeout applies
        elif self._deadline_phase != phase:
            self._arm(phase)

    # Parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._direct = None
        self._phase = _HEAD
        self._headers_seen = 0
        self._too_many = False
        self._refused = False
        cast(dict[str, Any], self.scope)[ARRIVED] = time.monotonic_ns()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_seen += 1
        edge = self._edge
        if edge is not None and self._headers_seen > edge.limits.max_headers:
            self._too_many = True
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._head_bytes = 0
        if self._too_many:
            self._refused = True  # answered 431 once the parser returns
            return
        edge = self._edge
        if edge is not None and edge.limits.hosts is not None and not self._host_allowed(edge):
            self._refused = True
            return
        path = self.url.partition(b"?")[0]
        if path in STREAMS_RAW and edge is not None:
            # Bounded buffers for an endless response: the kernel's, and the transport's
            # (uvicorn waits for it to drain below this before each send).
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, edge.limits.stream_send_buffer)
            self.transport.set_write_buffer_limits(high=_STREAM_HIGH_WATER)
        shedder = edge.shedder if edge is not None else None
        if shedder is None or path in EXEMPT_RAW:
            self._start(edge, path)
            return
        if self._admitted:
            self._admitted = False
            reason = None
        else:
            reason = shedder.refusal()
        if reason is None:
            self._start(edge, path)
            return
        if self.cycle is None or self.cycle.response_complete:
            # Nothing of this connection is being answered: write the refusal now,
            # in this loop turn, without a task; the body, if any, is read and dropped.
            self._refused = True
            shedder.count_refusal(reason)
            self._send_soon(shedder.busy_response)
            if self.parser.should_keep_alive():
                self.on_response_complete()
            else:
                self._flush_out()
                self.transport.close()
            return
        # A pipelined request behind one being answered: refuse in order, through
        # uvicorn's own queue, with a refusing app in place of Detour's.
        app, self.app = self.app, shedder.refusing_app(reason)
        self._flush_out()
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        if self._direct is not None:
            self._direct_body.append(body)  # within the limit: its Content-Length said so
        elif not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._completed = True
        self._stop_awaiting_body()
        if self._direct is not None:
            self._answer_directly(self._direct, b"".join(self._direct_body))
        elif not self._refused:
            super().on_message_complete()

    # The direct lane ------------------------------------------------------------------

    def _start(self, edge: Edge | None, path: bytes) -> None:
        """An admitted request: to the direct lane when it takes it, else uvicorn's cycle."""
        lane = edge.direct if edge is not None else None
        if (
            lane is not None
            and path in lane.paths
            and self.parser.get_method() == b"POST"
            and self.parser.get_http_version() == "1.1"
            and not self.expect_100_continue
            and not self.parser.should_upgrade()
            # In order: nothing of this connection is being answered or queued.
            and (self.cycle is None or self.cycle.response_complete)
            and not self.pipeline
            and not self.flow.write_paused
            and lane.takes(self.headers)
            # One the shedder's queue-wait rule refuses goes its way (and is refused).
            and not (
                edge is not None
                and edge.shedder is not None
                and edge.shedder.overdue(cast(dict[str, Any], self.scope)[ARRIVED])
            )
        ):
            self._direct = path
            self._direct_body = []
            return
        self._flush_out()  # the cycle's answer comes after those already pending
        super().on_headers_complete()

    def _answer_directly(self, path: bytes, body: bytes) -> None:
        """The lane's answer in one write, or the request handed to uvicorn's cycle whole."""
        self._direct = None
        edge = self._edge
        assert edge is not None and edge.direct is not None
        scope = cast(dict[str, Any], self.scope)
        answer = edge.direct.answer(path, self.headers, body, scope["state"])
        if answer is None:
            # As if the lane had never looked: the cycle starts with the body complete.
            self._flush_out()
            HttpToolsProtocol.on_headers_complete(self)
            cycle = self.cycle
            if self._close_after:
                cycle.keep_alive = False
            cycle.body += body
            cycle.more_body = False
            cycle.message_event.set()
            return
        status, headers, payload = answer
        keep_alive = self.parser.should_keep_alive() and not self._close_after
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", payload)
        self._send_soon(b"".join(content))
        if not keep_alive:
            self._flush_out()
            self.transport.close()
        self.on_response_complete()

    # Answers at the end of the turn ---------------------------------------------------

    def _send_soon(self, data: bytes) -> None:
        """Write ``data`` when the loop's turn has read everything (``Outbox``)."""
        out = self._out
        if out is None:
            self._out = [data]
            self._out_bytes = len(data)
            edge = self._edge
            assert edge is not None
            edge.outbox.add(self)
        else:
            out.append(data)
            self._out_bytes += len(data)
        if self._out_bytes > _OUT_MAX:
            self._flush_out()

    def _flush_out(self) -> None:
        """Write the pending answers now (before anything else is written or closed)."""
        out = self._out
        if out is not None:
            self._out = None
            if not self.transport.is_closing():
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def send_400_response(self, msg: str) -> None:
        self._flush_out()
        super().send_400_response(msg)

    def shutdown(self) -> None:
        self._flush_out()
        if self._direct is not None:
            # Its head is in, as for a request uvicorn's cycle holds: it is answered,
            # then the connection closes.
            self._close_after = True
            return
        super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        # A timer the fast path left running counts from the connection's last refusal.
        left = self._idle_from + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(
                left, self.timeout_keep_alive_handler
            )
            return
        self._flush_out()
        super().timeout_keep_alive_handler()

    def on_response_complete(self) -> None:
        # Answered (a 401 or 413 may come before the body is read): no longer a request
        # of the app's waiting for its body, so it stops being left out of in flight.
        self._stop_awaiting_body()
        super().on_response_complete()

    # Refusals without the parser ----------------------------------------------------

    def _refuse_fast(self, data: bytes, edge: Edge, shedder: Shedder) -> bytes:
        """Refuse the whole simple requests at the start of ``data``; returns the rest.

        Called only between messages, with nothing of this connection being answered,
        while the service is shedding. Each whole request whose head is simple (see
        ``_SIMPLE_HEAD``, ``_NOT_SIMPLE``; within the head bounds) and whose body is in
        ``data`` too is put to the shedder; the refused ones are answered 503 in one
        write, whatever their Host or path (they never reach the app; the probes and
        scrapes are left to the parser, as they are never shed). The first request the
        shedder admits, or anything not simple or not whole, goes to the parser with
        the rest: the scan never looks further than the head bound, and never past
        what the parser would accept.

        A client sends the same head again and again, so the connection remembers the
        last simple head it scanned: a request starting with those exact bytes is not
        scanned again. With that, and the keep-alive timer moved rather than replaced,
        a refusal costs 12 µs of CPU instead of 17 (``python -m bench.refusal_cost``;
        a server that only refuses costs 8).
        """
        limits = edge.limits
        end = len(data)
        pos = 0
        refused: dict[str, int] = {}
        known = self._known_head
        while pos < end:
            if known and data.startswith(known, pos):
                stop = pos + len(known) + self._known_body
            else:
                stop = self._simple_request(data, pos, limits)
                if stop < 0:
                    break
                known = self._known_head
            if stop > end:
                break  # the body is still arriving: the parser reads it
            reason = shedder.refusal()
            if reason is None:
                self._admitted = True
                break
            refused[reason] = refused.get(reason, 0) + 1
            pos = stop
        if not refused:
            return data
        count = sum(refused.values())
        for reason, n in refused.items():
            shedder.count_refusal(reason, n)
        self._disarm()  # between requests now, as after any answered request
        self._send_soon(shedder.busy_response * count)
        self.server_state.total_requests += count
        if pos < end:
            self._unset_keepalive_if_required()  # the parser reads the rest
        elif self.timeout_keep_alive_task is None:
            # Idle until the next request: uvicorn's keep-alive timeout applies.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
        else:
            # Idle again: the running timer counts from now (cheaper than a new one).
            self._idle_from = self.loop.time()
        return data[pos:]

    def _simple_request(self, data: bytes, pos: int, limits: EdgeLimits) -> int:
        """Where the simple request at ``pos`` ends (its body included, which may lie
        past ``data``), or -1 when it is not simple; a simple head is remembered."""
        head = _SIMPLE_HEAD.match(data, pos, min(len(data), pos + limits.max_header_bytes))
        if head is None or head.group(1) in EXEMPT_RAW:
            return -1
        fields = head.group(2).lower()
        if fields.count(b"\r\n") > limits.max_headers or any(
            name in fields for name in _NOT_SIMPLE
        ):
            return -1
        body = 0
        lengths = fields.count(b"content-length")
        if lengths:
            length = _CONTENT_LENGTH.search(fields)
            if lengths > 1 or length is None:
                return -1
            body = int(length.group(1))
        if head.end() - pos <= _KNOWN_HEAD_MAX:
            self._known_head = data[pos : head.end()]
            self._known_body = body
        return head.end() + body

    # Bounds --------------------------------------------------------------------------

    def _refuse_head(self, reason: str) -> None:
        """431 for a head over the bounds, then close (nginx and Envoy close too)."""
        metrics.EDGE_REFUSED.labels(reason).inc()
        if self.cycle is None or self.cycle.response_complete:
            edge = self._edge
            assert edge is not None
            what = (
                f"more than {edge.limits.max_headers} headers"
                if reason == "too_many_headers"
                else f"request line and headers over {edge.limits.max_header_bytes} bytes"
            )
            status = b"431 Request Header Fields Too Large"
            self._flush_out()
            self.transport.write(_answer(status, "HEADERS_TOO_LARGE", what, "headers"))
        self._close()

    def _host_allowed(self, edge: Edge) -> bool:
        """Whether the Host is allowed; if not, answers 421 and closes (DNS rebinding)."""
        hosts = edge.limits.hosts
        assert hosts is not None
        for name, value in self.headers:
            if name == b"host":
                if hosts.allows(value) or self.url.partition(b"?")[0] in _ANY_HOST:
                    return True
                metrics.EDGE_REFUSED.labels("host").inc()
                if self.cycle is None or self.cycle.response_complete:
                    shown = value[:100].decode("latin-1")
                    self._flush_out()
                    self.transport.write(
                        _answer(
                            b"421 Misdirected Request",
                            "HOST_NOT_ALLOWED",
                            f"Host {shown!r} is not one of this Detour's names "
                            "(loopback names, IP literals, DETOUR_ALLOWED_HOSTS)",
                            "Host",
                        )
                    )
                self._close()
                return False
        return True  # no Host (HTTP/1.0): not a browser's request

    def _arm(self, phase: int) -> None:
        edge = self._edge
        if edge is None:
            return
        self._disarm()
        limits = edge.limits
        delay = limits.body_timeout_s if phase == _BODY else limits.header_timeout_s
        self._deadline = self.loop.call_later(delay, self._deadline_passed, phase)
        self._deadline_phase = phase

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._deadline_phase = -1

    def _deadline_passed(self, phase: int) -> None:
        self._deadline = None
        self._deadline_phase = -1
        if self.transport.is_closing() or self._phase != phase:
            return
        reason = "body_timeout" if phase == _BODY else "header_timeout"
        metrics.EDGE_REFUSED.labels(reason).inc()
        if phase != _IDLE and (self.cycle is None or not self.cycle.response_started):
            what = "request body" if phase == _BODY else "request headers"
            self._flush_out()
            self.transport.write(
                _answer(b"408 Request Timeout", "REQUEST_TIMEOUT", f"{what} too slow", None)
            )
        self._close()

    def _close(self) -> None:
        self._flush_out()
        if self.cycle is not None and not self.cycle.response_complete:
            # The app, if it is waiting for the body, reads a disconnect; what it
            # answers is dropped.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._disarm()
        self._stop_awaiting_body()
        self.transport.close()

    def _start_awaiting_body(self) -> None:
        edge = self._edge
        if not self._awaiting_body and edge is not None and edge.shedder is not None:
            self._awaiting_body = True
            edge.shedder.awaiting_body += 1

    def _stop_awaiting_body(self) -> None:
        if self._awaiting_body:
            self._awaiting_body = False
            edge = self._edge
            if edge is not None and edge.shedder is not None:
                edge.shedder.awaiting_body -= 1
