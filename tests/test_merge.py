"""detour.merge: the merge of two copies of a fault item is a join (commutative, associative,
idempotent), never shortens a window, and takes everything but the window end from the
newer copy; reseed.lua applies the same rule (tests/test_scenario_redis_loss.py runs it
against real restarts)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from detour.merge import adds_to, beats_grave, merge_items
from detour.model import FaultItem, Why
from service.store import codec

pytestmark = pytest.mark.unit

NOW = 1_764_000_000_000
enc = codec.encode_fault

items = st.builds(
    FaultItem,
    st.just("a"),
    st.integers(0, 5000),
    st.integers(NOW - 10_000, NOW + 600_000),
    st.integers(0, 3),
    st.lists(st.tuples(st.sampled_from(("p1", "p2")), st.integers(NOW - 100, NOW)),
             max_size=2, unique_by=lambda s: s[0]).map(tuple),
    st.booleans(),
    st.sampled_from((None, True, False)),
    why=st.one_of(st.none(), st.builds(Why, st.sampled_from(("isolation", "latency")),
                                       st.integers(NOW - 100, NOW), st.integers(0, 5000),
                                       st.sampled_from(("", "p1")))),
    stamp=st.integers(1, 6),  # few stamps: ties happen
)
maybe = st.one_of(st.none(), items)


def same(a: FaultItem | None, b: FaultItem | None) -> bool:
    return (a is None and b is None) or (
        a is not None and b is not None and enc(a) == enc(b))


@given(maybe, maybe)
def test_commutative(a: FaultItem | None, b: FaultItem | None) -> None:
    assert same(merge_items(a, b, enc), merge_items(b, a, enc))


@given(maybe, maybe, maybe)
@example(  # window ends tie, reasons and stamps differ: the window is chosen by its own order
    FaultItem("a", 0, NOW + 1, stamp=2),
    FaultItem("a", 0, NOW + 2, stamp=1),
    FaultItem("a", 0, NOW + 2, stamp=1, why=Why("isolation", NOW, 0, "")),
)
def test_associative(a: FaultItem | None, b: FaultItem | None, c: FaultItem | None) -> None:
    assert same(merge_items(merge_items(a, b, enc), c, enc),
                merge_items(a, merge_items(b, c, enc), enc))


@given(maybe)
def test_idempotent(a: FaultItem | None) -> None:
    assert same(merge_items(a, a, enc), a)


@given(items, items)
def test_no_window_shrinks_and_the_rest_is_the_newer_copys(a: FaultItem, b: FaultItem) -> None:
    m = merge_items(a, b, enc)
    assert m is not None
    assert m.available_at == max(a.available_at, b.available_at)
    newer = b if (b.stamp, rest(b), enc(b)) > (a.stamp, rest(a), enc(a)) else a
    assert (m.current_latency_ms, m.isolations, m.suspects, m.probation, m.reachable,
            m.stamp) == (newer.current_latency_ms, newer.isolations, newer.suspects,
                         newer.probation, newer.reachable, newer.stamp)
    # the reason a window is open travels with its end
    if a.available_at != b.available_at:
        assert m.why == (a if a.available_at > b.available_at else b).why


def rest(x: FaultItem) -> str:
    """What a copy says besides its window: the tiebreak between copies with one stamp."""
    return enc(replace(x, available_at=0, why=None))


@given(maybe, items)
def test_a_copy_is_sent_exactly_when_it_adds_something(theirs: FaultItem | None,
                                                        mine: FaultItem) -> None:
    """What a replica sends in a merge: nothing for a copy the table has already merged."""
    merged = merge_items(theirs, mine, enc)
    assert adds_to(theirs, mine, enc) == (not same(merged, theirs))
    assert not adds_to(merged, mine, enc)


def test_a_grave_beats_the_copies_written_before_it_only() -> None:
    assert not beats_grave(5, 7) and not beats_grave(7, 7)
    assert beats_grave(8, 7) and beats_grave(1, None)
