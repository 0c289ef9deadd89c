"""The one module that knows uvicorn's internals: its httptools protocol, subclassed.

uvicorn has no extension point below ASGI, and the edge's rules (head bounds, read
deadlines, fair connections, the pipelining bound, the shedder's refusals, the direct
lane) must act where the server parses and writes. So ``UvicornHttp`` subclasses uvicorn's
``HttpToolsProtocol`` and gives the edge's protocol (service/edge/protocol.py) a small
vocabulary of its own; nothing else in Detour names a uvicorn internal (import-linter
holds it: only this module may import uvicorn's protocol). ``pyproject.toml`` pins
uvicorn's minor, and ``tests/test_uvicorn_seam.py`` checks every item below against the
installed uvicorn, so an upgrade that changes one fails there, by name, not somewhere in
the edge's behaviour.

What it reads or calls, and why:

* ``HttpToolsProtocol.__init__`` sets ``parser`` (httptools: method, version,
  keep-alive, upgrade), ``url`` and ``headers`` (the request being parsed), ``scope``
  (its ``state`` is the lifespan state's copy; the edge stamps the arrival time in it),
  ``cycle`` (the ``RequestResponseCycle`` of the request answered last or now),
  ``pipeline`` (a deque of ``(cycle, app)`` queued behind it, newest at the left),
  ``flow`` (``FlowControl``), ``app``, ``app_state`` (the lifespan state: the ``Edge``),
  ``server_state`` (``total_requests``, ``default_headers``), ``client`` (the peer),
  ``timeout_keep_alive`` and ``timeout_keep_alive_task`` (the idle timer): read to know
  where a connection is, and what a direct answer's head carries.
* ``on_headers_complete`` builds the cycle and starts its task, or queues it with
  ``flow.pause_reading()`` behind one being answered: ``begin_cycle`` calls it, with
  another app when the shedder refuses a pipelined request in order.
* A cycle's ``body``, ``more_body`` and ``message_event`` (``receive`` waits on the
  event, then takes the body and clears it; it calls ``flow.resume_reading()`` first):
  ``give_body`` hands the direct lane's body to a cycle it declined.
  ``response_started``, ``response_complete``, ``disconnected``, ``keep_alive``: read
  and set as uvicorn does when a connection goes away or must close after its answer.
* ``on_response_complete`` is each cycle's ``on_response``: it counts the request, resumes
  reading, starts the next queued cycle (``_start_asgi_task``) or arms the idle timer.
  The seam has its own copy of it, the same steps but for the idle timer (below); the
  edge runs ``response_done`` after it.
* The idle timer, ``timeout_keep_alive_task``: uvicorn starts a new one after every answer
  and cancels it (``_unset_keepalive_if_required``) at every read, a timer made and
  cancelled per request on a keep-alive connection. The seam keeps one per connection
  and moves it only when it fires: a read or an answer just notes whether the
  connection is idle and since when, and the timer, firing, closes the connection if it
  has been idle long enough, waits out the rest if not, and lapses if it is busy. The
  connection closes when it would have; a select is spared the timer's churn.
* ``FlowControl``'s ``pause_reading``/``resume_reading``/``read_paused``/``write_paused``:
  the pipelining bound replaces the connection's ``flow`` with a subclass whose
  ``resume_reading`` asks the edge first (uvicorn resumes reading after each answer and
  each body read; the edge may be holding bytes it has not parsed yet).
* ``send_400_response`` (``data_received`` calls it for every parser error, then
  returns): the edge's ``malformed``. ``timeout_keep_alive_handler``: ``idle_timeout``.
  ``shutdown`` (the server's graceful stop): ``stopping``.
* ``STATUS_LINE``: compared by the test with the edge's own status lines
  (service/edge/answers.py), so that a direct answer's head is uvicorn's byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Header = tuple[bytes, bytes]

#: The event loop clock's resolution (uvloop's: a millisecond), for comparing its times.
CLOCK_RESOLUTION_S = 0.001


class _Flow(FlowControl):
    """uvicorn's flow control, asking the edge before reading resumes."""

    def __init__(self, transport: asyncio.Transport, may_resume: Callable[[], bool]) -> None:
        super().__init__(transport)
        self._may_resume = may_resume

    def resume_reading(self) -> None:
        if self.read_paused and not self._may_resume():
            return
        super().resume_reading()

    def resume_anyway(self) -> None:
        FlowControl.resume_reading(self)


class UvicornHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, spoken to through the methods below."""

    flow: _Flow

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _Flow(transport, self.may_resume_reading)

    # Hooks for the edge ---------------------------------------------------------------

    def may_resume_reading(self) -> bool:
        """Asked when uvicorn would resume reading the socket; False keeps it paused."""
        return True

    def response_done(self) -> None:
        """After an answer completed (uvicorn counted it and moved on)."""

    def malformed(self, message: str) -> None:
        """The parser refused what was read (uvicorn's 400, then close)."""
        HttpToolsProtocol.send_400_response(self, message)

    def idle_timeout(self) -> None:
        """The idle timer fired (uvicorn closes the connection)."""
        HttpToolsProtocol.timeout_keep_alive_handler(self)

    def stopping(self) -> None:
        """The server is stopping (uvicorn closes an idle connection, or one whose answer
        is under way after that answer)."""
        HttpToolsProtocol.shutdown(self)

    # uvicorn's entry points, routed to the hooks ---------------------------------------

    def on_response_complete(self) -> None:
        # uvicorn's steps, in its order, but for the idle timer: armed lazily.
        self.server_state.total_requests += 1
        if not self.transport.is_closing():
            self._idle_start = None
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self.arm_idle(self.timeout_keep_alive)
        self.response_done()

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn cancels the idle timer here (a read began, the connection went away):
        # the connection is busy, and the timer lapses when it fires.
        self._idle_start = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._idle_start = None
        if self.timeout_keep_alive_task is not None:
            # Gone: the timer would keep the protocol alive until it fired.
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def send_400_response(self, msg: str) -> None:
        self.malformed(msg)

    def timeout_keep_alive_handler(self) -> None:
        self.idle_timeout()

    def shutdown(self) -> None:
        self.stopping()

    # The connection ---------------------------------------------------------------------

    def peer_host(self) -> str:
        return self.client[0] if self.client else ""

    def lifespan_state(self) -> dict[str, Any]:
        return self.app_state

    def server_headers(self) -> list[Header]:
        """The headers uvicorn puts on every answer (``date``; ``server`` is off)."""
        return self.server_state.default_headers

    def count_answered(self, n: int) -> None:
        """Requests answered without a cycle (uvicorn's request counter)."""
        self.server_state.total_requests += n

    # The request being parsed ---------------------------------------------------------

    def keeps_alive(self) -> bool:
        return self.parser.should_keep_alive()

    def http_version(self) -> str:
        """The parsed head's HTTP version (``"1.1"``; ``"0.9"`` for a version-less line)."""
        return self.parser.get_http_version()

    def method(self) -> bytes:
        return self.parser.get_method()

    def asks_upgrade(self) -> bool:
        """The parsed head asks for another protocol (``Connection: upgrade`` with
        ``Upgrade``, or ``CONNECT``): the parser reads nothing of HTTP after it."""
        return self.parser.should_upgrade()

    def target(self) -> bytes:
        """The request target as sent (path and query)."""
        return self.url

    def head(self) -> list[Header]:
        """The request's headers so far, names lower case."""
        return self.headers

    def request_state(self) -> dict[str, Any]:
        """The request's state (a copy of the lifespan state)."""
        state: dict[str, Any] = self.scope["state"]
        return state

    def request_scope(self) -> dict[str, Any]:
        """The request's ASGI scope (the edge stamps its arrival time in it)."""
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]
        return scope

    def stamp(self, key: str, value: object) -> None:
        """Put ``key`` in the request's scope (the shedder reads its arrival time)."""
        self.request_scope()[key] = value

    def begin_cycle(self, app: Any = None) -> None:
        """Start uvicorn's cycle for the parsed head: the app (or ``app`` instead) runs,
        at once or queued behind the answer under way."""
        if app is None:
            HttpToolsProtocol.on_headers_complete(self)
            return
        own, self.app = self.app, app
        try:
            HttpToolsProtocol.on_headers_complete(self)
        finally:
            self.app = own

    def give_body(self, body: bytes, close_after: bool) -> None:
        """Hand the cycle just begun its whole body (``close_after``: close once answered)."""
        cycle = self.cycle
        if close_after:
            cycle.keep_alive = False
        cycle.body += body
        cycle.more_body = False
        cycle.message_event.set()

    def abandon_cycle(self) -> None:
        """The connection goes away under an answer: the app, if it is waiting for the
        body, reads a disconnect; what it answers is dropped."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()

    def may_answer_now(self) -> bool:
        """The parsed head is a POST on HTTP/1.1, without ``Expect`` or ``Upgrade``, and
        nothing of this connection is being answered or queued, its writes not paused:
        a request the direct lane may answer in order (one call: it runs per request)."""
        cycle = self.cycle
        parser = self.parser
        return (
            (cycle is None or cycle.response_complete)
            and not self.pipeline
            and not self.flow.write_paused
            and not self.expect_100_continue
            and parser.get_method() == b"POST"
            and parser.get_http_version() == "1.1"
            and not parser.should_upgrade()
        )

    # Where the connection is ----------------------------------------------------------

    def answering(self) -> bool:
        """An answer of this connection is under way (its cycle has not completed)."""
        return self.cycle is not None and not self.cycle.response_complete

    def answer_started(self) -> bool:
        return self.cycle is not None and self.cycle.response_started

    def abandoned(self) -> bool:
        """The request being answered or queued last was abandoned (``abandon_cycle``)."""
        return self.cycle is not None and self.cycle.disconnected

    def queued(self) -> int:
        """Requests queued behind the one being answered."""
        return len(self.pipeline)

    def current_queued(self) -> bool:
        """The request being read is queued behind another (not in the app yet)."""
        return bool(self.pipeline) and self.pipeline[0][0] is self.cycle

    def queued_body_bytes(self) -> int:
        """Bytes of body held for queued requests."""
        return sum(len(cycle.body) for cycle, _ in self.pipeline)

    def pause_reading(self) -> None:
        self.flow.pause_reading()

    def reading_paused(self) -> bool:
        return self.flow.read_paused

    def resume_reading(self) -> None:
        """Resume reading the socket, the edge's own decision."""
        self.flow.resume_anyway()

    # The idle timer ---------------------------------------------------------------------

    @property
    def keep_alive_s(self) -> float:
        return float(self.timeout_keep_alive)

    #: Loop time the connection has been idle since, or None while it is busy.
    _idle_start: float | None = None
    #: How long it may stay idle from then.
    _idle_delay = 0.0

    def idle_timer_running(self) -> bool:
        """The connection is idle and its idle timer counts."""
        return self._idle_start is not None

    def arm_idle(self, delay_s: float) -> None:
        """``idle_timeout`` once the connection has been idle ``delay_s`` from now,
        unless it gets busy first. A timer already due no later is left to move itself.

        "No later" is judged to the loop clock's resolution: uvloop counts milliseconds,
        and in the millisecond a timer was made its ``when()`` and ``time() + delay`` can
        differ in a float's last digit, and the timer was replaced for nothing."""
        now = self.loop.time()
        self._idle_start = now
        self._idle_delay = delay_s
        task = self.timeout_keep_alive_task
        if task is not None:
            if task.when() <= now + delay_s + CLOCK_RESOLUTION_S:
                return
            task.cancel()
        self.timeout_keep_alive_task = self.loop.call_later(delay_s, self._idle_check)

    def cancel_idle(self) -> None:
        """The connection is busy: the idle timer stops counting."""
        self._idle_start = None

    def _idle_check(self) -> None:
        self.timeout_keep_alive_task = None
        start = self._idle_start
        if start is None:
            return  # busy: the next answer arms it again
        left = start + self._idle_delay - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._idle_check)
            return
        self._idle_start = None
        self.timeout_keep_alive_handler()
