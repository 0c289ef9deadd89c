"""Cached mode's model of the service: its clock and its table, from the event stream.

The stream (``GET /fault-items/stream``) sends a snapshot, then every change,
each event with ``now``, the service's clock when it was sent. Applying events
here (not in the readers) keeps the sync thread and the async task identical.

Two rules the stream alone would get wrong:

* Clock: windows are on the service's clock (Redis ``TIME``), so the replica
  estimates it as the local monotonic clock plus ``now - received``: the best
  (largest) such bound seen on the current stream (see ``ServiceClock``). It lags
  the service by the one-way delay: a window is seen to end a little late, never
  early.
* Own reports: this client applies its reports at once, but a snapshot (after a
  reconnect) or an event written before its report reached Detour would undo
  them until Detour's push of the report arrives. So reports Detour has not yet
  accepted are re-applied after every snapshot, and after a fault event for
  their broker, written with the event (``LocalTable.set_fault``: worked out
  before the table's lock is taken, and again under it if a report landed meanwhile).

The re-application is bounded, whatever the queue holds: while Detour refuses
batches, 10,000 reports may wait, and re-applying every one of a broker's after
each of its events held the producer's interpreter for ~90 ms an event (its
sends' decisions waited behind it). What a broker's item says of this client's
reports is, by the rule (``detour.apply``), its newest answers (the latency, its
own votes, lastReportWins) and the window its reports asked for, which only
grows. So an event re-applies, per broker, the newest ``REAPPLY_NEWEST``
reports and, before them, the older report whose own window ends last (an
isolation behind a run of fast answers), found among the newest
``REAPPLY_SCAN`` waiting reports. Older reports of the broker are not
re-applied: their effect on the copy returns with Detour's push once their
batch is accepted (or they are dropped, and counted).

And once Detour has answered a batch, its reports are no longer re-applied. An event that
arrived while the batch was in flight may already hold them, or may be one they were meant
to undo: an operator's restore, a probe that passed. So the broker's item becomes Detour's
last again, with only the reports still waiting on top (``StreamApplier.settle``). A
report Detour applied after that event comes back with its own push, milliseconds later.
Re-applying it instead would keep a restored broker avoided for the rest of its window.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from detour import strategy
from detour.client import wire
from detour.client.local import LocalTable, OwnReport
from detour.client.pending import Pending, PendingReports
from detour.client.sse import Event
from detour.clock import Readings, mono_ms
from detour.model import Config, FaultItem

#: Flush reports at least this often (s) ...
FLUSH_INTERVAL_S = 0.05
#: ... or as soon as this many are waiting (an isolation flushes at once).
FLUSH_AT = 256
#: The stream sends a clock event every second: this much silence means it is dead (s).
STREAM_IDLE_S = 5.0
#: Where the stream is.
STREAM_PATH = "/fault-items/stream"
#: An event re-applies at most this many of a broker's newest waiting reports ...
REAPPLY_NEWEST = 8
#: ... and the one whose window ends last, looking no further back than this many of
#: all waiting reports (the bound on an event's work, however long the queue).
REAPPLY_SCAN = 512


#: A sample this far below the current estimate is a step of the service's clock, not a
#: late event (ms).
CLOCK_STEP_MS = 10_000


class ServiceClock:
    """Epoch ms on the service's clock, estimated from the stream's ``now``.

    Every sample ``now - received`` is a lower bound (the event left before it
    arrived), and a late event (a busy machine, a stalled replica) gives a much
    lower one. The largest sample of the current connection is the best bound,
    so the estimate only moves forward, except for a step of more than
    ``CLOCK_STEP_MS`` back (the service's clock was set back) or a new connection.
    Moving back on every late event would make brokers reported moments ago look
    avoided again and again.

    Read, it never goes back short of that step (``detour.clock.Readings``), even on a
    new connection whose first sample is lower (another replica, whose own estimate
    trails Redis's clock a little more).
    """

    def __init__(self) -> None:
        # Until the first event, the process wall clock is the best guess.
        self._readings = Readings(time.time_ns() / 1_000_000 - mono_ms())
        self._bounded = False
        self._guessed = True  # the offset is still the wall clock's guess
        #: Epoch ms on the service's clock now (every select reads it: one call, no wrapper).
        self.now_ms: Callable[[], int] = self._readings.read

    @property
    def offset_ms(self) -> float:
        """The service's clock minus the local monotonic clock, as estimated now."""
        return self._readings.offset_ms

    def reconnected(self) -> None:
        """A new stream (maybe from another replica): the next sample starts over."""
        self._bounded = False

    def observe(self, service_now_ms: int, received_mono_ms: float) -> None:
        sample = service_now_ms - received_mono_ms
        stepped = sample < self.offset_ms - CLOCK_STEP_MS
        if self._guessed or stepped:
            self._readings.restart(sample)  # readings follow a guess replaced or a step back
        elif not self._bounded or sample > self.offset_ms:
            self._readings.move(sample)
        else:
            return
        self._bounded = True
        self._guessed = False


class StreamApplier:
    """Applies stream events to the local table."""

    def __init__(self, table: LocalTable, clock: ServiceClock, pending: PendingReports) -> None:
        self.table = table
        self.clock = clock
        self.pending = pending
        #: Detour's item of each broker whose latest event came while a report of it was in
        #: flight and was re-applied on it: at most one per broker of the table, dropped
        #: when the batch is settled (``settle``) or by the broker's next event
        self._under: dict[str, FaultItem | None] = {}
        #: events and settlements are applied one at a time (the stream's reader and the
        #: flush are two threads): a settlement never puts back an older item than an
        #: event applied meanwhile
        self._lock = threading.Lock()

    def handle(self, event: Event, received_mono_ms: float) -> None:
        """Apply one event. Unknown kinds are ignored (a newer service may add some).

        Raises KeyError, TypeError or ValueError on a malformed event; the reader
        then reconnects and starts over from a snapshot.
        """
        data = event.data
        now = data.get("now")
        if isinstance(now, int):
            self.clock.observe(now, received_mono_ms)
        with self._lock:
            self._apply(event.kind, data, received_mono_ms)

    def _apply(self, kind: str, data: dict[str, Any], received_mono_ms: float) -> None:
        table = self.table
        if kind == "snapshot":
            items = (wire.fault(i) for i in data["items"])
            faults = {i.broker_name: i for i in items if i is not None}
            table.replace(
                wire.config(data["config"]),
                [wire.route(r) for r in data["routes"]],
                faults,
                lambda config: self._own_on(None, faults, received_mono_ms, config),
            )
        elif kind == "fault":
            broker = str(data["brokerName"])
            item = wire.fault(data)
            table.set_fault(
                broker,
                item,
                lambda config: self._own_on(broker, {broker: item}, received_mono_ms, config),
            )
        elif kind == "route":
            topic = str(data["topic"])
            table.set_route(topic, None if data.get("deleted") else wire.route(data))
        elif kind == "config":
            table.set_config(wire.config(data))

    def settle(self, batch: Sequence[Pending]) -> None:
        """Detour answered ``batch`` (took it, or refused it for good): where an event
        re-applied these reports on Detour's item of their broker, the item is Detour's
        again, with only the reports still waiting on top (the module's docstring says
        why). Nothing to do for a broker no event arrived for meanwhile."""
        with self._lock:
            for broker in {p.broker_name for p in batch}:
                if broker in self._under:
                    self._restore(broker, self._under.pop(broker))

    def _restore(self, broker: str, item: FaultItem | None) -> None:
        """Under the lock: Detour's ``item`` of ``broker``, then the reports still waiting."""
        now = mono_ms()
        self.table.set_fault(
            broker, item, lambda config: self._own_on(broker, {broker: item}, now, config)
        )

    def _own_on(
        self,
        broker: str | None,
        items: Mapping[str, FaultItem | None],
        now_ms: float,
        config: Config,
    ) -> list[OwnReport]:
        """``own``, noting Detour's item (from ``items``) of each broker it re-applies
        reports on while one of them is in flight, for ``settle``. An event that came
        before a report was sent cannot hold it: its re-application stands until Detour's
        push of it."""
        if broker is None:
            self._under.clear()  # a snapshot: every broker's latest word
        else:
            self._under.pop(broker, None)
        out = self.own(broker, now_ms, config)
        for b in {r[0] for r in out}:
            if self.pending.flying(b):
                self._under[b] = items.get(b)
        return out

    def own(self, broker: str | None, now_ms: float, config: Config) -> list[OwnReport]:
        """The waiting reports an event re-applies (of ``broker``, or of every broker for a
        snapshot), oldest first, each at its age at ``now_ms``: per broker the newest
        ``REAPPLY_NEWEST`` and, before them, the older one whose window ends last, among the
        newest ``REAPPLY_SCAN`` waiting. In-flight signals are never applied locally."""
        newest: dict[str, list[Pending]] = {}
        furthest: dict[str, tuple[float, Pending]] = {}
        # the least latency that asks for a window: most reports are below it
        tiers = zip(config.latency_max, config.not_available_duration, strict=True)
        opens_at = min((ms for ms, d in tiers if d), default=math.inf)
        for p in self.pending.newest(REAPPLY_SCAN):
            if p.pending or (broker is not None and p.broker_name != broker):
                continue
            mine = newest.setdefault(p.broker_name, [])
            if len(mine) < REAPPLY_NEWEST:
                mine.append(p)
                continue
            if not p.isolation and p.latency_ms < opens_at:
                continue
            t = strategy.tier(config, math.floor(p.latency_ms), p.isolation)
            if t is None or not config.not_available_duration[t]:
                continue
            end = p.at_ms + config.not_available_duration[t]
            if p.broker_name not in furthest or end > furthest[p.broker_name][0]:
                furthest[p.broker_name] = (end, p)
        out: list[OwnReport] = []
        for b, mine in newest.items():
            chosen = ([furthest[b][1]] if b in furthest else []) + mine[::-1]
            out += [(p.broker_name, p.latency_ms, p.isolation, p.age_ms(now_ms)) for p in chosen]
        return out
