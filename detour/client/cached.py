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
  their broker.
"""

from __future__ import annotations

import time

from detour.client import wire
from detour.client.local import LocalTable
from detour.client.pending import PendingReports, mono_ms
from detour.client.sse import Event

#: Flush reports at least this often (s) ...
FLUSH_INTERVAL_S = 0.05
#: ... or as soon as this many are waiting (an isolation flushes at once).
FLUSH_AT = 256
#: The stream sends a clock event every second: this much silence means it is dead (s).
STREAM_IDLE_S = 5.0
#: Where the stream is.
STREAM_PATH = "/fault-items/stream"


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
    """

    def __init__(self) -> None:
        # Until the first event, the process wall clock is the best guess.
        self.offset_ms = time.time_ns() / 1_000_000 - mono_ms()
        self._bounded = False

    def reconnected(self) -> None:
        """A new stream (maybe from another replica): the next sample starts over."""
        self._bounded = False

    def observe(self, service_now_ms: int, received_mono_ms: float) -> None:
        sample = service_now_ms - received_mono_ms
        if not self._bounded or sample > self.offset_ms or sample < self.offset_ms - CLOCK_STEP_MS:
            self.offset_ms = sample
            self._bounded = True

    def now_ms(self) -> int:
        return int(time.monotonic_ns() / 1_000_000 + self.offset_ms)


class StreamApplier:
    """Applies stream events to the local table."""

    def __init__(self, table: LocalTable, clock: ServiceClock, pending: PendingReports) -> None:
        self.table = table
        self.clock = clock
        self.pending = pending

    def handle(self, event: Event, received_mono_ms: float) -> None:
        """Apply one event. Unknown kinds are ignored (a newer service may add some).

        Raises KeyError, TypeError or ValueError on a malformed event; the reader
        then reconnects and starts over from a snapshot.
        """
        data = event.data
        now = data.get("now")
        if isinstance(now, int):
            self.clock.observe(now, received_mono_ms)
        kind = event.kind
        table = self.table
        if kind == "snapshot":
            items = (wire.fault(i) for i in data["items"])
            table.replace(
                wire.config(data["config"]),
                [wire.route(r) for r in data["routes"]],
                {i.broker_name: i for i in items if i is not None},
            )
            self._reapply(None, received_mono_ms)
        elif kind == "fault":
            broker = str(data["brokerName"])
            table.set_fault(broker, wire.fault(data))
            self._reapply(broker, received_mono_ms)
        elif kind == "route":
            topic = str(data["topic"])
            table.set_route(topic, None if data.get("deleted") else wire.route(data))
        elif kind == "config":
            table.set_config(wire.config(data))

    def _reapply(self, broker: str | None, now_ms: float) -> None:
        for p in self.pending.unacked(broker):
            if p.pending:
                continue
            self.table.apply_report(p.broker_name, p.latency_ms, p.isolation, p.age_ms(now_ms))
