"""The one report rule, twice: detour.apply (Python) and report.lua (inside Redis) agree.

A property test drives random report sequences through the pure function and through the
real script on a real redis-server, and compares the answers and the whole table after
every call: random configs (both quorums, backoff and jitter, probation, early recovery,
the ramp, lastReportWins, in-flight signals, avoidance off), a small table cap (so that
evictions happen), the active detector's readings (reach.lua against policy.reach),
reports dated by the replica that accepted them (``ReportIn.at_ms`` against the call's
base, also one in the table's future, which both clamp to now), and repeats: reports sent
again with their sequence number or their report id change nothing and are answered as
the first time; an id reused with other content refuses the whole call."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detour import policy
from detour.apply import ReportIn, Rules, apply_reports
from detour.model import REPORT_ID_MARGIN_MS, REPORT_ID_WINDOW_MS, Config, FaultItem
from service.store import codec
from tests import raw_table
from tests.budget import examples
from tests.lua import CHANNEL, PREFIX, REPORT_KEYS, entry, head, script
from tests.procs import RedisServer

pytestmark = pytest.mark.integration

BROKERS = "abcde"
LATENCIES = (0, 3, 10, 60, 120, 200, 550, 700, 1200, 3000, 15000, 40000)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    return Config(
        send_latency_fault_enable=draw(st.sampled_from((True, True, True, False))),
        isolation_quorum=draw(st.sampled_from((1, 1, 2, 3))),
        latency_quorum=draw(st.sampled_from((1, 1, 2))),
        quorum_window_ms=draw(st.sampled_from((1, 300, 50_000, 600_000))),
        repeat_multiplier=draw(st.booleans()),
        max_isolation_ms=draw(st.sampled_from((1, 900_000, 3_600_000))),
        repeat_decay_ms=draw(st.sampled_from((1, 30_000, 600_000))),
        jitter_percent=draw(st.sampled_from((0, 0, 10, 100))),
        last_report_wins=draw(st.sampled_from((False, False, True))),
        probe_on_expiry=draw(st.booleans()),
        early_recovery=draw(st.booleans()),
        ramp_ms=draw(st.sampled_from((0, 0, 3000, 600_000))),
        pending_quorum=draw(st.sampled_from((0, 0, 1, 2))),
    )


@st.composite
def reports(draw: st.DrawFn) -> tuple[ReportIn, int]:
    producer = draw(st.sampled_from(("p1", "p2", "p3", "")))
    r = ReportIn(
        draw(st.sampled_from(BROKERS)),
        draw(st.sampled_from(LATENCIES)),
        draw(st.booleans()),
        draw(st.sampled_from((0, 0, 3, 5, 100, 400, 40_000, 700_000))),
        producer,
        draw(st.sampled_from((None, "broker", "local"))),
        producer,
        pending=draw(st.integers(0, 4)) == 0,
        scope=draw(st.sampled_from(("", "", "tok"))),
    )
    return r, draw(st.integers(0, policy.JITTER_SCALE - 1))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Config, int, list[Any]]:
    config = draw(configs())
    cap = draw(st.integers(2, 4))
    steps: list[Any] = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(("reports", "reports", "repeat", "repeat", "reach")))
        if kind == "reports":
            # the call's base: None (the script's now), or Redis's clock read before the
            # call plus an offset (ahead of the table's clock: clamped to now by both)
            base = draw(st.sampled_from((None, None, -700_000, -5000, 0, 5000, 700_000)))
            steps.append(("reports", draw(st.lists(reports(), min_size=1, max_size=3)),
                          draw(st.booleans()), base))
        elif kind == "repeat":
            steps.append(("repeat", draw(st.integers(0, 99)), draw(st.booleans())))
        else:
            steps.append(("reach", draw(st.sampled_from(BROKERS)), draw(st.booleans())))
    return config, cap, steps


@dataclass
class Model:
    """The Python side: the table, and what the store remembers of applied reports."""

    config: Config
    cap: int
    table: dict[str, FaultItem] = field(default_factory=dict)
    seqs: set[int] = field(default_factory=set)
    #: (scope, report id) -> (fingerprint, the first answer: end, duration, change, quorum,
    #: probe)
    ids: dict[tuple[str, str], tuple[str, tuple[int, int, int, int, int]]] = field(
        default_factory=dict)
    sent: list[ReportIn] = field(default_factory=list)
    next_seq: int = 0
    #: latency-log entries: one per applied report that is not a signal
    logged: int = 0


def _quorum(q: str | None) -> int:
    return {None: 0, "suspected": 1, "reached": 2}[q]


def _probe(p: str | None) -> int:
    return {None: 0, "passed": 1, "failed": 2}[p]


def _table(raw: redis.Redis) -> dict[str, FaultItem]:
    stored = raw_table.fields(raw, f"{PREFIX}:faults")
    return {b: codec.decode_fault(b, v) for b, v in stored.items()}


def _send(raw: redis.Redis, report: Any, model: Model, batch: list[tuple[ReportIn, int]],
          base: int | None = None) -> None:
    """One report.lua call and the same reports through detour.apply; compares both. With
    a ``base``, each report is dated at ``base - age`` (as a replica dates it at acceptance)
    and the script gets the base and the ages."""
    config = model.config
    batch = [(replace(r, at_ms=None if base is None else base - r.age_ms), roll)
             for r, roll in batch]
    args = head(config, cap=model.cap, base="" if base is None else base)
    for r, roll in batch:
        args += entry(config, r, roll)
    reply = report(keys=REPORT_KEYS, args=args)
    status, now, extra = reply[0], reply[1], reply[5]
    # an id reused with other content (in the store or earlier in the call) refuses the call
    seen: dict[tuple[str, str], str] = {}
    reused = None
    for n, (r, _) in enumerate(batch):
        if r.report_id:
            key = (r.scope, r.report_id)
            first = model.ids[key][0] if key in model.ids else seen.get(key)
            if first is not None and first != r.fingerprint:
                reused = n + 1
                break
            seen.setdefault(key, r.fingerprint)
    if reused is not None:
        assert (status, int(extra)) == (-4, reused)
        assert _table(raw) == model.table
        assert raw.xlen(f"{PREFIX}:latency-log") == model.logged
        return
    assert status in (1, -2), status
    in_call: set[tuple[str, str]] = set()
    fresh: list[tuple[int, ReportIn, int]] = []
    expired: set[int] = set()
    for n, (r, roll) in enumerate(batch):
        key = (r.scope, r.report_id)
        if r.seq in model.seqs or (r.report_id and (key in model.ids or key in in_call)):
            continue
        if r.report_id and r.at(now) <= now - REPORT_ID_WINDOW_MS + REPORT_ID_MARGIN_MS:
            # an id the memory may have forgotten (its window: no cap is reached here)
            expired.add(n)
            continue
        if r.report_id:
            in_call.add(key)
        fresh.append((n, r, roll))
    applied = apply_reports(model.table, [r for _, r, _ in fresh], now,
                            Rules(config, model.cap), [roll for _, _, roll in fresh])
    for b in applied.evicted:
        model.table.pop(b, None)
    if applied.full:
        assert status == -2
        assert _table(raw) == model.table
        assert raw.xlen(f"{PREFIX}:latency-log") == model.logged
        return
    assert status == 1
    ends, versions, changes, quorums, durations, values, probes, dups = (
        reply[i] for i in (2, 3, 4, 6, 7, 8, 9, 10))
    answers: dict[int, tuple[int, int, int, int, int]] = {}
    for (n, r, _), e in zip(fresh, applied.effects, strict=True):
        if e.written and e.item is not None:
            model.table[r.broker_name] = e.item
            assert codec.decode_fault(r.broker_name, values[n]) == e.item, (n, r)
        # pushed exactly when another replica must see it
        assert (versions[n] > 0) == (e.written and e.visible), (n, r)
        if not r.pending:
            model.logged += 1
        end = now if e.item is None else e.item.available_at
        answers[n] = (end, e.duration_ms, int(e.change), _quorum(e.quorum), _probe(e.probe))
        if r.report_id:
            model.ids[(r.scope, r.report_id)] = (r.fingerprint, answers[n])
        model.seqs.add(r.seq)
        model.sent.append(r)
    for n, (r, _) in enumerate(batch):
        got = (ends[n], durations[n], changes[n], quorums[n], probes[n])
        if n in answers:
            assert dups[n] == 0, n
            assert got == answers[n], (n, r)
        elif n in expired:
            assert dups[n] == 2, n  # changing nothing: the table compares below
            model.seqs.add(r.seq)
        else:
            assert dups[n] == 1, n
            if r.report_id:
                assert got == model.ids[(r.scope, r.report_id)][1], (n, r)
            model.seqs.add(r.seq)
    assert _table(raw) == model.table
    assert raw.xlen(f"{PREFIX}:latency-log") == model.logged


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


@settings(max_examples=examples(), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_report_lua_and_the_python_rule_keep_the_same_table(
    server: RedisServer, scenario: tuple[Config, int, list[Any]]
) -> None:
    config, cap, steps = scenario
    with server.client() as raw:
        raw.flushall()
        report, reach = script(raw, "report"), script(raw, "reach")
        model = Model(config, cap)
        for step in steps:
            if step[0] == "reports":
                batch = []
                for r, roll in step[1]:
                    model.next_seq += 1
                    rid = f"id{model.next_seq}" if step[2] else ""
                    batch.append((replace(r, seq=model.next_seq, report_id=rid), roll))
                sec, usec = raw.time()
                base = None if step[3] is None else sec * 1000 + usec // 1000 + step[3]
                _send(raw, report, model, batch, base)
            elif step[0] == "repeat" and model.sent:
                # the same report sent again: by its sequence number (a journal replay) or
                # by its id with the same content, or its id with other content (reused)
                again = model.sent[step[1] % len(model.sent)]
                if step[2] and again.report_id:
                    other = replace(again, latency_ms=again.latency_ms + 1, seq=0)
                    model.next_seq += 1
                    _send(raw, report, model, [(replace(other, seq=model.next_seq), 0)])
                else:
                    _send(raw, report, model, [(again, 0)])
            elif step[0] == "reach":
                broker, reading = step[1], step[2]
                sec, usec = raw.time()
                early = config.early_recovery and config.send_latency_fault_enable
                changed = reach(keys=[f"{PREFIX}:faults", f"{PREFIX}:meta", f"{PREFIX}:ends"],
                                args=[CHANNEL, int(early), 0, broker, int(reading)])
                item = model.table.get(broker)
                if item is not None and item.reachable is not reading:
                    (name, _, value), = changed
                    now = codec.decode_fault(broker, value)
                    # reach.lua's clock: the window end it set, if it ended one early
                    at = now.available_at if now.available_at != item.available_at \
                        else sec * 1000 + usec // 1000
                    model.table[broker] = policy.reach(item, reading, at, config)
                else:
                    assert changed == []
                assert _table(raw) == model.table
