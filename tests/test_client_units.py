"""The producer SDK's pure parts (no process, no socket).

The processes-and-sockets behaviour is in test_client*.py; these pin the rules
those rely on: the circuit's timing, the calls' budgets and tallies, the bounded
report queue, the SSE parser and its bounds, the stream applier's re-application
of unacknowledged reports, and the send loop's deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import pytest

from detour.client import (
    Decision,
    DetourUnavailable,
    SelectedQueue,
    SendError,
)
from detour.client.cached import (
    CLOCK_STEP_MS,
    REAPPLY_NEWEST,
    REAPPLY_SCAN,
    ServiceClock,
    StreamApplier,
)
from detour.client.calls import BACKGROUND_TIMEOUT_S, Calls, Loud
from detour.client.circuit import CircuitBreaker, Ticket
from detour.client.errors import DetourBadAnswer, DetourRejected
from detour.client.local import LOGGED, LocalTable
from detour.client.pending import (
    REPLAY_WINDOW_MS,
    REPORT_ID_WINDOW_MS,
    Pending,
    PendingReports,
)
from detour.client.reconnect import Jitter
from detour.client.send import send_async, send_sync
from detour.client.sse import Event, EventTooLarge, SSEParser
from detour.client.wire import MAX_LATENCY_MS, batch_head, batch_text, check_report
from detour.clock import mono_ms
from detour.model import MAX_REPORT_AGE_MS, BrokerRoute, Config, FaultItem, Route

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000
ROUTE_JSON = {
    "topic": "t",
    "brokers": [
        {"brokerName": "a", "writeQueueNums": 1, "address": "10.0.0.1:10911"},
        {"brokerName": "b", "writeQueueNums": 1, "address": None},
    ],
}


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- circuit


def test_the_circuit_opens_then_lets_one_probe_and_doubles_to_the_cap() -> None:
    clock = FakeClock()
    b = CircuitBreaker(0.5, 5.0, clock)
    assert b.begin() is Ticket.CALL
    b.end(Ticket.CALL, answered=False)
    assert b.is_open and b.remaining_s() == pytest.approx(0.5)
    assert b.begin() is Ticket.DENIED
    pauses = []
    for _ in range(6):
        clock.t += b.remaining_s()
        assert b.begin() is Ticket.PROBE
        assert b.begin() is Ticket.DENIED  # one probe at a time
        b.end(Ticket.PROBE, answered=False)
        pauses.append(round(b.remaining_s(), 3))
    assert pauses == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    clock.t += 5.0
    ticket = b.begin()
    b.end(ticket, answered=True)  # any answer closes it and starts the pauses over
    assert not b.is_open and b.begin() is Ticket.CALL
    b.end(Ticket.CALL, answered=False)
    assert b.remaining_s() == pytest.approx(0.5)


def test_concurrent_failures_count_once() -> None:
    clock = FakeClock()
    b = CircuitBreaker(0.5, 5.0, clock)
    tickets = [b.begin() for _ in range(4)]  # four calls in flight when Detour dies
    for t in tickets:
        b.end(t, answered=False)
    assert b.remaining_s() == pytest.approx(0.5)


def test_jitter_stays_under_a_doubling_ceiling() -> None:
    j = Jitter(0.1, 1.0, lambda: 1.0)
    assert [round(j.next_s(), 3) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    j.reset()
    assert j.next_s() == pytest.approx(0.1)


# ---------------------------------------------------------------- report queue


def _waiting(q: PendingReports) -> list[Pending]:
    """Every report Detour has not accepted, oldest first."""
    return q.newest(len(q))[::-1]


def test_pending_reports_drop_the_oldest_and_count_them() -> None:
    q = PendingReports(capacity=3)
    q.add(q.make(f"b{i}", i, False, float(i)) for i in range(5))
    assert q.dropped == 2
    assert [p.broker_name for p in _waiting(q)] == ["b2", "b3", "b4"]


def test_a_failed_batch_goes_back_in_front_in_order() -> None:
    q = PendingReports(capacity=10)
    # Made now: a fixed time would be past the age limit on a machine up for a day.
    now = mono_ms()
    q.add(q.make(f"b{i}", i, i == 1, now) for i in range(4))
    assert q.urgent
    batch = q.take(2)
    assert [p.broker_name for p in batch] == ["b0", "b1"]
    assert not q.urgent and len(q) == 4 and q.queued() == 2
    q.add([q.make("b4", 0, False, now)])
    q.retry(batch)
    assert q.urgent
    assert [p.broker_name for p in _waiting(q)] == ["b0", "b1", "b2", "b3", "b4"]
    q.done(q.take(5), accepted=True)
    assert (len(q), q.sent, q.dropped) == (0, 5, 0)


def test_urgent_follows_the_isolations_in_the_queue_exactly() -> None:
    """``urgent`` is counted, not scanned for: it holds while an isolation or a signal
    waits, whichever way it leaves (taken, trimmed as the oldest, too old, abandoned)."""
    now = mono_ms()
    q = PendingReports(capacity=3)
    q.add([q.make("iso", 5, True, now), q.make("sig", 80, False, now, pending=True)])
    assert q.urgent
    q.add(q.make(f"b{i}", 1, False, now) for i in range(2))  # trims the isolation
    assert q.urgent and [p.broker_name for p in _waiting(q)] == ["sig", "b0", "b1"]
    q.add([q.make("b2", 1, False, now)])  # trims the signal
    assert not q.urgent
    q.add([q.make("iso3", 5, True, now)])
    assert q.urgent and q.abandon() == 3 and not q.urgent
    q.add([q.make("old", 5, True, now - MAX_REPORT_AGE_MS - 1), q.make("b", 1, False, now)])
    assert q.urgent
    assert [p.broker_name for p in q.take(5, now)] == ["b"]  # the too-old isolation: dropped
    assert not q.urgent


def test_report_checks_and_age_clamp() -> None:
    with pytest.raises(ValueError, match="broker_name"):
        check_report("bad name", 1)
    for bad in (-1, MAX_LATENCY_MS + 1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="latency_ms"):
            check_report("a", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="age_ms"):
        check_report("a", 1, -1)
    body = json.loads(batch_text([(batch_head("a", 1.5, True), 10 * MAX_REPORT_AGE_MS)]))
    assert body["reports"][0]["ageMs"] == MAX_REPORT_AGE_MS


# ---------------------------------------------------------------- SSE


def test_sse_parser_dispatches_on_blank_lines() -> None:
    p = SSEParser()
    lines = [": comment", "event: fault", 'data: {"brokerName":', 'data: "a", "now": 5}', "",
             "", "id: 7", 'data: {"x": 1}', ""]
    events = [e for e in map(p.feed, lines) if e is not None]
    assert events == [Event("fault", {"brokerName": "a", "now": 5}), Event("message", {"x": 1})]
    with pytest.raises(ValueError):
        for line in ("event: clock", "data: [1]", ""):
            p.feed(line)


def test_sse_bytes_split_on_every_line_end_across_chunks() -> None:
    stream = (b'event: fault\r\ndata: {"a": 1}\r\n\r\n'
              b'data: {"b": 2}\r\rdata: {"c": 3}\n\n: bye\n')
    for size in (1, 2, 3, 7, len(stream)):  # every way of cutting it, CRLF halves included
        p = SSEParser()
        events = [e for i in range(0, len(stream), size) for e in p.feed_bytes(stream[i:i + size])]
        assert events == [Event("fault", {"a": 1}), Event("message", {"b": 2}),
                          Event("message", {"c": 3})], size


def test_sse_lines_and_events_are_bounded() -> None:
    p = SSEParser(max_bytes=100)
    assert p.feed_bytes(b"data: " + b"x" * 90) == []  # 96 bytes, no end yet: kept
    with pytest.raises(EventTooLarge):
        p.feed_bytes(b"x" * 10)  # past 100 without a line end
    with pytest.raises(EventTooLarge):
        SSEParser(max_bytes=100).feed_bytes(b"data: " + b"y" * 200 + b"\n")  # whole, but long
    p = SSEParser(max_bytes=100)
    with pytest.raises(EventTooLarge):
        for _ in range(5):  # short lines, but one event's data grows past the bound
            p.feed_bytes(b"data: " + b"z" * 30 + b"\n")
    p = SSEParser(max_bytes=100)
    assert p.feed_bytes(b'data: {"ok": "' + b"w" * 70 + b'"}\n\n') == [
        Event("message", {"ok": "w" * 70})]


# ---------------------------------------------------------------- calls


def test_a_call_gets_the_timeout_or_what_is_left_of_the_send() -> None:
    circuit = CircuitBreaker(0.5, 5.0)
    calls = Calls(timeout=0.2, min_budget=0.02, circuit=circuit)
    ticket, budget = calls.begin()
    assert ticket is Ticket.CALL and budget == 0.2
    calls.end(ticket, None)
    ticket, budget = calls.begin(background=True)  # a report batch no send waits for
    assert budget == BACKGROUND_TIMEOUT_S > 0.2
    calls.end(ticket, None)
    _, budget = calls.begin(ends=time.monotonic() + 0.5, background=True)
    assert 0.3 < budget <= 0.5  # within a flush's deadline all the same
    _, budget = calls.begin(ends=time.monotonic() + 0.1)
    assert 0.05 < budget <= 0.1
    with pytest.raises(DetourUnavailable, match="left in the send"):
        calls.begin(ends=time.monotonic() + 0.01)
    assert calls.failures == 0 and not circuit.is_open  # a call not made blames nobody


def test_a_skipped_call_does_not_take_the_half_open_probe() -> None:
    clock = FakeClock()
    circuit = CircuitBreaker(0.5, 5.0, clock)
    calls = Calls(timeout=0.2, min_budget=0.02, circuit=circuit)
    ticket, _ = calls.begin()
    calls.end(ticket, DetourUnavailable("down"))
    clock.t += 1.0  # the pause is over: one probe may go
    with pytest.raises(DetourUnavailable):
        calls.begin(ends=time.monotonic())  # no time left in this send
    ticket, _ = calls.begin()
    assert ticket is Ticket.PROBE


def test_rejections_are_counted_and_logged_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    loud = Loud(logging.ERROR, every_s=60.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="detour.client"):
        for _ in range(5):
            loud("POST /select: HTTP 401")
        clock.t += 60.0
        loud("POST /select: HTTP 401")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[1].endswith("(4 more like it in the last 60 s)")
    calls = Calls(timeout=0.2, min_budget=0.02, circuit=CircuitBreaker())
    for status in (401, 302):
        ticket, _ = calls.begin()
        assert not calls.end(ticket, DetourRejected(status, f"HTTP {status}"))
        calls.circuit.end(Ticket.PROBE, answered=True)  # close it again for the next call
    assert (calls.failures, calls.rejected, calls.last_rejected_status) == (2, 2, 302)
    ticket, _ = calls.begin()
    assert not calls.end(ticket, DetourBadAnswer("a list"))
    assert (calls.failures, calls.bad_answers) == (3, 1)


# ---------------------------------------------------------------- tables


def test_local_table_applies_reports_at_their_age() -> None:
    table = LocalTable(lambda: NOW)
    table.set_route("t", Route.from_brokers("t", [BrokerRoute("a", 1), BrokerRoute("b", 1)]))
    item = table.apply_report("a", 120.9, isolation=True, age_ms=1000)
    assert item is not None
    assert (item.current_latency_ms, item.available_at) == (120, NOW - 1000 + 600_000)
    picks = {table.select("t", None).broker_name for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"b"}
    assert table.select("unknown", None) is None


def test_stream_applier_keeps_own_unacked_reports_and_tracks_the_clock() -> None:
    clock = ServiceClock()
    pending = PendingReports()
    table = LocalTable(clock.now_ms)
    applier = StreamApplier(table, clock, pending)
    now = int(time.time() * 1000) + 60_000  # the service's clock runs a minute ahead
    applier.handle(
        Event("snapshot", {"version": 3, "now": now, "config": {}, "routes": [ROUTE_JSON],
                           "items": []}), mono_ms())
    assert abs(clock.now_ms() - now) < 1000
    sel = table.select("t", "b")
    assert sel is not None and (sel.broker_name, sel.address, sel.local) == (
        "a", "10.0.0.1:10911", True)

    # Our isolation of a, not yet accepted by Detour.
    table.apply_report("a", 5, isolation=True)
    pending.add([pending.make("a", 5, True, mono_ms())])
    own_end = table.fault("a").available_at  # type: ignore[union-attr]
    # An event written before our report reached Detour must not undo it ...
    applier.handle(Event("fault", {"brokerName": "a", "deleted": True, "now": now}), mono_ms())
    assert table.fault("a").available_at >= own_end  # type: ignore[union-attr]
    # ... nor a snapshot after a reconnect.
    applier.handle(Event("snapshot", {"now": now, "config": {}, "routes": [ROUTE_JSON],
                                      "items": []}), mono_ms())
    assert table.fault("a").available_at >= own_end  # type: ignore[union-attr]
    # Once Detour accepted it, the stream is the truth again (an operator restore).
    pending.done(pending.take(10), accepted=True)
    applier.handle(Event("fault", {"brokerName": "a", "deleted": True, "now": now}), mono_ms())
    assert table.fault("a") is None

    applier.handle(Event("route", {"topic": "t", "deleted": True, "now": now}), mono_ms())
    assert not table.has_route("t")
    applier.handle(Event("config", {"sendLatencyFaultEnable": False, "now": now}), mono_ms())
    assert table.view.config.send_latency_fault_enable is False
    applier.handle(Event("something-new", {"now": now}), mono_ms())  # ignored


def _applier_with_route() -> tuple[StreamApplier, LocalTable, PendingReports, int]:
    clock = ServiceClock()
    pending = PendingReports(capacity=20_000)
    table = LocalTable(clock.now_ms, producer="p1")
    applier = StreamApplier(table, clock, pending)
    now = int(time.time() * 1000)
    applier.handle(
        Event("snapshot", {"now": now, "config": {}, "routes": [ROUTE_JSON], "items": []}),
        mono_ms(),
    )
    return applier, table, pending, now


def _wait(
    pending: PendingReports, broker: str, ms: float, isolation: bool = False, ago_ms: float = 0
) -> None:
    pending.add([pending.make(broker, ms, isolation, mono_ms() - ago_ms)])


@pytest.mark.parametrize("event", ["fault", "snapshot"])
@pytest.mark.parametrize("accepted", [True, False])
def test_an_event_that_came_while_a_batch_was_in_flight_is_detours_word_once_it_answers(
    event: str, accepted: bool
) -> None:
    """A restore of a (a delete, or a snapshot without it) arrives while our report of a is
    in flight: it is re-applied on top (Detour may not have it yet). Once Detour answers
    the batch (took it, or refused it for good) the restore stands, with only the reports
    still waiting on top; a broker no event came for is left as it is."""
    applier, table, pending, now = _applier_with_route()
    for broker in "ab":
        table.apply_report(broker, 5, isolation=True)
        _wait(pending, broker, 5, isolation=True)
    b_before = table.fault("b")
    assert b_before is not None
    batch = pending.take(10)
    b_item = {"brokerName": "b", "availableAt": b_before.available_at, "currentLatencyMs": 5}
    restore = (Event("fault", {"brokerName": "a", "deleted": True, "now": now})
               if event == "fault" else
               Event("snapshot", {"now": now, "config": {}, "routes": [ROUTE_JSON],
                                  "items": [b_item]}))
    applier.handle(restore, mono_ms())
    a = table.fault("a")
    assert a is not None and a.available_at > now  # our report, re-applied on the restore
    _wait(pending, "b", 3)  # a later report of b, not in the batch: still waiting after it
    pending.done(batch, accepted)
    applier.settle(batch)
    assert table.fault("a") is None  # the restore stands
    b = table.fault("b")
    assert b is not None and b.available_at == b_before.available_at
    if event == "snapshot":  # Detour's b, and the report still waiting on it
        assert b.current_latency_ms == 3
    else:  # no event for b came: b as it was
        assert b == b_before
    applier.settle(batch)  # settling again changes nothing
    assert table.fault("a") is None and table.fault("b") == b


def test_only_an_event_during_the_flight_is_settled_and_the_latest_event_counts() -> None:
    """An event that came while the report only waited (not sent yet) cannot hold it: the
    re-applied report stands when its batch is answered (Detour's push of it follows). And
    a settlement restores the broker's latest event, never an older one a batch that was
    put back (not answered) saw."""
    applier, table, pending, now = _applier_with_route()
    delete = Event("fault", {"brokerName": "a", "deleted": True, "now": now})
    table.apply_report("a", 5, isolation=True)
    _wait(pending, "a", 5, isolation=True)
    applier.handle(delete, mono_ms())  # before the send: re-applied, and it stands
    batch = pending.take(10)
    pending.done(batch, True)
    applier.settle(batch)
    a = table.fault("a")
    assert a is not None and a.available_at > now
    # In flight, a restore; the batch is not answered and goes back; then Detour's newer
    # word on a (its window) with nothing in flight; the batch is sent again and answered.
    _wait(pending, "a", 5, isolation=True)
    batch = pending.take(10)
    applier.handle(delete, mono_ms())
    pending.retry(batch)
    window = {"brokerName": "a", "availableAt": now + 600_000, "currentLatencyMs": 5}
    applier.handle(Event("fault", {**window, "now": now}), mono_ms())
    batch = pending.take(10)
    pending.done(batch, True)
    applier.settle(batch)
    a = table.fault("a")
    assert a is not None and a.available_at >= now + 600_000  # not the older restore


@pytest.mark.parametrize("waiting", [0, 5, 8, 9, 600, 10_000])
def test_an_event_reapplies_a_bounded_share_of_the_waiting_reports(waiting: int) -> None:
    """However many reports wait (Detour refusing batches), an event for a broker re-applies
    at most its newest REAPPLY_NEWEST and one older one, and a snapshot as many per broker:
    its cost does not grow with the queue."""
    applier, table, pending, now = _applier_with_route()
    for i in range(waiting):
        _wait(pending, "ab"[i % 2], 1 + i % 7)
    config = table.view.config
    for broker in ("a", "b"):
        own = applier.own(broker, mono_ms(), config)
        assert len(own) == min(REAPPLY_NEWEST, (waiting + (broker == "a")) // 2)
        assert {o[0] for o in own} <= {broker}
    everyone = applier.own(None, mono_ms(), config)
    assert len(everyone) == min(2 * REAPPLY_NEWEST, waiting)
    if waiting:
        # oldest first: the broker's newest report comes last
        newest = "ab"[(waiting - 1) % 2]
        assert applier.own(newest, mono_ms(), config)[-1][1] == 1 + (waiting - 1) % 7


def test_an_older_own_window_outlives_a_run_of_fast_answers_after_an_event() -> None:
    """The report whose window ends last is re-applied even behind REAPPLY_NEWEST newer
    ones: an isolation followed by many fast answers still keeps its broker avoided."""
    applier, table, pending, now = _applier_with_route()
    _wait(pending, "a", 900, ago_ms=5)  # tier 3: a 60 s window, shorter than the isolation's
    _wait(pending, "a", 5, isolation=True, ago_ms=4)  # a failure: the 600 s window
    for _ in range(3 * REAPPLY_NEWEST):
        _wait(pending, "a", 2)
    own = applier.own("a", mono_ms(), table.view.config)
    assert len(own) == REAPPLY_NEWEST + 1
    assert own[0][2] is True and all(o[1] == 2 for o in own[1:])
    applier.handle(Event("fault", {"brokerName": "a", "deleted": True, "now": now}), mono_ms())
    item = table.fault("a")
    assert item is not None and item.current_latency_ms == 2
    assert item.available_at > now + 500_000  # the isolation's window, not the 60 s one
    # the broker is avoided by a local select: only b is chosen
    picks = {table.select("t", None).broker_name for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"b"}


def test_reports_past_the_scan_are_not_reapplied() -> None:
    """The scan stops REAPPLY_SCAN reports back: a broker's report behind that many newer
    ones of other brokers is left to Detour's push (the bound holds for any queue)."""
    applier, table, pending, now = _applier_with_route()
    _wait(pending, "a", 5, isolation=True)
    for _ in range(REAPPLY_SCAN):
        _wait(pending, "b", 1)
    assert applier.own("a", mono_ms(), table.view.config) == []
    _wait(pending, "a", 3)
    assert [o[1] for o in applier.own("a", mono_ms(), table.view.config)] == [3]


def _locked_only(table: LocalTable) -> LocalTable:
    """The same table forced down the writers' old path: all the work under the lock."""
    table._plan = lambda *args: None  # type: ignore[method-assign]
    return table


def _two_tables(producer: str = "p1") -> tuple[LocalTable, LocalTable, list[int]]:
    now = [NOW]
    tables = (LocalTable(lambda: now[0], producer), LocalTable(lambda: now[0], producer))
    for t in tables:
        t.set_route("t", Route.from_brokers("t", [BrokerRoute(b, 2) for b in "abcd"]))
    return tables[0], _locked_only(tables[1]), now


@pytest.mark.parametrize("seed", range(12))
def test_writes_planned_outside_the_lock_leave_the_table_the_locked_path_leaves(
    seed: int,
) -> None:
    """Reports and fault events worked out before the lock is taken write exactly what the
    same calls write with all their work under the lock: random reports (every tier, some
    isolations, some aged), events with and without an item, events re-applying waiting
    reports, and a config that asks for quorums and backoff half-way."""
    rng = random.Random(seed)
    fast, locked, now = _two_tables()
    waiting: list[tuple[str, float, bool, int]] = []
    for step in range(300):
        now[0] += rng.choice((0, 1, 40, 5_000, 70_000))
        broker = rng.choice("abcd")
        if step == 150:
            config = Config(isolation_quorum=2, latency_quorum=2, repeat_multiplier=True,
                            probe_on_expiry=True)
            for t in (fast, locked):
                t.set_config(config)
        if rng.random() < 0.75:
            report = (broker, rng.choice((1, 60, 120, 700, 1500, 2500, 4000, 20000)),
                      rng.random() < 0.2, rng.choice((0, 0, 30, 2_000)))
            waiting.append(report)
            for t in (fast, locked):
                t.apply_report(*report)
        else:
            item = None if rng.random() < 0.3 else FaultItem(
                broker, rng.choice((5, 900)), now[0] + rng.choice((-1, 0, 30_000)))
            mine = [r for r in waiting[-rng.randint(0, 5):] if r[0] == broker]
            for t in (fast, locked):
                t.set_fault(broker, item, lambda config, mine=mine: mine)  # type: ignore[misc]
        assert fast.view.faults == locked.view.faults, step
    assert fast.view.faults  # the sequences wrote something


@pytest.mark.parametrize("seed", range(8))
def test_reports_landing_while_events_are_worked_out_end_as_if_applied_after_them(
    seed: int,
) -> None:
    """Random reports (of the event's broker and of others, a stripe's share of them or
    more) land while each event is worked out outside the lock: the table ends as the
    locked path's does when the same reports come after the event."""
    rng = random.Random(seed)
    fast, locked, now = _two_tables()
    brokers = [f"b{i}" for i in range(40)]
    for _ in range(60):
        now[0] += rng.choice((0, 40, 5_000, 70_000))
        broker = rng.choice(brokers[:4])
        item = None if rng.random() < 0.3 else FaultItem(broker, 900, now[0] + 30_000)
        mine = [(broker, rng.choice((1, 700)), False, 0) for _ in range(rng.randint(0, 3))]
        landed = [(rng.choice(brokers[:4] + [rng.choice(brokers)]),
                   rng.choice((1, 120, 700, 2500)), rng.random() < 0.2, rng.choice((0, 30)))
                  for _ in range(rng.choice((0, 1, 3, LOGGED, LOGGED + 5)))]
        calls = [0]

        def own(config: Config, mine: list = mine, landed: list = landed,
                broker: str = broker, calls: list = calls) -> list:
            calls[0] += 1
            if calls[0] == 1:  # read outside the lock: the reports land meanwhile
                for report in landed:
                    fast.apply_report(*report)
                return mine
            return mine + [r for r in landed if r[0] == broker]  # read again under it

        fast.set_fault(broker, item, own)
        locked.set_fault(broker, item, lambda config, mine=mine: mine)  # type: ignore[misc]
        for report in landed:
            locked.apply_report(*report)
        assert fast.view.faults == locked.view.faults


def test_a_report_applied_while_an_event_is_worked_out_is_not_undone() -> None:
    """A producer's report lands between the event's read of the waiting reports and its
    write: the event applies it after its own write, so the report survives (on the old
    path it could not land in between)."""
    table = LocalTable(lambda: NOW, "p1")
    table.set_route("t", Route.from_brokers("t", [BrokerRoute("a", 1), BrokerRoute("b", 1)]))
    queue: list[tuple[str, float, bool, int]] = []
    reads = []

    def own(config: Config) -> list[tuple[str, float, bool, int]]:
        reads.append(table._lock.locked())
        if len(reads) == 1:  # first read, outside the lock: a producer reports meanwhile
            queue.append(("a", 5, True, 0))
            table.apply_report("a", 5, True)
            return []
        return list(queue)

    table.set_fault("a", None, own)
    item = table.fault("a")
    assert item is not None and item.available_at == NOW + 600_000
    assert reads == [False]  # read once, without the lock


def test_more_reports_landing_than_are_kept_work_the_event_out_again_under_the_lock() -> None:
    """Past the reports a stripe keeps, the event does its work again under the lock, with
    the waiting reports read afresh: every one of them survives it."""
    table = LocalTable(lambda: NOW, "p1")
    queue: list[tuple[str, float, bool, int]] = []
    reads: list[bool] = []

    def own(config: Config) -> list[tuple[str, float, bool, int]]:
        reads.append(table._lock.locked())
        if len(reads) == 1:
            for i in range(LOGGED + 1):  # the isolation first, then fast answers
                queue.append(("a", 5, i == 0, 0))
                table.apply_report(*queue[-1])
            return []
        return list(queue)

    table.set_fault("a", None, own)
    item = table.fault("a")
    assert reads == [False, True]
    assert item is not None and item.available_at == NOW + 600_000


def test_reports_reapplied_after_events_are_not_scored_again() -> None:
    """A broker's latency score (p2c's peak EWMA) folds each of this client's answers once,
    when it is applied; re-applying it after Detour's events, on either path, does not
    fold it again at the event's time (it would renew an old answer's weight)."""
    now = [NOW]
    fast, locked, _ = _two_tables()
    for t in (fast, locked):
        t.view.now_ms = lambda: now[0]
        t.apply_report("a", 900, False)
    scores = fast.view.latency_scores["a"], locked.view.latency_scores["a"]
    for _ in range(5):
        now[0] += 10_000
        for t in (fast, locked):
            t.apply_report("b", 10, False)  # scores are read at the same time on both
            t.set_fault("a", FaultItem("a", 5, now[0] - 1), lambda config: [("a", 900, False, 0)])
    after = fast.view.latency_scores["a"], locked.view.latency_scores["a"]
    assert after[0] == after[1] < scores[0] == scores[1]  # faded, not renewed


def test_a_write_half_done_is_never_counted_before_it_is_made() -> None:
    """A plan reads the broker's stamp, then its item. Whatever it reads while a write under
    the lock is half done (here: when the writer asks the time, before it writes), a stamp
    still current afterwards came with the item that is current: the writer counts after
    it writes."""
    table = LocalTable(lambda: NOW, "p1")
    seen: list[tuple[tuple[int, int, int], FaultItem | None]] = []

    def clock() -> int:
        seen.append((table._stamps.of("a"), table.view.faults.get("a")))
        return NOW

    table.view.now_ms = clock
    with table._lock:  # the locked path, as when a report's plan was overtaken
        table._apply_own([("a", 5, True, 0)])
    after = (table._stamps.of("a"), table.view.faults.get("a"))
    assert seen and after[1] is not None
    for stamp, item in seen:
        assert stamp != after[0] or item == after[1]


def test_a_report_worked_out_while_an_event_lands_is_applied_on_the_events_item() -> None:
    """The other order: Detour's item for the broker is written between a report's read of
    the broker's item and its write. The report is applied again, on Detour's item."""
    calls = [0]
    table = LocalTable(lambda: NOW, "p1")

    def clock() -> int:
        calls[0] += 1
        if calls[0] == 1:  # the report reads the time after the item: the event lands now
            table.set_fault("a", FaultItem("a", 900, NOW + 60_000))
        return NOW

    table.view.now_ms = clock
    item = table.apply_report("a", 20, False)
    assert item is not None
    # the report's latency on Detour's window (extend-only), not on the empty item it read
    assert (item.current_latency_ms, item.available_at) == (20, NOW + 60_000)


def test_own_reports_are_read_without_the_lock_when_nothing_moves() -> None:
    """The quiet case: the event's reports are read and applied once, and only the write
    takes the lock (a select waits for that write alone)."""
    table = LocalTable(lambda: NOW, "p1")
    reads: list[bool] = []

    def own(config: Config) -> list[tuple[str, float, bool, int]]:
        reads.append(table._lock.locked())
        return [("a", 700, False, 0)]

    table.set_fault("a", FaultItem("a", 5, NOW - 1), own)
    item = table.fault("a")
    assert reads == [False]
    assert item is not None and (item.current_latency_ms, item.available_at) == (700, NOW + 30_000)


# ---------------------------------------------------------------- send loop


def _queue(broker: str) -> SelectedQueue:
    return SelectedQueue("t", broker, 0, None, Decision.AVAILABLE, (), True)


class Recorder:
    """A select that walks brokers in order (skipping the last one) and a report log."""

    def __init__(self, brokers: str = "abc") -> None:
        self.brokers = brokers
        self.selects: list[str | None] = []
        self.reports: list[tuple[str, bool]] = []

    def select(self, topic: str, last: str | None) -> SelectedQueue:
        self.selects.append(last)
        return _queue(self.brokers[len(self.selects) - 1])

    def report(self, broker: str, ms: float, isolation: bool) -> None:
        assert ms >= 0
        self.reports.append((broker, isolation))


def test_send_loop_retries_with_the_last_broker_and_reports_each_attempt() -> None:
    rec = Recorder()

    def deliver(q: SelectedQueue, payload: str) -> str:
        if q.broker_name != "c":
            raise ConnectionError(q.broker_name)
        return payload.upper()

    result = send_sync("t", "hi", deliver, select=rec.select, report=rec.report, retries=2,
                       deadline=3)
    assert result.value == "HI" and result.queue.broker_name == "c"
    assert rec.selects == [None, "a", "b"]
    assert rec.reports == [("a", True), ("b", True), ("c", False)]
    assert [type(a.error) for a in result.attempts] == [ConnectionError, ConnectionError,
                                                        type(None)]


def test_send_loop_raises_every_cause() -> None:
    rec = Recorder()

    def deliver(q: SelectedQueue, payload: object) -> None:
        raise ConnectionError(q.broker_name)

    with pytest.raises(SendError) as info:
        send_sync("t", 1, deliver, select=rec.select, report=rec.report, retries=2, deadline=3)
    err = info.value
    assert [str(e) for e in err.errors] == ["a", "b", "c"] and not err.timed_out
    assert isinstance(err.__cause__, ConnectionError)


def test_send_loop_stops_at_the_deadline() -> None:
    rec = Recorder("abcdefgh")
    deadline_s = 1.0
    calls: list[str] = []

    def deliver(q: SelectedQueue, payload: object) -> None:
        calls.append(q.broker_name)
        if len(calls) == 3:  # the third attempt outlasts the deadline, however busy the machine
            time.sleep(max(0.0, start + deadline_s + 0.05 - time.monotonic()))
        raise TimeoutError("slow")

    start = time.monotonic()
    with pytest.raises(SendError) as info:
        send_sync("t", 1, deliver, select=rec.select, report=rec.report, retries=7,
                  deadline=deadline_s)
    assert info.value.timed_out and len(info.value.attempts) == 3 == len(calls)  # not 8
    assert time.monotonic() - start < deadline_s + 2  # no wait after it (generous)
    assert len(rec.reports) == 3


def test_no_retry_errors_stop_at_once_without_isolating() -> None:
    rec = Recorder()

    def deliver(q: SelectedQueue, payload: object) -> None:
        raise OverflowError("message too large")

    with pytest.raises(SendError) as info:
        send_sync("t", 1, deliver, select=rec.select, report=rec.report, retries=2, deadline=3,
                  no_retry=(OverflowError,))
    assert len(info.value.attempts) == 1 and rec.reports == [("a", False)]


def test_a_select_error_before_any_attempt_is_raised_as_is() -> None:
    def select(topic: str, last: str | None) -> SelectedQueue:
        raise DetourUnavailable("down, no route")

    with pytest.raises(DetourUnavailable):
        send_sync("t", 1, lambda q, p: None, select=select, report=Recorder().report, retries=2,
                  deadline=3)


def test_async_send_loop_cuts_deliver_at_the_deadline() -> None:
    rec = Recorder("abcdefgh")

    async def select(topic: str, last: str | None) -> SelectedQueue:
        return rec.select(topic, last)

    async def report(broker: str, ms: float, isolation: bool) -> None:
        rec.report(broker, ms, isolation)

    async def deliver(q: SelectedQueue, payload: object) -> None:
        await asyncio.sleep(30)

    async def main() -> SendError:
        with pytest.raises(SendError) as info:
            await send_async("t", 1, deliver, select=select, report=report, retries=5,
                             deadline=0.2)
        return info.value

    start = time.monotonic()
    err = asyncio.run(main())
    assert time.monotonic() - start < 5  # cut, not awaited: far below the 30 s (generous)
    assert err.timed_out and len(err.attempts) == 1
    assert isinstance(err.attempts[0].error, TimeoutError) and rec.reports == [("a", True)]


# ---------------------------------------------------------------- ages and clocks


def test_reports_past_detours_age_limit_are_dropped_not_sent() -> None:
    q = PendingReports()
    now = mono_ms()
    q.add([q.make("old", 1, True, now - MAX_REPORT_AGE_MS - 1), q.make("new", 1, True, now)])
    batch = q.take(10, now_ms=now)
    assert [p.broker_name for p in batch] == ["new"] and q.dropped == 1
    with pytest.raises(ValueError, match="age_ms"):
        check_report("a", 1, MAX_REPORT_AGE_MS + 1)


def test_reports_whose_id_detour_may_have_forgotten_are_not_replayed() -> None:
    """A report whose id was made longer ago than Detour remembers ids (less a margin) is
    not sent again, whatever its age says: Detour may have applied it (its reply lost) and
    would apply it twice. Dropped, counted as expired, not as sent or dropped."""
    q = PendingReports()
    q.add([q.make("a", 1, False, mono_ms()), q.make("b", 1, False, mono_ms())])
    made = mono_ms()
    assert REPLAY_WINDOW_MS < REPORT_ID_WINDOW_MS == 15 * 60 * 1000
    batch = q.take(1, now_ms=made + REPLAY_WINDOW_MS - 1_000)  # still within
    assert [p.broker_name for p in batch] == ["a"]
    q.retry(batch)
    assert q.take(10, now_ms=made + REPLAY_WINDOW_MS + 1_000) == []
    assert (q.expired, q.dropped, q.sent, len(q)) == (2, 0, 0, 0)


def test_service_clock_keeps_its_best_bound_against_late_events() -> None:
    clock = ServiceClock()
    clock.reconnected()
    clock.observe(1_000_000, 100.0)  # offset 999,900
    clock.observe(1_000_050, 200.0)  # a late event: offset 999,850, ignored
    assert clock.offset_ms == 999_900
    clock.observe(1_000_400, 300.0)  # a quicker one: a better (larger) bound
    assert clock.offset_ms == 1_000_100
    clock.observe(980_000, 400.0)  # the service's clock was set back 20 s: followed
    assert clock.offset_ms == 979_600
    clock.reconnected()  # a new stream may come from another replica: start over
    clock.observe(979_000, 500.0)
    assert clock.offset_ms == 978_500


def test_service_clock_readings_never_go_back_short_of_a_step() -> None:
    # A new stream from another replica whose estimate trails by 2 s (short of a step):
    # the offset starts over from it, but readings hold still instead of going back.
    clock, at = ServiceClock(), mono_ms()
    clock.observe(10**12, at)
    first = clock.now_ms()
    clock.reconnected()
    clock.observe(10**12 - 2_000, at)
    assert clock.offset_ms == pytest.approx(10**12 - 2_000 - at)  # the estimate dropped
    assert clock.now_ms() == first  # ... the readings did not (the test takes < 2 s)
    # The service's clock set back further than a step: readings follow it at once.
    clock.observe(10**12 - 2 * CLOCK_STEP_MS, at)
    assert clock.now_ms() < first - CLOCK_STEP_MS


def test_a_batch_item_carries_the_producer_id() -> None:
    (with_producer, without), = [json.loads(batch_text(
        [(batch_head("a", 1, True, "p"), 0), (batch_head("a", 1, True), 0)]))["reports"]]
    assert with_producer["producer"] == "p"
    assert "producer" not in without


def test_a_batch_body_is_each_reports_entry_with_its_age_now() -> None:
    """Entries are encoded when the report is queued (``batch_head``) and joined with their
    age when the batch goes (``batch_text``): the body is the JSON the service reads."""
    entries = [
        (batch_head("a", 1.5, True, "p", "id-1"), 10),
        (batch_head("b", 3, False, None, None, pending=True), -5),
        (batch_head("c", 0, False, "p", "id-3"), 10 * MAX_REPORT_AGE_MS),
    ]
    assert json.loads(batch_text(entries)) == {"reports": [
        {"brokerName": "a", "latencyMs": 1.5, "isolation": True, "producer": "p",
         "reportId": "id-1", "ageMs": 10},
        {"brokerName": "b", "latencyMs": 3, "isolation": False, "pending": True, "ageMs": 0},
        {"brokerName": "c", "latencyMs": 0, "isolation": False, "producer": "p",
         "reportId": "id-3", "ageMs": MAX_REPORT_AGE_MS},
    ]}
    assert json.loads(batch_text([])) == {"reports": []}


def test_a_batch_entry_writes_a_latency_as_json_does() -> None:
    class Float(float):  # numpy's float64 is a float subclass with its own repr
        def __repr__(self) -> str:
            return f"Float({float(self)})"

    for latency in (0, 7, 1.5, 0.1, 1e-7, 3_599_999.999, Float(2.25)):
        entry = json.loads(batch_text([(batch_head("a", latency, False), 0)]))["reports"][0]
        assert entry["latencyMs"] == latency and type(entry["latencyMs"]) is (
            int if isinstance(latency, int) else float
        )


def test_the_report_batch_halves_when_detour_does_not_keep_up_and_grows_back() -> None:
    from detour.client.core import MIN_BATCH, ClientCore
    from detour.client.wire import MAX_BATCH

    core = ClientCore("cached", timeout=0.2, retries=2, deadline=3.0, max_pending=100,
                      backoff_initial=0.5, backoff_max=5.0)
    assert core.batch_size == MAX_BATCH
    for _ in range(10):
        core.batch_answered(False)
    assert core.batch_size == MIN_BATCH
    core.batch_answered(True)
    assert core.batch_size == 2 * MIN_BATCH
    for _ in range(10):
        core.batch_answered(True)
    assert core.batch_size == MAX_BATCH


def test_a_stale_route_whose_refetch_fails_stays_due() -> None:
    """A refused answer marks the route stale; if the fetch that follows fails (Detour away,
    a dead pooled connection), the route is still due, and the next refresh asks again
    rather than keeping the route Detour contradicted for 30 s. A periodic refresh that
    fails still waits the usual 30 s."""
    from detour.client.core import ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    core.table.set_route("t", Route.from_brokers("t", [BrokerRoute("a", 1)]))
    core.route_checked("t", answered=True, asked=core.route_asking("t"))
    # a periodic refresh failed
    core.route_checked("t", answered=False, asked=core.route_asking("t"))
    assert core.refresh_due("t")[0] is False
    core.route_stale("t")
    assert core.refresh_due("t")[0] is True
    core.route_checked("t", answered=False, asked=core.route_asking("t"))  # the refetch failed
    assert core.refresh_due("t")[0] is True
    assert core.claim_refresh("t")  # so a refresh may go again
    core.route_checked("t", answered=True, asked=core.route_asking("t"))
    assert core.refresh_due("t")[0] is False
    core.release_refresh("t")


def test_a_route_found_stale_while_its_fetch_is_on_the_way_stays_due() -> None:
    """The fetch under way when a select refuses an answer may carry the route from before
    what that answer knew: its end, answered or not, leaves the route due, and the
    refresh that made it goes round again. A fetch asked for after the refusal clears it."""
    from detour.client.core import REFRESH_ROUNDS, ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    for answered in (True, False):
        core.route_stale("t")
        assert core.claim_refresh("t")
        asked = core.route_asking("t")  # a fetch goes out...
        core.route_stale("t")  # ...a select refuses an answer while it is on its way
        core.route_checked("t", answered=answered, asked=asked)
        assert core.refresh_due("t")[0] is True, answered
        assert core.release_refresh("t", REFRESH_ROUNDS - 1) is False  # so it goes again
        core.route_checked("t", answered=True, asked=core.route_asking("t"))
        assert core.refresh_due("t")[0] is False
        assert core.release_refresh("t", REFRESH_ROUNDS - 2) is True
    # A stale mark on another topic does not hold this one's fetch back.
    asked = core.route_asking("u")
    core.route_stale("u")
    core.route_stale("t")
    core.route_checked("t", answered=True, asked=core.route_asking("t"))
    assert core.refresh_due("t")[0] is False and core.refresh_due("u")[0] is True
    core.route_checked("u", answered=True, asked=asked)  # an older fetch of "u"
    assert core.refresh_due("u")[0] is True


def test_stale_marks_are_bounded_and_a_dropped_mark_leaves_its_route_due() -> None:
    """A producer may name any topic: the marks kept are the newest ``MAX_STALE_MARKS``,
    and a topic whose mark went still has its route due."""
    from detour.client.core import MAX_STALE_MARKS, ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    for i in range(MAX_STALE_MARKS + 50):
        core.route_stale(f"t{i}")
    assert len(core._stale_at) == MAX_STALE_MARKS
    assert "t0" not in core._stale_at and f"t{MAX_STALE_MARKS + 49}" in core._stale_at
    assert core.refresh_due("t0")[0] is True
    core.route_stale("t50")  # marked again: the newest now, not evicted next
    core.route_stale("x")
    assert "t50" in core._stale_at and "t51" not in core._stale_at


def _route(topic: str, *brokers: str) -> Route:
    return Route.from_brokers(topic, [BrokerRoute(b, 2) for b in brokers])


def _brokers(core: object, topic: str) -> list[str] | None:
    route = core.table.view.routes.get(topic)  # type: ignore[attr-defined]
    return None if route is None else sorted(route.by_broker)


@pytest.mark.parametrize("mode", ["remote", "cached"])
def test_a_route_fetch_that_answers_after_a_newer_write_does_not_overwrite_it(mode: str) -> None:
    """A fetch's answer carries no version. Whatever wrote the topic's route while the fetch
    was on its way (another fetch asked for later that ended first, the stream's push, a
    snapshot, a 404's delete) stays, and the route is due again; a fetch asked for after
    the last write is installed and settles it."""
    from detour.client.core import ClientCore

    core = ClientCore(mode, timeout=0.2, retries=0, deadline=1.0, max_pending=10,  # type: ignore[arg-type]
                      backoff_initial=0.5, backoff_max=5.0)
    config = core.table.view.config
    writes = {
        "a later fetch": lambda: core.route_fetched("t", _route("t", "new"),
                                                    core.route_asking("t")),
        "a later fetch's 404": lambda: core.route_fetched("t", None, core.route_asking("t")),
        "the stream's push": lambda: core.table.set_route("t", _route("t", "new")),
        "the stream's delete": lambda: core.table.set_route("t", None),
        "a snapshot": lambda: core.table.replace(config, [_route("t", "new")], {}),
    }
    for what, write in writes.items():
        core.table.set_route("t", _route("t", "before"))
        core.route_checked("t", answered=True, asked=core.route_asking("t"))
        asked = core.route_asking("t")  # a fetch goes out...
        write()  # ...and the route is written while it is on its way
        after = _brokers(core, "t")
        assert after != ["before"], what
        core.route_fetched("t", _route("t", "old"), asked)  # then it answers
        core.route_checked("t", answered=True, asked=asked)
        assert _brokers(core, "t") == after, what
        assert core.refresh_due("t")[0] is True, what  # asked for once more
        asked = core.route_asking("t")
        core.route_fetched("t", _route("t", "fetched"), asked)
        core.route_checked("t", answered=True, asked=asked)
        assert _brokers(core, "t") == ["fetched"], what
        assert core.refresh_due("t")[0] is False, what
    # Other topics' writes refuse nothing: a fetch of a known topic, and the first fetch of
    # a topic the client has never seen (a refusal there would fail the send), are
    # installed whatever a hundred other topics' routes did meanwhile.
    for topic in ("t", "never-seen"):
        asked = core.route_asking(topic)
        for i in range(100):
            core.table.set_route(f"u{i}", _route(f"u{i}", "x"))
            core.table.set_route(f"u{i}", None)
        core.route_fetched(topic, _route(topic, "late but alone"), asked)
        assert _brokers(core, topic) == ["late but alone"], topic


def test_a_config_fetch_that_answers_after_a_newer_write_does_not_overwrite_it() -> None:
    """The same rule for the config (remote mode fetches it every 30 s, and every thread
    that knows none fetches it): a fetch's answer is not written over a config written
    while it was on its way (another fetch asked for later, a snapshot); the config stays
    known and is due again. A fetch asked for after the last write is installed."""
    from detour.client.core import ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    core.table.set_route("t", _route("t", "a"))
    old, newer = Config(pending_quorum=2), Config(pending_quorum=3)
    writes = {
        "a later fetch": lambda: core.config_fetched(newer, core.config_asking()),
        "a snapshot": lambda: core.table.replace(newer, [_route("t", "a")], {}),
    }
    for what, write in writes.items():
        asked = core.config_asking()  # a fetch goes out...
        write()  # ...and the config is written while it is on its way
        core.config_checked(True)
        assert core.table.view.config == newer, what
        assert core.config_fetched(old, asked) is False, what  # then it answers
        core.config_checked(True, installed=False)
        assert core.table.view.config == newer, what
        assert core.knows("t") and core.refresh_due("t")[1] is True, what
        asked = core.config_asking()
        assert core.config_fetched(old, asked) is True, what
        core.config_checked(True, installed=True)
        assert core.table.view.config == old and core.refresh_due("t")[1] is False, what


def test_route_checks_are_bounded_and_a_dropped_check_leaves_its_route_due() -> None:
    """Each topic a producer names (a 404 too) records its route check: the newest
    ``MAX_ROUTE_CHECKS`` are kept, and a topic whose check went is fetched again."""
    from detour.client.core import MAX_ROUTE_CHECKS, ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    for i in range(MAX_ROUTE_CHECKS + 50):
        core.route_checked(f"t{i}", answered=True, asked=core.route_asking(f"t{i}"))
    assert len(core._route_checked) == MAX_ROUTE_CHECKS
    assert core.refresh_due("t0")[0] is True and core.refresh_due("t49")[0] is True
    assert core.refresh_due("t50")[0] is False
    core.route_checked("t50", answered=True, asked=core.route_asking("t50"))  # the newest now
    core.route_checked("x", answered=True, asked=core.route_asking("x"))
    assert core.refresh_due("t50")[0] is False and core.refresh_due("t51")[0] is True


def test_a_route_found_stale_during_a_background_refresh_is_fetched_by_that_refresh() -> None:
    """A select that refuses an answer while a background refresh runs cannot claim one of
    its own; the running refresh, at its release, sees the route due and goes round again
    (at most ``REFRESH_ROUNDS``), so the refetch is not lost until some later select."""
    from detour.client.core import REFRESH_ROUNDS, ClientCore

    core = ClientCore("remote", timeout=0.2, retries=0, deadline=1.0, max_pending=10,
                      backoff_initial=0.5, backoff_max=5.0)
    core.route_checked("t", answered=True, asked=core.route_asking("t"))
    assert core.refresh_due("t")[0] is False
    assert core.claim_refresh("t")  # a refresh starts
    core.route_stale("t")  # a select refuses an answer meanwhile
    assert not core.claim_refresh("t")  # ...and cannot start its own
    assert core.release_refresh("t", REFRESH_ROUNDS - 1) is False  # so this one goes again
    assert not core.claim_refresh("t")  # still claimed
    # the second round fetched it
    core.route_checked("t", answered=True, asked=core.route_asking("t"))
    assert core.release_refresh("t", REFRESH_ROUNDS - 2) is True
    assert core.claim_refresh("t")  # released
    # Bounded: with no rounds left it is released though the route is due (Detour away).
    core.route_stale("t")
    assert core.release_refresh("t", 0) is True
    assert core.claim_refresh("t")
    core.release_refresh("t")
