"""Fast failure under overload (RocketMQ's BrokerFastFailure): refuse at once, don't queue.

A producer waiting on a select that will come too late is worse off than one told
"busy" at once: the SDK then decides locally (fail-open). Three rules, all answered
with 503 ``{"error": "SYSTEM_BUSY"}`` and ``Retry-After`` and counted in
``detour_requests_shed_total{reason}``:

* ``in_flight``: ``max_in_flight`` requests are already being handled (a slow
  Redis makes reports pile up; a burst fills the event loop). The server protocol
  checks this as soon as a request's headers are read and writes the refusal itself,
  without a task or Detour's app: a few µs, in the loop turn that read the request.
  A request whose body is still arriving is not in flight (the protocol says which):
  slow bodies are bounded by the body deadline and the connection bound instead.
* ``turn_budget``: while the service is shedding, one turn of the event loop starts only
  as many requests as keep its CPU time near ``turn_budget_ms`` (``TurnBudget``).
  Shedding starts with an ``in_flight`` or ``queue_wait`` refusal and lasts a second
  after the last refusal that renews it. A refusal waits for at most the turn before it,
  so short turns are what make refusals come back at once under a large overload;
  outside shedding, bursts pass untouched. While the loop stays saturated as it sheds,
  the limit falls below one a turn (``TurnBudget.squeeze``), so that refusals do not
  wait out a throttled CPU quota. Its own refusals prolong shedding only while the loop
  is saturated or squeezed: at half load, one long turn (a pause, a burst) made the
  limit refuse for a moment, and when those refusals prolonged shedding, they kept it
  going for as long as the load lasted (a third to a half of half load refused); under a
  lasting overload, a lapse starts every waiting request in one turn, and that turn
  stalls everything behind it.
* ``queue_wait``: the request waited longer than ``max_queue_wait_ms`` between
  being read off the socket and being served — the event loop is behind, like a
  send request that sat in RocketMQ's queue past ``waitTimeMillsInSendQueue``.
  The arrival time comes from ``EdgeProtocol`` (service/edge/protocol.py, uvicorn's
  protocol stamping the scope when a request begins); without it only the first
  rule acts.

Probes and scrapes (``/healthz``, ``/readyz``, ``/metrics``) are never shed and not
counted as in flight. A push stream's connect is shed and counted like any request
(a reconnect loop costs a snapshot each), but only until its response starts: its
endless life is bounded by the stream caps instead (service/api/stream.py).
docs/reliability.md, "Overload".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import metrics
from service.edge import answers
from service.edge.cpu_share import CpuShare

#: The scope key the protocol stamps (monotonic ns when the request began).
ARRIVED = "detour.arrived_ns"
#: Probes and scrapes: never shed, never counted.
_EXEMPT = frozenset({"/healthz", "/readyz", "/metrics"})
EXEMPT_RAW = frozenset(p.encode() for p in _EXEMPT)
#: Endless responses: in flight from their connect until their response starts.
_STREAMS = frozenset({"/fault-items/stream"})
STREAMS_RAW = frozenset(p.encode() for p in _STREAMS)


class TurnBudget:
    """How many new requests one turn of the event loop may start while shedding.

    Why a turn: the protocol writes a refusal in the turn that reads the request, so a
    refusal waits at most for the turn before it, and a turn lasts as long as the reads
    plus the work of the requests it started. The in-flight bound caps that work only
    at ``max_in_flight`` requests, tens of milliseconds of reports, and a smaller bound
    refuses ordinary bursts. So while the service is shedding, the number of requests a
    turn may start follows the CPU the previous turn used (additive increase,
    multiplicative decrease): over ``budget_ms`` halves it, under adds one. The CPU the
    reads leave still goes to started requests, but short turns cost loop overhead:
    at 5x, reports are answered at about a third of capacity, against about half with
    an in-flight bound of 32 and no budget (docs/BENCHMARKS.md, overload).

    Short turns alone do not bound the rate, though: a limit of one a turn still starts
    thousands a second when turns are short. Under a CPU cap at 2x, that kept the loop
    saturated: refusals waited out throttled periods (p99 4-6 ms in each quarter
    second), and a backlog built at the start of an overload took up to two seconds to
    drain (p99 of hundreds of ms). So a saturation window that closes while shedding
    (``squeeze``) halves the limit further, below one: a limit of 1/8 starts one request
    every eighth turn. While squeezed the limit does not grow; after, it grows 5% a turn
    up to one, then one a turn as before, and each window that closes unsaturated
    doubles a limit below one. Turns alone are not enough: when requests come one a
    turn, seconds apart (SDK producers backing off), 5% a turn took about 114 of them
    from the floor back to one, each refused and each renewing the hold, so a replica
    with CPU to spare kept refusing the producers' report batches for minutes
    (docs/BENCHMARKS.md, "Overload as producers see it"). By windows, the floor is back
    to one within eight unsaturated ones.

    CPU time, not wall time, so that an idle loop waiting for the next request does not
    look like a long turn. Pure bookkeeping, clocks injected: the caller marks where a
    turn begins (``begin``), asks per request (``may_start``), and reports each closed
    saturation window (``squeeze``).
    """

    #: The smallest limit: one start every 256 turns.
    FLOOR = 1 / 256
    #: Growth a turn below one: from the floor back to one in about 114 turns.
    REGROWTH = 1.05

    def __init__(
        self, budget_ms: float, ceiling: int, cpu_ns: Callable[[], int] = time.thread_time_ns
    ) -> None:
        self.budget_ns = int(budget_ms * 1_000_000)
        self.ceiling = max(1, ceiling)
        #: Starts a turn may make; below one, a fraction of turns may start one.
        self.limit: float = self.ceiling
        #: What this turn may start (the limit, or 0/1 by the credit below one).
        self.allowed = self.ceiling
        self.started = 0
        self.squeezed = False
        self._credit = 0.0
        self._cpu_ns = cpu_ns
        self._turn_began = cpu_ns()

    def begin(self) -> None:
        """A new turn read its first request: judge the turn before it."""
        now = self._cpu_ns()
        used, self._turn_began = now - self._turn_began, now
        self.started = 0
        if self.budget_ns <= 0:
            return  # no budget: the limit stays at the ceiling
        limit = self.limit
        if used > self.budget_ns:
            if limit >= 1:
                limit = max(1, int(limit) // 2)
        elif not self.squeezed and limit < self.ceiling:
            limit = limit + 1 if limit >= 1 else min(1.0, limit * self.REGROWTH)
        self.limit = limit
        if limit >= 1:
            self.allowed = int(limit)
        else:
            self._credit += limit
            self.allowed = 1 if self._credit >= 1 else 0
            if self.allowed:
                self._credit -= 1

    def squeeze(self, saturated: bool) -> None:
        """A saturation window closed: ``saturated`` while shedding halves the limit
        (down to ``FLOOR``), which then does not grow until a window closes otherwise;
        a window that closes otherwise doubles a limit below one (up to one)."""
        self.squeezed = saturated and self.budget_ns > 0
        if self.squeezed:
            self.limit = max(self.FLOOR, self.limit / 2)
        elif self.limit < 1:
            self.limit = min(1.0, self.limit * 2)

    def may_start(self) -> bool:
        return self.started < self.allowed


class Saturation:
    """Whether the event loop used nearly all the CPU it may use over the last window.

    Why: while the service sheds, the turn limit's refusals show that more arrives than
    the limit lets start, but that alone does not say the service is overloaded. A
    loop at half load refuses too after one long turn (a pause, a burst), as the limit
    halves and then grows back; when those refusals kept shedding going, they kept
    themselves going, and a third to a half of half load was refused for as long as the
    load lasted. Under a lasting overload, on the other hand, shedding must not lapse:
    each lapse starts every waiting request at once, and that turn stalls everything
    behind it for tens of milliseconds. A saturated loop tells the two apart. Under a
    CPU quota a saturated process uses only its quota, so the share is of what it may
    use (``CpuShare``), not of wall time.

    Pure bookkeeping, clocks injected: ``update`` at each turn; a window closes once it
    is ``window_ms`` old.
    """

    def __init__(
        self,
        cores: Callable[[], float],
        threshold: float = 0.85,
        window_ms: float = 100.0,
        cpu_ns: Callable[[], int] = time.thread_time_ns,
        wall_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.threshold = threshold
        self.window_ns = int(window_ms * 1_000_000)
        self.saturated = False
        self._cores = cores
        self._cpu_ns = cpu_ns
        self._wall_ns = wall_ns
        self._cpu0 = cpu_ns()
        self._wall0 = wall_ns()

    def update(self) -> bool:
        """Close the window if it is over; whether it closed."""
        wall = self._wall_ns()
        elapsed = wall - self._wall0
        if elapsed < self.window_ns:
            return False
        cpu = self._cpu_ns()
        used = (cpu - self._cpu0) / (elapsed * self._cores())
        self.saturated = used >= self.threshold
        self._cpu0, self._wall0 = cpu, wall
        return True


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("Shedder.wrap was not called")


class Shedder:
    """The outermost middleware, and the state the protocol consults: in flight,
    the turn being read, and whether the service is shedding."""

    def __init__(
        self,
        app: ASGIApp | None,
        max_in_flight: int,
        max_queue_wait_ms: float,
        turn_budget_ms: float = 0.0,
        shedding_hold_s: float = 1.0,
        saturation: Saturation | None = None,
    ) -> None:
        #: The app it guards; None until ``wrap`` (the app's middleware stack is built
        #: after the shedder, which the protocol reaches through the lifespan state).
        self.app: ASGIApp = app or _no_app
        self.max_in_flight = max_in_flight
        self.max_wait_ns = int(max_queue_wait_ms * 1_000_000)
        #: Requests inside Detour's app (started, not finished).
        self.in_flight = 0
        #: Of those, requests whose body is still arriving (kept by the protocol): not
        #: counted as in flight, so that slow bodies cannot fill the bound.
        self.awaiting_body = 0
        #: The turn being read: how many requests it started, and the per-turn limit
        #: (a 0 ms budget: no limit, the in-flight bound alone).
        self.turns = TurnBudget(turn_budget_ms, max_in_flight)
        #: Whether the loop is saturated: the turn limit's refusals prolong shedding
        #: only then (``Saturation``).
        self.saturation = saturation or Saturation(CpuShare().cores)
        self._turn_open = False
        #: Shedding lasts until this long after the last refusal (monotonic ns).
        self.hold_ns = int(shedding_hold_s * 1_000_000_000)
        self.shedding_until = 0
        #: The whole HTTP/1.1 answer, for refusals written by the protocol itself.
        self.busy_response = answers.BUSY
        self._refusing_apps: dict[str, ASGIApp] = {}
        self._shed_series = {
            r: metrics.SHED.labels(r) for r in ("in_flight", "turn_budget", "queue_wait")
        }

    def wrap(self, app: ASGIApp) -> ASGIApp:
        """Guard ``app`` (a middleware factory for ``add_middleware``)."""
        self.app = app
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _EXEMPT:
            await self.app(scope, receive, send)
            return
        arrived = scope.get(ARRIVED)
        if arrived is not None:
            now = time.monotonic_ns()
            if now - arrived > self.max_wait_ns:
                self.shedding_until = now + self.hold_ns
                await self._refuse(send, "queue_wait")
                return
        if self.in_flight - self.awaiting_body >= self.max_in_flight:
            # Only without the protocol's check (another server): shed the same way.
            self.shedding_until = time.monotonic_ns() + self.hold_ns
            await self._refuse(send, "in_flight")
            return
        self.in_flight += 1
        if scope["path"] in _STREAMS:
            await self._stream(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An endless response, in flight until it starts (counted in ``in_flight`` already)."""
        counted = True

        async def started(message: Message) -> None:
            nonlocal counted
            if counted and message["type"] == "http.response.start":
                counted = False
                self.in_flight -= 1
            await send(message)

        try:
            await self.app(scope, receive, started)
        finally:
            if counted:
                self.in_flight -= 1

    def refusal(self) -> str | None:
        """Called by the protocol when a request's headers are read: why to refuse it
        at once, or None to start it. An ``in_flight`` refusal starts (or prolongs)
        shedding; a ``turn_budget`` one happens only while shedding, and prolongs it
        only while the loop is saturated (``Saturation``) or the limit is squeezed
        below one a turn.

        In flight = requests inside the app plus those this turn started: their tasks
        run only after the turn has read everything, and a task that has answered but
        not yet been reaped by uvicorn is no longer counted."""
        turns = self.turns
        if not self._turn_open:
            # The first request of this turn; the turn ends when the loop runs the
            # callbacks it queued, after everything it read.
            self._turn_open = True
            asyncio.get_running_loop().call_soon(self._close_turn)
            turns.begin()
            sat = self.saturation
            if sat.update():
                turns.squeeze(sat.saturated and time.monotonic_ns() < self.shedding_until)
        if self.in_flight - self.awaiting_body + turns.started >= self.max_in_flight:
            self.shedding_until = time.monotonic_ns() + self.hold_ns
            return "in_flight"
        if not turns.may_start():
            now = time.monotonic_ns()
            if now < self.shedding_until:
                if self.saturation.saturated or turns.limit < 1:
                    # Saturated, or kept from it by the squeeze: a lapse now would
                    # start every waiting request in one turn.
                    self.shedding_until = now + self.hold_ns
                return "turn_budget"
        turns.started += 1
        return None

    def overdue(self, arrived_ns: int) -> bool:
        """Whether a request that began at ``arrived_ns`` has waited past the bound."""
        return time.monotonic_ns() - arrived_ns > self.max_wait_ns

    def _close_turn(self) -> None:
        self._turn_open = False

    def refusing_app(self, reason: str) -> ASGIApp:
        """An app answering 503 for ``reason`` (pipelined requests, in order)."""
        app = self._refusing_apps.get(reason)
        if app is None:

            async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
                await self._refuse(send, reason)

            app = self._refusing_apps[reason] = refuse
        return app

    def count_refusal(self, reason: str, count: int = 1) -> None:
        self._shed_series[reason].inc(count)

    async def _refuse(self, send: Send, reason: str) -> None:
        self.count_refusal(reason)
        start, body = answers.BUSY_MESSAGES
        await send(start)
        await send(body)
