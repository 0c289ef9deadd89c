"""The HTTP/1.1 server protocol Detour runs: uvicorn's httptools protocol with the edge's rules.

uvicorn's protocol parses and answers; this subclass decides, as each byte is read, what
a client may hold or send before Detour's app runs, as nginx and Envoy do
(docs/security.md, "The HTTP edge"). Each rule is a setting, and each decision that is
more than a line lives in a module of its own, which this one calls:

* **Head size and count** (``DETOUR_MAX_HEADER_BYTES``, ``DETOUR_MAX_HEADERS``): the bytes
  of a request line plus headers are counted *before* they reach the parser, and past the
  bound the request is answered ``431`` and the connection closed.
* **Read deadlines** (``DETOUR_HEADER_TIMEOUT_S``, ``DETOUR_BODY_TIMEOUT_S``): a head must
  arrive whole within its deadline from its first byte, a body within its own from the end
  of the head; else ``408`` and close.
* **Pipelining** (service/edge/pipelining.py): the parser is given only as much of a read
  as keeps a connection within a few unanswered requests and answers its client has not
  taken; the rest is held and the socket not read until answers drain.
* **Connections, fairly** (service/edge/connections.py): a cap per process and per peer; at
  the cap an idle connection makes room; connections that have not proven themselves (no
  valid token; on an open Detour, no request yet) get a short idle timeout.
* **Malformed requests**: what the parser refuses is answered ``400`` in the Error shape
  and the connection closed, on both ways in, shedding or not.
* **The shedder's refusals** (service/edge/shedding.py): checked when a head is read, and
  written by the protocol itself; while the service sheds, whole simple requests are
  refused from the raw bytes (service/edge/scan.py), all the refusals of a read in one
  write.
* **The direct lane** (service/edge/direct.py): a select, or a report the replica keeps,
  is answered in the callback that read its body, without ASGI; whatever the lane does
  not take goes to uvicorn's request cycle as before.

Answers the protocol writes itself (refusals, direct answers) wait for the end of the
loop's turn (service/edge/outbox.py). Everything it knows of uvicorn goes through
``UvicornHttp`` (service/edge/uvicorn_seam.py), the one module that names uvicorn's
internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import sys
import termios
import time

from service import metrics
from service.edge import answers, heads, pipelining
from service.edge.guard import credentials
from service.edge.heads import HeadRefused
from service.edge.hosts import authority, origin_path
from service.edge.scan import simple_request
from service.edge.shedding import ARRIVED, EXEMPT_RAW, STREAMS_RAW, Shedder
from service.edge.state import EDGE_STATE, Edge, EdgeLimits
from service.edge.uvicorn_seam import UvicornHttp

__all__ = ["EDGE_STATE", "Edge", "EdgeLimits", "EdgeProtocol"]

#: Paths any Host may reach: the probes (kubelet sends the pod's address, and they tell
#: nothing and change nothing).
_ANY_HOST = frozenset({b"/healthz", b"/readyz"})

#: Pending answers of one connection past which they are written at once (and the
#: transport's own flow control takes over: a paused writer sends requests the ASGI way).
_OUT_MAX = 64 * 1024
#: SO_LINGER on, 0 s: a close that discards the kernel's send queue and sends RST.
_LINGER_RESET = struct.pack("ii", 1, 0)
#: Bytes an endless response's transport holds above the kernel's buffer before the
#: writer waits (asyncio's default is 64 KiB); a snapshot is written in slices this size.
_STREAM_HIGH_WATER = 16 * 1024

# Where a connection is in its current request; _HELD: bytes are held (the deadline is
# then the client's to take its answers).
_IDLE, _HEAD, _BODY, _HELD = 0, 1, 2, 3

#: The longest head a connection remembers for the fast path (``_known_head``): a
#: producer's head is a few hundred bytes, and a connection's memory stays within the
#: head bound's as before.
_KNOWN_HEAD_MAX = 1024


class EdgeProtocol(UvicornHttp):
    """uvicorn's httptools protocol with the edge's bounds, the shedder's refusals and the
    direct lane."""

    _edge: Edge | None = None
    _phase = _IDLE
    #: Bytes of the current head read so far (counted before parsing).
    _head_bytes = 0
    #: Bytes read after the current head (chunk framing and trailers included): bounded,
    #: since the parser holds a trailer's value whole however long it grows.
    _body_bytes = 0
    _headers_seen = 0
    _too_many = False
    _completed = False
    _deadline: asyncio.TimerHandle | None = None
    _deadline_phase = -1
    #: This connection's request is inside the app and its body still arriving: it does
    #: not count as in flight (``Shedder.awaiting_body``).
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
    #: Bytes read and not yet given to the parser (the pipelining bound); whether the edge
    #: paused reading for them (or swallowed uvicorn's resume) and owes a resume.
    _held = b""
    _owes_resume = False
    _feeding = False
    _feed_soon = False
    #: The parser refused bytes behind an answer under way: 400 once it is out.
    _bad_after = False
    #: For the connection table (service/edge/connections.py).
    peer = ""
    proven = False
    _idle_at = 0.0
    #: When the request being read began (loop time): ``reading_since``.
    _began_at = 0.0
    _registered = False

    # Connection --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        edge = self.lifespan_state().get(EDGE_STATE)
        self._edge = edge if isinstance(edge, Edge) else None
        if self._edge is None:
            return
        self.peer = self.peer_host()
        refused = self._edge.connections.admit(self)
        if refused is not None:
            metrics.EDGE_REFUSED.labels(refused).inc()
            transport.write(answers.raw_error(503, "SYSTEM_BUSY", _BUSY_CONNECTIONS[refused]))
            transport.close()
            return
        self._registered = True
        self._bound_buffers(self._edge.limits.socket_buffer)
        self._idle_at = self.loop.time()
        # A connection that never sends a byte is bounded too.
        self._arm(_IDLE)

    def _bound_buffers(self, size: int) -> None:
        """Fix the socket's kernel buffers (``socket_buffer_bytes``, each way). Autotuned,
        one connection whose client takes no answers let the kernel queue a whole large
        answer (a 1.2 MB ``/latency-log`` page: 1.7 MB of socket memory on loopback),
        and one that sends faster than it is read fills a receive buffer grown while it
        was read quickly: memory no connection cap counted, which cgroup v2 charges to
        the pod. Fixed, the kernel holds at most twice ``size`` each way; what an answer
        has beyond that waits in the transport, where the pipelining bound sees it."""
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def connection_lost(self, exc: Exception | None) -> None:
        self._out = None
        self._held = b""
        self._disarm()
        self._stop_awaiting_body()
        if self._registered and self._edge is not None:
            self._registered = False
            self._edge.connections.remove(self)
        super().connection_lost(exc)

    def idle_since(self) -> float | None:
        """When the connection became idle (loop time), None while it is busy."""
        if (
            self._phase != _IDLE
            or self._held
            or self._direct is not None
            or self.answering()
            or self.queued()
        ):
            return None
        return self._idle_at

    def reading_since(self) -> float | None:
        """When this connection, unproven, began the request it is still reading (its head
        or body not whole; no answer being written, nothing queued); None otherwise."""
        if (
            self.proven
            or self._phase not in (_HEAD, _BODY)
            or (self.answering() and self.answer_started())
            or self.queued()
        ):
            return None
        return self._began_at

    def evict(self) -> None:
        """Closed to make room for a new connection (idle, or unproven and reading)."""
        reason = "idle_evicted" if self.idle_since() is not None else "reading_evicted"
        metrics.EDGE_REFUSED.labels(reason).inc()
        self._close()

    def data_received(self, data: bytes) -> None:
        edge = self._edge
        if edge is None:
            super().data_received(data)
            return
        if self._bad_after or self.transport.is_closing():
            return  # the parser refused what came before: nothing more is read
        if self._held:
            # Read while bytes were held (a read already under way): behind them.
            data, self._held = self._held + data, b""
        self._consume(data, edge)

    def _consume(self, data: bytes, edge: Edge) -> None:
        """Give ``data`` to the parser within the bounds; hold what they do not allow."""
        shedder = edge.shedder
        if (
            shedder is not None
            and self._phase == _IDLE
            and not self.answering()
            and time.monotonic_ns() < shedder.shedding_until
        ):
            data = self._refuse_fast(data, edge, shedder)
            if not data:
                return
        limit = edge.limits.max_header_bytes
        body_limit = 2 * edge.limits.max_body_bytes + limit
        pos, end = 0, len(data)
        # A read with at most one head, nothing queued and few answers waiting (a
        # producer's one request at a time) overshoots the bound by one request at most:
        # only other reads are weighed against it, head by head.
        weigh = (
            data.count(pipelining.HEAD_END) > 1
            or self.queued() > 0
            or self._out_bytes + self.transport.get_write_buffer_size()
            > pipelining.MAX_WAITING_BYTES
        )
        self._feeding = True
        try:
            while pos < end:
                if weigh:
                    room = pipelining.room(self._unanswered(), self._waiting_bytes())
                    stop = pipelining.feedable(data, pos, room)
                else:
                    stop = end
                if self._phase != _BODY:
                    head_room = limit - self._head_bytes
                    if head_room <= 0:
                        self._refuse_head("headers_too_large")
                        return
                    stop = min(stop, pos + head_room)
                else:
                    body_room = body_limit - self._body_bytes
                    if body_room <= 0:
                        self._refuse_body()
                        return
                    stop = min(stop, pos + body_room)
                if stop <= pos:
                    break  # no room: the rest is held
                piece = data[pos:stop]
                self._completed = False
                super().data_received(piece)
                if self.transport.is_closing() or self._bad_after:
                    return
                if self._too_many:
                    self._refuse_head("too_many_headers")
                    return
                if self._phase == _HEAD and not self._completed:
                    # The whole piece belonged to this head. (A piece in which a request
                    # completed is not counted: the next head's share of it is at most
                    # the room left, so a head is still cut within twice the bound.)
                    self._head_bytes += len(piece)
                elif self._phase == _BODY and not self._completed:
                    self._body_bytes += len(piece)  # (with the head's end, at most)
                pos = stop
        finally:
            self._feeding = False
        self._sync_awaiting_body()
        if pos < end:
            self._hold(data[pos:])
            return
        phase = self._phase
        if phase == _IDLE:
            self._disarm()  # between requests: the idle timer applies
        elif self._deadline_phase != phase:
            self._arm(phase)

    # Parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began_at = self.loop.time()
        self._direct = None
        self._phase = _HEAD
        self._headers_seen = 0
        self._too_many = False
        self._refused = False
        self.stamp(ARRIVED, time.monotonic_ns())

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
        self._body_bytes = 0
        if self._edge is not None:
            self._edge.requests_read += 1
        if self._too_many:
            self._refused = True  # answered 431 once the parser returns
            return
        edge = self._edge
        if edge is not None:
            why = heads.refusal(
                self.http_version(), self.asks_upgrade(), self.method(), self.head()
            )
            if why is not None:
                # The parser stops here and its error path answers (``malformed``).
                self._refused = True
                raise why
        if edge is not None and edge.limits.hosts is not None and not self._host_allowed(edge):
            self._refused = True
            return
        if edge is not None and not self.proven:
            self._prove(edge)
        path = origin_path(self.target())
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
        if not self.answering():
            # Nothing of this connection is being answered: write the refusal now,
            # in this loop turn, without a task; the body, if any, is read and dropped.
            self._refused = True
            shedder.count_refusal(reason)
            self._send_soon(shedder.busy_response)
            if self.keeps_alive():
                self.on_response_complete()
            else:
                self.flush_out()
                self.transport.close()
            return
        # A pipelined request behind one being answered: refuse in order, through
        # uvicorn's own queue, with a refusing app in place of Detour's.
        self.flush_out()
        self.begin_cycle(shedder.refusing_app(reason))

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

    def _prove(self, edge: Edge) -> None:
        """Whether this connection has proven itself: with tokens, by a valid one; on an
        open Detour, by a request the edge lets through (the Host check passed)."""
        if edge.tokens is None:
            self.proven = True
            return
        token, _ = credentials(self.head())
        self.proven = token is not None and edge.tokens.lookup(token) is not None

    # The direct lane ------------------------------------------------------------------

    def _start(self, edge: Edge | None, path: bytes) -> None:
        """An admitted request: to the direct lane when it takes it, else uvicorn's cycle."""
        lane = edge.direct if edge is not None else None
        if (
            lane is not None
            and path in lane.paths
            # POST on HTTP/1.1, in order: nothing of this connection answered or queued.
            and self.may_answer_now()
            and lane.takes(self.head())
            # One the shedder's queue-wait rule refuses goes its way (and is refused).
            and not (
                edge is not None
                and edge.shedder is not None
                and edge.shedder.overdue(self._arrived())
            )
        ):
            self._direct = path
            self._direct_body = []
            return
        self.flush_out()  # the cycle's answer comes after those already pending
        self.begin_cycle()

    def _arrived(self) -> int:
        arrived: int = self.request_scope()[ARRIVED]
        return arrived

    def _answer_directly(self, path: bytes, body: bytes) -> None:
        """The lane's answer in one write, or the request handed to uvicorn's cycle whole."""
        self._direct = None
        edge = self._edge
        assert edge is not None and edge.direct is not None
        answer = edge.direct.answer(path, self.head(), body, self.request_state())
        if answer is None:
            # As if the lane had never looked: the cycle starts with the body complete.
            self.flush_out()
            self.begin_cycle()
            self.give_body(body, self._close_after)
            return
        status, headers, payload = answer
        keep_alive = self.keeps_alive() and not self._close_after
        head = [*self.server_headers(), *headers]
        if not keep_alive:
            head.append(answers.CLOSE)
        self._send_soon(answers.whole(status, head, payload))
        if not keep_alive:
            self.flush_out()
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
            self.flush_out()

    def flush_out(self) -> None:
        """Write the pending answers now (before anything else is written or closed)."""
        out = self._out
        if out is not None:
            self._out = None
            self._out_bytes = 0
            if not self.transport.is_closing():
                self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    # uvicorn's moments ----------------------------------------------------------------

    def response_done(self) -> None:
        self._stop_awaiting_body()
        edge = self._edge
        if edge is None or self.transport.is_closing():
            return
        if self._bad_after and not self.queued() and (not self.answering() or self.abandoned()):
            # What came before the refused bytes is answered (an abandoned request has
            # nothing to answer): now the 400.
            self._write_malformed(self._bad_after_reason)
            return
        self._sync_awaiting_body()
        if self._phase == _IDLE and not self.answering():
            self._idle_at = self.loop.time()
            if not self.proven and self.idle_timer_running():
                self.arm_idle(self._idle_s())
        if self._held:
            self._schedule_feed()

    def may_resume_reading(self) -> bool:
        if self._held:
            # uvicorn would read on (an answer completed, a body was taken): the held
            # bytes come first, and reading resumes once they are parsed.
            self._owes_resume = True
            self._schedule_feed()
            return False
        return True

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._held:
            self._schedule_feed()

    _bad_after_reason = ""

    def malformed(self, message: str) -> None:
        """A request the parser refuses: 400 in the Error shape, then close (also while
        shedding: the fast path takes nothing the parser would refuse). Behind an answer
        under way, once it is out."""
        error = sys.exception()  # called inside uvicorn's ``except HttpParserError``
        refused = error.__context__ if error is not None else None
        head_refused = isinstance(refused, HeadRefused)
        if isinstance(refused, HeadRefused):
            error = refused  # the edge's own refusal of the head (heads.py)
            self._bad_field = refused.field
        reason = str(error)[:200] if error is not None and str(error) else message
        metrics.EDGE_REFUSED.labels("malformed").inc()
        self._held = b""
        if self._edge is None:
            super().malformed(message)
            return
        if self._phase == _BODY and self._refused and not head_refused:
            # The body of a request already answered (the shedder refused its head) is
            # what failed: one answer a request, so the connection just closes after it.
            self._close()
            return
        if self._phase == _BODY and self._direct is None and not self._refused:
            # The body of the request whose head was read last is what failed: its app
            # will not get it, and reads a disconnect.
            running = self.answering() and not self.current_queued()
            started = self.answer_started()
            self.abandon_cycle()
            if running and started:
                self._close()  # its answer is under way: nothing can follow it
                return
            if running:
                self._write_malformed(reason)
                return
        if self.answering() or self.queued():
            # Behind answers under way: they go out first, then the 400.
            self._bad_after = True
            self._bad_after_reason = reason
            self.pause_reading()
            return
        self._write_malformed(reason)

    #: The header a refused head's 400 names (heads.py), if any.
    _bad_field: str | None = None

    def _write_malformed(self, reason: str) -> None:
        self.flush_out()
        self.transport.write(
            answers.raw_error(
                400, "BAD_REQUEST", f"malformed HTTP request: {reason}", self._bad_field
            )
        )
        self._close()

    def stopping(self) -> None:
        self.flush_out()
        if self._direct is not None:
            # Its head is in, as for a request uvicorn's cycle holds: it is answered,
            # then the connection closes.
            self._close_after = True
            return
        super().stopping()

    def idle_timeout(self) -> None:
        self.flush_out()
        if self._unsent():
            # The client has not read its last answer: reset, as at the edge's own
            # deadlines (``_close``), rather than leave the kernel holding it.
            self._reset()
            return
        super().idle_timeout()

    def _idle_s(self) -> float:
        """How long this connection may be idle between requests."""
        edge = self._edge
        if self.proven or edge is None:
            return self.keep_alive_s
        return min(self.keep_alive_s, edge.limits.unproven_idle_s)

    # Pipelining -------------------------------------------------------------------------

    def _unanswered(self) -> int:
        """Requests parsed and not answered. (While some are queued, the one being
        answered is not ``cycle`` but the newest queued one is: counted once each.)"""
        return int(self.answering()) + self.queued() + int(self._direct is not None)

    def _waiting_bytes(self) -> int:
        """Answers not yet taken by the client, and bodies held for queued requests."""
        return self._out_bytes + self.transport.get_write_buffer_size() + self.queued_body_bytes()

    def _hold(self, rest: bytes) -> None:
        """Keep ``rest`` unparsed and stop reading until answers drain."""
        self._held = rest
        if not self.reading_paused():
            self.pause_reading()
            self._owes_resume = True
        self._disarm()
        if self._waiting_bytes() > pipelining.MAX_WAITING_BYTES:
            # The client does not take its answers: it has its head deadline to start.
            self._arm(_HELD)

    def _schedule_feed(self) -> None:
        if not self._feed_soon:
            self._feed_soon = True
            self.loop.call_soon(self._feed_held)

    def _feed_held(self) -> None:
        """Give the held bytes to the parser as far as the bound now allows (an answer
        completed or drained); once none is held, reading resumes if the edge paused it."""
        self._feed_soon = False
        edge = self._edge
        if not self._held or edge is None or self._feeding or self.transport.is_closing():
            return
        data, self._held = self._held, b""
        self._consume(data, edge)
        if not self._held and self._owes_resume and not self.transport.is_closing():
            self._owes_resume = False
            self.resume_reading()

    # Refusals without the parser ----------------------------------------------------

    def _refuse_fast(self, data: bytes, edge: Edge, shedder: Shedder) -> bytes:
        """Refuse the whole simple requests at the start of ``data``; returns the rest.

        Called only between messages, with nothing of this connection being answered,
        while the service is shedding. Each whole request whose head is simple
        (service/edge/scan.py: nothing the parser would refuse, no foreign Host, within
        the head bounds) and whose body is in ``data`` too is put to the shedder; the
        refused ones are answered 503 in one write (they never reach the app; the probes
        and scrapes are left to the parser, as they are never shed). The first request
        the shedder admits, anything not simple or not whole, and whatever would take the
        answers waiting for this client past the pipelining bound, go to the parser with
        the rest: the scan never looks further than the head bound, and never past what
        the parser and the edge would accept.

        A client sends the same head again and again, so the connection remembers the
        last simple head it scanned: a request starting with those exact bytes is not
        scanned again. With that, and the idle timer moved rather than replaced, a refusal
        costs little more than a server that only refuses (``python -m
        bench.refusal_cost``; the figures are in docs/BENCHMARKS.md).
        """
        limits = edge.limits
        end = len(data)
        pos = 0
        refused: dict[str, int] = {}
        count = 0
        known = self._known_head
        busy = len(shedder.busy_response)
        most = max(0, (pipelining.MAX_WAITING_BYTES - self._waiting_bytes()) // busy)
        while pos < end and count < most:
            if known and data.startswith(known, pos):
                stop = pos + len(known) + self._known_body
            else:
                head_end, body = simple_request(
                    data, pos, limits.max_header_bytes, limits.max_headers, limits.hosts,
                    EXEMPT_RAW,
                )  # fmt: skip
                if head_end < 0:
                    break
                if head_end - pos <= _KNOWN_HEAD_MAX:
                    known = self._known_head = data[pos:head_end]
                    self._known_body = body
                stop = head_end + body
            if stop > end:
                break  # the body is still arriving: the parser reads it
            reason = shedder.refusal()
            if reason is None:
                self._admitted = True
                break
            refused[reason] = refused.get(reason, 0) + 1
            count += 1
            pos = stop
        if not refused:
            return data
        for reason, n in refused.items():
            shedder.count_refusal(reason, n)
        self._disarm()  # between requests now, as after any answered request
        self._send_soon(shedder.busy_response * count)
        self.count_answered(count)
        self._idle_at = self.loop.time()
        if pos < end:
            self.cancel_idle()  # the parser reads the rest
        else:
            self.arm_idle(self._idle_s())  # idle until the next request
        return data[pos:]

    # Bounds --------------------------------------------------------------------------

    def _refuse_head(self, reason: str) -> None:
        """431 for a head over the bounds, then close (nginx and Envoy close too)."""
        metrics.EDGE_REFUSED.labels(reason).inc()
        if not self.answering():
            edge = self._edge
            assert edge is not None
            what = (
                f"more than {edge.limits.max_headers} headers"
                if reason == "too_many_headers"
                else f"request line and headers over {edge.limits.max_header_bytes} bytes"
            )
            self.flush_out()
            self.transport.write(answers.raw_error(431, "HEADERS_TOO_LARGE", what, "headers"))
        self._close()

    def _refuse_body(self) -> None:
        """413 for what follows a head past any body's bound (``EdgeLimits.max_body_bytes``:
        a chunked body's framing, a trailer growing without end), then close."""
        metrics.EDGE_REFUSED.labels("body_too_large").inc()
        if not self.answering():  # (an app reading it reads a disconnect)
            self.flush_out()
            self.transport.write(
                answers.raw_error(
                    413, "PAYLOAD_TOO_LARGE", "request body, framing or trailers too large", "body"
                )
            )
        self._close()

    def _host_allowed(self, edge: Edge) -> bool:
        """Whether the Host is allowed; if not, answers 421 and closes (DNS rebinding)."""
        hosts = edge.limits.hosts
        assert hosts is not None
        target = self.target()
        absolute = authority(target)
        names = (
            [(b"host", absolute)] if absolute is not None else self.head()
        )  # an absolute-form target's host counts, not the Host header (RFC 9112 3.2.2)
        for name, value in names:
            if name == b"host":
                if hosts.allows(value) or origin_path(target) in _ANY_HOST:
                    return True
                metrics.EDGE_REFUSED.labels("host").inc()
                if not self.answering():
                    shown = value[:100].decode("latin-1")
                    self.flush_out()
                    self.transport.write(
                        answers.raw_error(
                            421,
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
        if phase == _BODY:
            delay = limits.body_timeout_s
        elif phase == _IDLE and not self.proven:
            delay = min(limits.header_timeout_s, limits.unproven_idle_s)
        else:
            delay = limits.header_timeout_s
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
        if self.transport.is_closing():
            return
        if phase == _HELD:
            if self._held:
                metrics.EDGE_REFUSED.labels("send_timeout").inc()
                self._close(drop_unsent=True)  # it takes no answers: none is written
            return
        if self._phase != phase:
            return
        reason = {_BODY: "body_timeout", _IDLE: "idle_timeout"}.get(phase, "header_timeout")
        metrics.EDGE_REFUSED.labels(reason).inc()
        if phase != _IDLE and not self.answer_started() and not self._unsent():
            what = "request body" if phase == _BODY else "request headers"
            self.flush_out()
            self.transport.write(
                answers.raw_error(408, "REQUEST_TIMEOUT", f"{what} too slow", None)
            )
        self._close(drop_unsent=True)

    def _close(self, drop_unsent: bool = False) -> None:
        """Close the connection. ``drop_unsent`` (a deadline passed): if what was written
        to it has not all left, the client is not reading, and the connection is reset
        instead. A close sends the FIN behind the unsent bytes, and the kernel then keeps
        them for minutes (FIN-WAIT-1, retrying a zero window) after the connection has
        left the connection table, so closed connections held memory that no cap counted:
        about 1.7 MB each for a /latency-log page."""
        self.flush_out()
        self._held = b""
        self.abandon_cycle()
        self._disarm()
        self._stop_awaiting_body()
        if drop_unsent and self._unsent():
            self._reset()
        else:
            self.transport.close()

    def _reset(self) -> None:
        """Reset the connection, dropping what it has not sent: SO_LINGER 0, so that the
        kernel discards its send queue and answers RST (``abort`` alone only drops the
        transport's buffer; the kernel's close still sends the queue, then FIN)."""
        metrics.EDGE_REFUSED.labels("unread_reset").inc()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            except OSError:
                pass
        self.transport.abort()

    def _unsent(self) -> int:
        """Bytes written to this connection that have not left: the transport's buffer,
        and the kernel's send queue (TIOCOUTQ); the latter 0 when it cannot be read."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                unsent += struct.unpack("i", queued)[0]
            except (OSError, ValueError):
                pass
        return unsent

    def _sync_awaiting_body(self) -> None:
        """A request inside the app whose body is still arriving is not in flight (it is
        bounded by the body deadline instead); one queued behind another, refused, or
        read by the direct lane is not inside the app."""
        if (
            self._phase == _BODY
            and self.answering()
            and not self._refused
            and self._direct is None
            and not self.current_queued()
        ):
            self._start_awaiting_body()
        else:
            self._stop_awaiting_body()

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


#: What a connection refused when accepted is told, by the refusal's reason.
_BUSY_CONNECTIONS = {
    "connections": "too many connections, none idle: retry shortly or decide locally",
    "peer_connections": "too many connections from this address: reuse one",
}
