"""A report is dated once, by the replica that accepts it (``ReportIn.dated``), on the table's
clock as that replica knows it; every store that applies it later (Redis running the call
late, the answer made from the replica's copy, the journal's replay) opens the window from
that date, never in the table's future. The end-to-end members of this class (a late
reply, a frozen Redis, an empty restart, an outage under load) are in test_late_replies.py
and the scenario suites; these hold the rule itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from detour.apply import ReportIn, Rules, apply_reports
from detour.model import MAX_REPORT_AGE_MS, Config
from service.store import codec
from service.store.journal import Journal
from tests.lua import PREFIX, REPORT_KEYS, entry, head, script
from tests.procs import RedisServer

ISOLATION = ReportIn("a", 5, True)  # the 600 s tier


@pytest.mark.unit
def test_an_undated_report_happened_its_age_before_now() -> None:
    r = ReportIn("a", 5, age_ms=300)
    assert r.at(10_000) == 9_700
    assert r.at(20_000) == 19_700


@pytest.mark.unit
def test_a_dated_report_keeps_its_date_however_late_it_is_applied() -> None:
    r = ReportIn("a", 5, age_ms=300).dated(10_000)
    assert r.at_ms == 9_700
    assert r.at(10_050) == r.at(70_000) == 9_700
    assert r.dated(50_000) is r  # dated once: a second acceptance does not move it


@pytest.mark.unit
def test_a_date_in_the_tables_future_is_now() -> None:
    """A replica's estimate ahead of the table's clock (a failover to a host whose clock is
    behind) must not open a window in the table's future: a tier-0 item would look avoided."""
    r = ReportIn("a", 5).dated(10_000)
    assert r.at(9_000) == 9_000


@pytest.mark.unit
def test_the_window_is_opened_from_the_date_not_from_when_it_is_applied() -> None:
    dated = ISOLATION.dated(1_000_000)
    for now in (1_000_000, 1_000_050, 1_003_000):
        (e,) = apply_reports({}, [dated], now, Rules(Config())).effects
        assert e.item is not None and e.item.available_at == 1_600_000, now


@pytest.mark.unit
def test_the_journal_keeps_dates_and_expires_by_the_tables_clock() -> None:
    j = Journal(10)
    old, new = ISOLATION.dated(1_000), ReportIn("b", 5, True).dated(5_000)
    j.append(old)
    j.append(new)
    assert j.take(10, 2_000) == [old, new]  # nothing moved: replayed at their dates
    assert j.take(10, 1_000 + MAX_REPORT_AGE_MS) == [old, new]  # a day old: still kept
    assert j.take(10, 1_001 + MAX_REPORT_AGE_MS) == [new]  # older than any window: gone
    assert len(j) == 1


@pytest.mark.unit
def test_the_journal_takes_only_dated_reports() -> None:
    with pytest.raises(ValueError, match="date"):
        Journal(10).append(ISOLATION)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.stop()


def _call(raw: redis.Redis, base: int | str, r: ReportIn) -> tuple[int, int]:
    """report.lua with ``base``; (the script's now, the stored item's window end)."""
    raw.flushall()
    reply = script(raw, "report")(keys=REPORT_KEYS,
                                  args=head(Config(), base=base) + entry(Config(), r))
    assert reply[0] == 1, reply
    return int(reply[1]), codec.decode_fault("a", raw.hget(f"{PREFIX}:faults", "a")).available_at


@pytest.mark.integration
def test_report_lua_dates_a_report_from_the_callers_base(server: RedisServer) -> None:
    with server.client() as raw:
        sec, usec = raw.time()
        base = sec * 1000 + usec // 1000 - 5_000  # the replica read its clock 5 s ago
        now, end = _call(raw, base, ReportIn("a", 5, True, age_ms=250))
        assert now > base + 5_000 - 1
        assert end == base - 250 + 600_000  # not now - 250: the date the replica answered
        now, end = _call(raw, "", ReportIn("a", 5, True, age_ms=250))
        assert end == now - 250 + 600_000  # no base: the script's own now


@pytest.mark.integration
def test_report_lua_never_dates_a_report_in_the_tables_future(server: RedisServer) -> None:
    with server.client() as raw:
        sec, usec = raw.time()
        ahead = sec * 1000 + usec // 1000 + 60_000
        now, end = _call(raw, ahead, ReportIn("a", 5))  # tier 0: no window
        assert end == now  # available at once, not a minute from now
        now, end = _call(raw, ahead, ReportIn("a", 5, True))
        assert end == now + 600_000
