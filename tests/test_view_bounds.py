"""The view's per-name maps: each bounded, each dropped with its item (no I/O, no clock)."""

from __future__ import annotations

import pytest

from detour.model import FaultItem, Route
from detour.view import Snapshot, TableView

pytestmark = pytest.mark.unit


def item(broker: str, available_at: int = 0) -> FaultItem:
    return FaultItem(broker, 100, available_at)


def view() -> TableView:
    return TableView(lambda: 1_000)


def test_a_delete_applied_in_sequence_leaves_no_version_behind() -> None:
    v = view()
    for i in range(1, 5001):
        v.version = 2 * i  # the memory store: every change is in sequence
        v.apply_fault(f"b{i}", item(f"b{i}"), 2 * i - 1)
        v.apply_fault(f"b{i}", None, 2 * i)
    assert v.sizes()["faults"] == 0 and v.sizes()["fault_versions"] == 0


def test_a_tombstone_holds_off_an_older_change_until_the_view_catches_up() -> None:
    v = view()
    v.apply_fault("a", None, 10)  # this replica's own delete; pushes up to 9 still coming
    v.apply_fault("a", item("a"), 9)  # the late push of an older write: ignored
    assert "a" not in v.faults
    for i in range(2000):  # many more deletes ahead of the view: kept, then swept
        v.apply_fault(f"x{i}", None, 11 + i)
    assert v.sizes()["fault_versions"] == 2001
    v.version = 5000  # every change up to here applied in sequence
    for i in range(100):  # the next sweep drops every tombstone the view has caught up with
        v.apply_fault(f"y{i}", None, 6000 + i)
    sizes = v.sizes()["fault_versions"]
    assert sizes <= 100, sizes


def test_tombstones_are_capped_even_when_the_view_never_catches_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TableView, "MAX_TOMBSTONES", 3000)
    v = view()
    for i in range(10_000):
        v.apply_fault(f"x{i}", None, 1 + i)
        assert v.sizes()["fault_versions"] <= 3001
    # The newest are the ones kept.
    v.apply_fault("x9999", item("x9999"), 5)
    assert "x9999" not in v.faults


def test_topic_counters_are_an_lru_and_go_with_their_route() -> None:
    v = view()
    v.bound_names(max_topics=3, max_brokers=10)
    for t in ("a", "b", "c"):
        v.set_counter(t, 1)
    v.set_counter("a", 2)  # a used again: b is now the least recently used
    v.set_counter("d", 1)
    assert v.selector.sizes()[0] == 3
    assert v.counter("a") == 2 and v.counter("d") == 1
    route = Route.from_queues("d", ())
    v.apply_route("d", route, 1)
    v.apply_route("d", None, 2)
    assert v.selector.sizes()[0] == 2


def test_scores_and_probes_go_with_their_fault_item() -> None:
    v = view()
    v.bound_names(max_topics=10, max_brokers=2)
    v.apply_fault("a", item("a", available_at=500), 1)
    v.observe_latency("a", 40, 1_000)
    v.probe_sent("a", 1_000)
    assert v.selector.sizes() == (0, 1, 1)
    v.apply_fault("a", None, 2)
    assert v.selector.sizes() == (0, 0, 0)
    # Brokers scored without an item: the least recently reported go past the cap.
    for b in ("p", "q", "r"):
        v.observe_latency(b, 10, 1_000)
    assert v.selector.sizes()[1] == 2 and "p" not in v.latency_scores


def test_a_resync_drops_the_state_of_items_it_removes() -> None:
    v = view()
    v.apply_fault("a", item("a"), 1)
    v.apply_fault("b", item("b"), 2)
    v.observe_latency("a", 40, 1_000)
    v.observe_latency("b", 40, 1_000)
    v.replace(Snapshot(5, v.config, 0, {}, {"b": item("b")}))
    assert set(v.faults) == {"b"} and set(v.latency_scores) == {"b"}
