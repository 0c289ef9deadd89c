"""Unit tests for the pure fault strategy (detour.model, detour.strategy).

The key test is ``test_select_matches_reference``: ``select`` jumps over a
broker's run of queues in one step, and a plain probe-one-queue-at-a-time
reference written here must agree with it on every input.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import lcm

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detour.model import (
    DEFAULT_LATENCY_MAX,
    DEFAULT_NOT_AVAILABLE_DURATION,
    BrokerRoute,
    Config,
    FaultItem,
    Queue,
    Route,
)
from detour.strategy import (
    Decision,
    Selection,
    WindowChange,
    apply_report,
    not_available_duration,
    pick_one_at_least,
    rank_brokers,
    report_duration,
    select,
    updated_available_at,
    window_change,
)
from tests.budget import examples

pytestmark = pytest.mark.unit

HYP = settings(max_examples=examples(), deadline=None)
NOW = 1_700_000_000_000
BROKER_POOL: tuple[str, ...] = tuple(f"broker-{c}" for c in "abcdefghij")
NOT_IN_ROUTE = "broker-zz"


# ---------------------------------------------------------------- helpers


def make_route(spec: Mapping[str, int], topic: str = "t") -> Route:
    """A route with ``spec[broker]`` queues (ids 0..n-1) per broker."""
    return Route.from_brokers(topic, [BrokerRoute(b, n) for b, n in spec.items()])


def open_item(broker: str, latency: int = 0, remaining: int = 10_000, now: int = NOW) -> FaultItem:
    """A fault item whose window is open for ``remaining`` more ms."""
    return FaultItem(broker, latency, now + remaining)


def ref_duration(latency_max: Sequence[int], durations: Sequence[int], latency: int) -> int:
    """The spec, literally: scan from the top, first ``latency >= latencyMax[i]`` wins."""
    for i in reversed(range(len(latency_max))):
        if latency >= latency_max[i]:
            return durations[i]
    return 0


def ref_available(faults: Mapping[str, FaultItem], broker: str, now: int) -> bool:
    item = faults.get(broker)
    return item is None or now >= item.available_at


def ref_pick_one_at_least(
    route: Route, faults: Mapping[str, FaultItem], now: int, counter: int
) -> Queue:
    brokers: list[str] = []
    for q in route.queues:
        if q.broker_name not in brokers:
            brokers.append(q.broker_name)
    candidates = [b for b in brokers if b in faults] or brokers

    def key(b: str) -> tuple[int, int, int, str]:
        item = faults.get(b)
        if item is None:
            return (0, 0, 0, b)
        return (0 if now >= item.available_at else 1, item.current_latency_ms, item.available_at, b)

    ranked = sorted(candidates, key=key)
    half = max(1, len(ranked) // 2)
    broker = ranked[counter % half]
    its_queues = [q for q in route.queues if q.broker_name == broker]
    return its_queues[(counter // half) % len(its_queues)]


def ref_select(
    route: Route,
    counter: int,
    faults: Mapping[str, FaultItem],
    now: int,
    last_broker: str | None,
    enabled: bool,
) -> Selection:
    """Probe queue by queue from ``counter % n``; no run jumping."""
    queues = route.queues
    n = len(queues)
    if n == 0:
        raise ValueError("empty route")
    start = counter % n
    if not enabled:
        for steps in range(n):
            q = queues[(start + steps) % n]
            if q.broker_name != last_broker:
                return Selection(q, Decision.ROUND_ROBIN, (), counter + steps + 1)
        return Selection(queues[start], Decision.ROUND_ROBIN, (), counter + 1)

    avoided: list[str] = []
    fallback: tuple[Queue, int] | None = None
    for steps in range(n):
        q = queues[(start + steps) % n]
        if not ref_available(faults, q.broker_name, now):
            if q.broker_name not in avoided:
                avoided.append(q.broker_name)
            continue
        if q.broker_name != last_broker:
            return Selection(q, Decision.AVAILABLE, tuple(avoided), counter + steps + 1)
        if fallback is None:
            fallback = (q, steps)
    if fallback is not None:
        q, steps = fallback
        return Selection(q, Decision.AVAILABLE, tuple(avoided), counter + steps + 1)
    q = ref_pick_one_at_least(route, faults, now, counter)
    rest = tuple(b for b in avoided if b != q.broker_name)
    return Selection(q, Decision.PICK_ONE_AT_LEAST, rest, counter + 1)


def rocketmq4_select(
    route: Route, counter: int, faults: Mapping[str, FaultItem], now: int
) -> tuple[Queue, int]:
    """RocketMQ 4.x MQFaultStrategy (lastBrokerName == null): the topic counter
    is read once per select (getAndIncrement) and the probe index is a local copy."""
    queues = route.queues
    n = len(queues)
    index = counter
    for _ in range(n):
        q = queues[index % n]
        index += 1
        if ref_available(faults, q.broker_name, now):
            return q, counter + 1
    return queues[counter % n], counter + 1


def run_selects(
    route: Route, faults: Mapping[str, FaultItem], counter: int, times: int
) -> Counter[Queue]:
    counts: Counter[Queue] = Counter()
    for _ in range(times):
        sel = select(route, counter, faults, NOW, None, enabled=True)
        counts[sel.queue] += 1
        counter = sel.next_counter
    return counts


def brokers_of(route: Route) -> list[str]:
    return sorted({q.broker_name for q in route.queues})


# ---------------------------------------------------------------- strategies


@dataclass(frozen=True)
class Scenario:
    route: Route
    faults: dict[str, FaultItem]
    now: int
    counter: int
    last_broker: str | None


@st.composite
def routes(draw: st.DrawFn, max_brokers: int = 8, max_queues: int = 6) -> Route:
    names = draw(
        st.lists(st.sampled_from(BROKER_POOL), min_size=1, max_size=max_brokers, unique=True)
    )
    queues: list[Queue] = []
    for name in names:
        ids = draw(st.lists(st.integers(0, 15), min_size=1, max_size=max_queues, unique=True))
        queues.extend(Queue(name, i) for i in ids)
    if draw(st.booleans()):  # inline queue lists may repeat a queue
        queues.extend(draw(st.lists(st.sampled_from(queues), max_size=3)))
    return Route.from_queues("t", draw(st.permutations(queues)))


@st.composite
def fault_tables(draw: st.DrawFn, brokers: Sequence[str], now: int) -> dict[str, FaultItem]:
    all_open = draw(st.integers(0, 3)) == 0  # often enough to reach pick_one_at_least
    faults: dict[str, FaultItem] = {}
    for b in [*brokers, NOT_IN_ROUTE]:
        state = "open" if all_open and b != NOT_IN_ROUTE else None
        state = state or draw(st.sampled_from(["none", "open", "expired", "edge"]))
        if state == "none":
            continue
        if state == "open":
            end = now + draw(st.one_of(st.integers(1, 3), st.integers(1, 600_000)))
        elif state == "expired":
            end = now - draw(st.integers(1, 600_000))
        else:  # window ends exactly now: available
            end = now
        faults[b] = FaultItem(b, draw(st.integers(0, 3)), end)
    return faults


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    route = draw(routes())
    brokers = brokers_of(route)
    now = draw(st.integers(0, 2**41))
    faults = draw(fault_tables(brokers, now))
    counter = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**64)))
    last_broker = draw(st.one_of(st.none(), st.sampled_from(brokers), st.just(NOT_IN_ROUTE)))
    return Scenario(route, faults, now, counter, last_broker)


# ---------------------------------------------------------------- 1. durations

DEFAULT_CASES: list[tuple[int, int]] = [
    (0, 0),
    (49, 0),
    (50, 0),
    (51, 0),
    (99, 0),
    (100, 0),
    (101, 0),
    (549, 0),
    (550, 30000),
    (551, 30000),
    (999, 30000),
    (1000, 60000),
    (1001, 60000),
    (1999, 60000),
    (2000, 120000),
    (2001, 120000),
    (2999, 120000),
    (3000, 180000),
    (3001, 180000),
    (14999, 180000),
    (15000, 600000),
    (15001, 600000),
    (10**12, 600000),
]


def test_default_tables_are_rocketmqs() -> None:
    assert DEFAULT_LATENCY_MAX == (50, 100, 550, 1000, 2000, 3000, 15000)
    assert DEFAULT_NOT_AVAILABLE_DURATION == (0, 0, 30000, 60000, 120000, 180000, 600000)
    cfg = Config()
    assert cfg.latency_max == DEFAULT_LATENCY_MAX
    assert cfg.not_available_duration == DEFAULT_NOT_AVAILABLE_DURATION
    assert cfg.isolation_latency_ms == 30000
    assert cfg.last_report_wins is False
    assert cfg.send_latency_fault_enable is True


@pytest.mark.parametrize(("latency", "expected"), DEFAULT_CASES)
def test_default_duration_every_tier_boundary(latency: int, expected: int) -> None:
    assert not_available_duration(Config(), latency) == expected
    assert report_duration(Config(), latency, isolation=False) == expected


def test_default_boundary_cases_cover_every_tier() -> None:
    covered = {lat for lat, _ in DEFAULT_CASES}
    for x in DEFAULT_LATENCY_MAX:
        assert {x - 1, x, x + 1} <= covered


@pytest.mark.parametrize(
    ("isolation_latency_ms", "latency", "expected"),
    [
        (30000, 0, 600000),  # default: a failure isolates for 10 minutes
        (30000, 10**9, 600000),
        (1000, 0, 60000),
        (1000, 10**9, 60000),  # the reported latency is ignored on isolation
        (549, 20000, 0),
        (0, 20000, 0),
    ],
)
def test_isolation_uses_isolation_latency(
    isolation_latency_ms: int, latency: int, expected: int
) -> None:
    cfg = Config(isolation_latency_ms=isolation_latency_ms)
    assert report_duration(cfg, latency, isolation=True) == expected


def test_isolation_with_custom_tables() -> None:
    cfg = Config(latency_max=(10, 20), not_available_duration=(5, 7), isolation_latency_ms=15)
    assert report_duration(cfg, 100, isolation=True) == 5
    assert report_duration(cfg, 100, isolation=False) == 7


@pytest.mark.parametrize(
    ("latency", "expected"), [(0, 0), (9, 0), (10, 500), (11, 500), (10**12, 500)]
)
def test_custom_table_of_length_1(latency: int, expected: int) -> None:
    cfg = Config(latency_max=(10,), not_available_duration=(500,))
    assert not_available_duration(cfg, latency) == expected


@pytest.mark.parametrize(
    ("latency", "expected"), [(0, 7), (1, 7), (99, 7), (100, 9), (101, 9), (10**9, 9)]
)
def test_table_whose_first_latency_max_is_zero(latency: int, expected: int) -> None:
    cfg = Config(latency_max=(0, 100), not_available_duration=(7, 9))
    assert not_available_duration(cfg, latency) == expected


def test_custom_table_of_length_32_every_boundary() -> None:
    latency_max = tuple(range(10, 330, 10))
    durations = tuple(1000 * (i + 1) for i in range(32))
    assert len(latency_max) == 32
    cfg = Config(latency_max=latency_max, not_available_duration=durations)
    assert not_available_duration(cfg, 0) == 0
    assert not_available_duration(cfg, 9) == 0
    for i, x in enumerate(latency_max):
        below = durations[i - 1] if i > 0 else 0
        assert not_available_duration(cfg, x - 1) == below, x
        assert not_available_duration(cfg, x) == durations[i], x
        assert not_available_duration(cfg, x + 1) == durations[i], x
    assert not_available_duration(cfg, 10**12) == 32000


def test_non_monotonic_durations_are_taken_as_given() -> None:
    # Only latency_max must increase; the tier found is the answer, not a max over tiers.
    cfg = Config(latency_max=(10, 20, 30), not_available_duration=(900, 0, 50))
    assert [not_available_duration(cfg, x) for x in (9, 10, 19, 20, 29, 30)] == [
        0,
        900,
        900,
        0,
        0,
        50,
    ]


@st.composite
def tables(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = draw(st.integers(1, 32))
    latency_max = tuple(sorted(draw(st.sets(st.integers(0, 100_000), min_size=n, max_size=n))))
    durations = tuple(draw(st.lists(st.integers(0, 10**7), min_size=n, max_size=n)))
    return latency_max, durations


@HYP
@given(tables(), st.integers(0, 200_000), st.integers(0, 200_000), st.booleans())
def test_duration_matches_top_down_scan(
    table: tuple[tuple[int, ...], tuple[int, ...]], latency: int, iso: int, isolation: bool
) -> None:
    latency_max, durations = table
    cfg = Config(
        latency_max=latency_max, not_available_duration=durations, isolation_latency_ms=iso
    )
    effective = iso if isolation else latency
    expected = ref_duration(latency_max, durations, effective)
    assert report_duration(cfg, latency, isolation) == expected
    assert not_available_duration(cfg, effective) == expected
    for x in latency_max:
        assert not_available_duration(cfg, x) == ref_duration(latency_max, durations, x)


# ---------------------------------------------------------------- 1b. Config validation


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"latency_max": (1, 2), "not_available_duration": (0,)}, id="mismatch-short"),
        pytest.param({"latency_max": (1,), "not_available_duration": (0, 0)}, id="mismatch-long"),
        pytest.param({"latency_max": (), "not_available_duration": ()}, id="length-0"),
        pytest.param(
            {"latency_max": tuple(range(33)), "not_available_duration": (0,) * 33},
            id="length-33",
        ),
        pytest.param({"latency_max": (10, 10), "not_available_duration": (0, 0)}, id="equal-steps"),
        pytest.param(
            {"latency_max": (10, 20, 15), "not_available_duration": (0, 0, 0)}, id="decreasing"
        ),
        pytest.param({"latency_max": (-1, 5), "not_available_duration": (0, 0)}, id="neg-max"),
        pytest.param({"latency_max": (1, 5), "not_available_duration": (0, -1)}, id="neg-duration"),
        pytest.param({"isolation_latency_ms": -1}, id="neg-isolation"),
    ],
)
def test_config_rejects_bad_tables(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Config(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 2, 7, 31, 32])
def test_config_accepts_lengths_1_to_32(n: int) -> None:
    cfg = Config(latency_max=tuple(range(n)), not_available_duration=(0,) * n)
    assert len(cfg.latency_max) == n


def test_config_accepts_zeros() -> None:
    cfg = Config(latency_max=(0,), not_available_duration=(0,), isolation_latency_ms=0)
    assert not_available_duration(cfg, 0) == 0


# ---------------------------------------------------------------- 2. update rule


@pytest.mark.parametrize(
    ("old", "now", "duration", "extend", "overwrite"),
    [
        (None, 1000, 30000, 31000, 31000),  # first report
        (None, 1000, 0, 1000, 1000),
        (5000, 10000, 30000, 40000, 40000),  # expired window: both rules agree
        (50000, 10000, 30000, 50000, 40000),  # shorter report: extend keeps, 4.x shrinks
        (50000, 10000, 60000, 70000, 70000),  # longer report: both move the end
        (700000, 100500, 0, 700000, 100500),  # fast success after isolation
    ],
)
def test_updated_available_at(
    old: int | None, now: int, duration: int, extend: int, overwrite: int
) -> None:
    assert updated_available_at(old, now, duration, last_report_wins=False) == extend
    assert updated_available_at(old, now, duration, last_report_wins=True) == overwrite


@HYP
@given(
    st.one_of(st.none(), st.integers(0, 2**42)),
    st.integers(0, 2**41),
    st.integers(0, 10**7),
)
def test_updated_available_at_rules(old: int | None, now: int, duration: int) -> None:
    assert updated_available_at(old, now, duration, True) == now + duration
    extended = updated_available_at(old, now, duration, False)
    assert extended == (now + duration if old is None else max(old, now + duration))


@pytest.mark.parametrize("last_report_wins", [False, True])
def test_apply_report_sets_latency_always(last_report_wins: bool) -> None:
    old = FaultItem("a", 30000, 700000)
    new = apply_report(old, "a", 12, 0, 100500, last_report_wins)
    assert new.broker_name == "a"
    assert new.current_latency_ms == 12
    assert new.available_at == (100500 if last_report_wins else 700000)
    first = apply_report(None, "b", 600, 30000, 1000, last_report_wins)
    assert first == FaultItem("b", 600, 31000)


def test_fast_success_after_isolation() -> None:
    cfg = Config()
    t0 = 1_000_000
    iso = apply_report(None, "a", 30000, report_duration(cfg, 0, isolation=True), t0, False)
    assert iso.available_at == t0 + 600000
    assert window_change(None, iso.available_at, t0) is WindowChange.OPENED
    assert not iso.is_available(t0 + 1000)

    t1 = t0 + 1000
    dur = report_duration(cfg, 5, isolation=False)
    assert dur == 0
    kept = apply_report(iso, "a", 5, dur, t1, last_report_wins=False)
    assert kept.available_at == iso.available_at
    assert kept.current_latency_ms == 5
    assert not kept.is_available(t1)
    assert window_change(iso.available_at, kept.available_at, t1) is WindowChange.NONE

    cleared = apply_report(iso, "a", 5, dur, t1, last_report_wins=True)
    assert cleared.available_at == t1
    assert cleared.current_latency_ms == 5
    assert cleared.is_available(t1)
    assert window_change(iso.available_at, cleared.available_at, t1) is WindowChange.CLEARED


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (None, NOW + 30000, True),  # opened
        (None, NOW, False),  # duration 0, no item: nothing visible
        (NOW - 5, NOW, False),  # duration 0 on an expired item
        (NOW - 5, NOW + 30000, True),  # re-opened
        (NOW, NOW, False),  # window ended exactly now, stays ended
        (NOW, NOW + 1, True),
        (NOW + 100, NOW + 200, True),  # moved later
        (NOW + 200, NOW + 100, True),  # moved earlier (last_report_wins)
        (NOW + 200, NOW + 200, False),  # extend that does not move the end
        (NOW + 200, NOW, True),  # cleared: now >= available_at means available
        (NOW + 200, NOW - 1, True),  # cleared
        (NOW + 1, NOW, True),  # cleared at the last ms
        (NOW - 10, NOW - 5, False),  # closed before and after
    ],
)
def test_window_changed(old: int | None, new: int, expected: bool) -> None:
    assert (window_change(old, new, NOW) is not WindowChange.NONE) is expected


@HYP
@given(
    st.one_of(st.none(), st.integers(NOW - 10, NOW + 10)),
    st.integers(NOW - 10, NOW + 10),
)
def test_window_changed_iff_visible_state_changed(old: int | None, new: int) -> None:
    was_open = old is not None and NOW < old
    is_open = NOW < new
    visible_before = old if was_open else None
    visible_after = new if is_open else None
    changed = window_change(old, new, NOW) is not WindowChange.NONE
    assert changed is (visible_before != visible_after)


# ---------------------------------------------------------------- 3. select, avoidance on


ABC = {"a": 4, "b": 4, "c": 4}


def test_select_no_faults_is_round_robin() -> None:
    route = make_route(ABC)
    for counter in range(30):
        sel = select(route, counter, {}, NOW, None, enabled=True)
        assert sel == Selection(route.queues[counter % 12], Decision.AVAILABLE, (), counter + 1)


@pytest.mark.parametrize(
    ("counter", "queue", "next_counter"),
    [
        (4, Queue("c", 0), 9),  # b0 probed .. c0: 5 probes
        (5, Queue("c", 0), 9),
        (7, Queue("c", 0), 9),
        (8, Queue("c", 0), 9),
        (3, Queue("a", 3), 4),
        (16, Queue("c", 0), 21),  # 16 % 12 == 4
    ],
)
def test_select_skips_avoided_broker_counting_each_probe(
    counter: int, queue: Queue, next_counter: int
) -> None:
    route = make_route(ABC)
    faults = {"b": open_item("b")}
    sel = select(route, counter, faults, NOW, None, enabled=True)
    assert sel.queue == queue
    assert sel.decision is Decision.AVAILABLE
    assert sel.next_counter == next_counter
    assert sel.avoided_brokers == (("b",) if counter % 12 in (4, 5, 6, 7) else ())


def test_select_avoided_brokers_in_order_met_and_distinct() -> None:
    route = make_route({"a": 2, "b": 2, "c": 2, "d": 2})
    faults = {b: open_item(b) for b in ("a", "b", "c")}
    sel = select(route, 3, faults, NOW, None, enabled=True)  # starts at b1
    assert sel.queue == Queue("d", 0)
    assert sel.avoided_brokers == ("b", "c")
    assert sel.next_counter == 3 + 3 + 1
    sel = select(route, 1, faults, NOW, None, enabled=True)  # starts at a1
    assert sel.avoided_brokers == ("a", "b", "c")
    assert sel.next_counter == 1 + 5 + 1


def test_select_window_end_is_exclusive() -> None:
    route = make_route({"a": 1, "b": 1})
    at_end = {"a": FaultItem("a", 5000, NOW)}
    assert select(route, 0, at_end, NOW, None, True).queue == Queue("a", 0)
    one_more = {"a": FaultItem("a", 5000, NOW + 1)}
    sel = select(route, 0, one_more, NOW, None, True)
    assert sel.queue == Queue("b", 0)
    assert sel.avoided_brokers == ("a",)


def test_select_latency_alone_does_not_avoid() -> None:
    route = make_route({"a": 1, "b": 1})
    slow_but_available = {"a": FaultItem("a", 10**6, NOW - 1)}
    assert select(route, 0, slow_but_available, NOW, None, True).queue == Queue("a", 0)


def test_select_skips_last_broker_when_another_is_available() -> None:
    route = make_route(ABC)
    sel = select(route, 0, {}, NOW, "a", enabled=True)
    assert sel == Selection(Queue("b", 0), Decision.AVAILABLE, (), 5)


def test_select_falls_back_to_last_broker_when_it_is_the_only_available() -> None:
    route = make_route(ABC)
    faults = {"b": open_item("b"), "c": open_item("c")}
    sel = select(route, 5, faults, NOW, "a", enabled=True)  # start at b1
    assert sel.queue == Queue("a", 0)
    assert sel.decision is Decision.AVAILABLE
    assert sel.avoided_brokers == ("b", "c")
    assert sel.next_counter == 5 + 7 + 1
    sel = select(route, 2, faults, NOW, "a", enabled=True)  # start at a2
    assert sel.queue == Queue("a", 2)
    assert sel.next_counter == 3
    assert sel.avoided_brokers == ("b", "c")


def test_select_single_broker_that_is_last_broker() -> None:
    route = make_route({"a": 3})
    for counter in range(7):
        sel = select(route, counter, {}, NOW, "a", enabled=True)
        assert sel == Selection(route.queues[counter % 3], Decision.AVAILABLE, (), counter + 1)


def test_select_last_broker_not_in_route_is_ignored() -> None:
    route = make_route(ABC)
    for counter in range(12):
        sel = select(route, counter, {}, NOW, NOT_IN_ROUTE, enabled=True)
        assert sel.queue == route.queues[counter % 12]
        assert sel.next_counter == counter + 1


def test_select_all_avoided_uses_pick_one_at_least() -> None:
    route = make_route(ABC)
    faults = {
        "a": open_item("a", latency=3000),
        "b": open_item("b", latency=100),
        "c": open_item("c", latency=500),
    }
    for counter in range(12):
        sel = select(route, counter, faults, NOW, None, enabled=True)
        # 3 candidates -> better half of 1 -> always b, queues spread by counter
        assert sel.queue == Queue("b", counter % 4)
        assert sel.decision is Decision.PICK_ONE_AT_LEAST
        assert sel.next_counter == counter + 1
        assert "b" not in sel.avoided_brokers
        assert set(sel.avoided_brokers) == {"a", "c"}


def test_select_pick_ignores_faults_of_brokers_outside_route() -> None:
    route = make_route({"a": 2, "b": 2})
    faults = {
        "a": open_item("a", latency=10),
        "b": open_item("b", latency=20),
        NOT_IN_ROUTE: FaultItem(NOT_IN_ROUTE, 0, 0),
    }
    sel = select(route, 0, faults, NOW, None, enabled=True)
    assert sel.queue.broker_name == "a"
    assert sel.decision is Decision.PICK_ONE_AT_LEAST


@HYP
@given(scenarios())
def test_select_matches_reference(sc: Scenario) -> None:
    """The key differential test: run jumping == probing queue by queue."""
    for enabled in (True, False):
        got = select(sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled)
        want = ref_select(sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled)
        assert got == want, enabled


@HYP
@given(scenarios(), st.integers(1, 40))
def test_select_chain_matches_reference(sc: Scenario, times: int) -> None:
    """Feeding next_counter back keeps agreeing (the counter is the only state)."""
    got_counter = want_counter = sc.counter
    for _ in range(times):
        got = select(sc.route, got_counter, sc.faults, sc.now, sc.last_broker, True)
        want = ref_select(sc.route, want_counter, sc.faults, sc.now, sc.last_broker, True)
        assert got == want
        got_counter, want_counter = got.next_counter, want.next_counter


@HYP
@given(scenarios(), st.data())
def test_select_on_unsorted_route_matches_reference(sc: Scenario, data: st.DataObject) -> None:
    """A Route built directly, queues interleaved across brokers (runs of any length)."""
    queues = data.draw(st.permutations(sc.route.queues))
    route = Route("t", tuple(queues), {q.broker_name: None for q in queues})
    for enabled in (True, False):
        got = select(route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled)
        want = ref_select(route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled)
        assert got == want


# ---------------------------------------------------------------- 4. avoidance off


def test_select_disabled_ignores_faults() -> None:
    route = make_route(ABC)
    faults = {b: open_item(b) for b in ABC}
    for counter in range(24):
        sel = select(route, counter, faults, NOW, None, enabled=False)
        assert sel == Selection(route.queues[counter % 12], Decision.ROUND_ROBIN, (), counter + 1)


def test_select_disabled_skips_last_broker() -> None:
    route = make_route(ABC)
    faults = {"b": open_item("b")}
    sel = select(route, 0, faults, NOW, "a", enabled=False)
    assert sel == Selection(Queue("b", 0), Decision.ROUND_ROBIN, (), 5)
    sel = select(route, 10, faults, NOW, "c", enabled=False)
    assert sel == Selection(Queue("a", 0), Decision.ROUND_ROBIN, (), 13)
    sel = select(route, 6, faults, NOW, "a", enabled=False)
    assert sel == Selection(Queue("b", 2), Decision.ROUND_ROBIN, (), 7)


def test_select_disabled_single_broker_that_is_last_broker() -> None:
    route = make_route({"a": 3})
    for counter in range(6):
        sel = select(route, counter, {}, NOW, "a", enabled=False)
        assert sel == Selection(route.queues[counter % 3], Decision.ROUND_ROBIN, (), counter + 1)


@HYP
@given(scenarios())
def test_select_disabled_properties(sc: Scenario) -> None:
    sel = select(sc.route, sc.counter, sc.faults, sc.now, sc.last_broker, enabled=False)
    assert sel.decision is Decision.ROUND_ROBIN
    assert sel.avoided_brokers == ()
    assert sel.queue in sc.route.queues
    others = [b for b in brokers_of(sc.route) if b != sc.last_broker]
    if others:
        assert sel.queue.broker_name != sc.last_broker
    assert sc.counter < sel.next_counter <= sc.counter + len(sc.route.queues)


# ---------------------------------------------------------------- 5. pick_one_at_least


def test_rank_available_first() -> None:
    faults = {
        "a": FaultItem("a", 9000, NOW - 1),  # available, slow
        "b": FaultItem("b", 1, NOW + 1),  # avoided, fast
    }
    assert rank_brokers(["b", "a"], faults, NOW) == ["a", "b"]
    assert pick_one_at_least(make_route({"a": 1, "b": 1}), faults, NOW, 0) == Queue("a", 0)


def test_rank_lower_latency_first() -> None:
    faults = {
        "a": FaultItem("a", 300, NOW + 10),
        "b": FaultItem("b", 200, NOW + 50),
    }
    assert rank_brokers(["a", "b"], faults, NOW) == ["b", "a"]
    assert pick_one_at_least(make_route({"a": 1, "b": 1}), faults, NOW, 0) == Queue("b", 0)


def test_rank_earlier_window_end_first() -> None:
    faults = {
        "a": FaultItem("a", 200, NOW + 50),
        "b": FaultItem("b", 200, NOW + 10),
    }
    assert rank_brokers(["a", "b"], faults, NOW) == ["b", "a"]
    assert pick_one_at_least(make_route({"a": 1, "b": 1}), faults, NOW, 0) == Queue("b", 0)


def test_rank_ties_broken_by_name() -> None:
    faults = {b: FaultItem(b, 200, NOW + 10) for b in ("c", "b", "a")}
    assert rank_brokers(["c", "a", "b"], faults, NOW) == ["a", "b", "c"]


def test_rank_uses_one_now() -> None:
    # At now, "a" is avoided and "b" available: b first, whatever latency says.
    faults = {"a": FaultItem("a", 1, NOW + 1), "b": FaultItem("b", 99, NOW)}
    assert rank_brokers(["a", "b"], faults, NOW) == ["b", "a"]
    assert rank_brokers(["a", "b"], faults, NOW + 1) == ["a", "b"]


def test_pick_candidates_are_brokers_with_items() -> None:
    route = make_route({"a": 1, "b": 1, "c": 1})
    # Only c has an item: it is the only candidate even though a and b have none.
    faults = {"c": FaultItem("c", 999, NOW + 999)}
    assert {pick_one_at_least(route, faults, NOW, k).broker_name for k in range(10)} == {"c"}


def test_pick_without_items_uses_all_brokers_by_name() -> None:
    route = make_route({"d": 1, "c": 1, "b": 1, "a": 1})
    picked = [pick_one_at_least(route, {}, NOW, k).broker_name for k in range(4)]
    assert picked == ["a", "b", "a", "b"]


@pytest.mark.parametrize(("n", "half"), [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3)])
def test_pick_better_half(n: int, half: int) -> None:
    names = [f"b{i}" for i in range(n)]
    route = make_route(dict.fromkeys(names, 2))
    # Latency order is the reverse of name order: the better half is the last names.
    faults = {b: FaultItem(b, 1000 - 10 * i, NOW + 10) for i, b in enumerate(names)}
    best_first = list(reversed(names))
    assert rank_brokers(names, faults, NOW) == best_first
    picked = [pick_one_at_least(route, faults, NOW, k) for k in range(4 * n)]
    assert {q.broker_name for q in picked} == set(best_first[:half])
    for k, q in enumerate(picked):
        assert q.broker_name == best_first[k % half]
        assert q.queue_id == (k // half) % 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_pick_spreads_equally_over_better_half_queues(n: int) -> None:
    names = [f"b{i}" for i in range(n)]
    route = make_route(dict.fromkeys(names, 4))
    faults = {b: FaultItem(b, 100 * (i + 1), NOW + 10) for i, b in enumerate(names)}
    half = max(1, n // 2)
    counts = Counter(pick_one_at_least(route, faults, NOW, k) for k in range(half * 4 * 25))
    assert set(counts) == {Queue(b, i) for b in names[:half] for i in range(4)}
    assert set(counts.values()) == {25}


def test_pick_spreads_within_each_broker_when_queue_counts_differ() -> None:
    sizes = {"a": 2, "b": 3, "c": 4, "d": 1, "e": 1, "f": 1}
    route = make_route(sizes)
    faults = {b: FaultItem(b, 100 * (i + 1), NOW + 10) for i, b in enumerate(sizes)}
    half = 3
    period = half * lcm(2, 3, 4)
    counts = Counter(pick_one_at_least(route, faults, NOW, k) for k in range(period * 10))
    for b in ("a", "b", "c"):
        per_queue = {counts[Queue(b, i)] for i in range(sizes[b])}
        assert len(per_queue) == 1, (b, per_queue)
        assert sum(counts[Queue(b, i)] for i in range(sizes[b])) == period * 10 // half
    assert not any(q.broker_name in "def" for q in counts)


@HYP
@given(scenarios())
def test_pick_one_at_least_matches_reference(sc: Scenario) -> None:
    got = pick_one_at_least(sc.route, sc.faults, sc.now, sc.counter)
    assert got == ref_pick_one_at_least(sc.route, sc.faults, sc.now, sc.counter)
    assert got in sc.route.queues


# ---------------------------------------------------------------- 6. even spread

FOUR = {"a": 4, "b": 4, "c": 4, "d": 4}


@pytest.mark.parametrize("avoided", ["a", "b", "c", "d"])
@pytest.mark.parametrize("start", [0, 5, 13, 2**40 + 3])
def test_even_spread_with_one_broker_avoided(avoided: str, start: int) -> None:
    route = make_route(FOUR)
    faults = {avoided: open_item(avoided)}
    counts = run_selects(route, faults, start, 800)
    usable = [q for q in route.queues if q.broker_name != avoided]
    assert len(usable) == 12
    mean = 800 / len(usable)
    for q in usable:
        assert abs(counts[q] - mean) <= 0.1 * mean, (q, counts[q])
    assert all(q.broker_name != avoided for q in counts)
    assert sum(counts.values()) == 800


@pytest.mark.parametrize("start", [0, 7, 2**63])
def test_even_spread_without_faults(start: int) -> None:
    route = make_route(FOUR)
    counts = run_selects(route, {}, start, 800)
    assert set(counts) == set(route.queues)
    assert set(counts.values()) == {50}


@pytest.mark.parametrize("avoided", ["a", "b", "c", "d"])
def test_rocketmq4_counter_rule_is_not_even(avoided: str) -> None:
    """Why Detour counts probes: 4.x's once-per-select counter piles the avoided
    broker's share onto the queue right after it."""
    route = make_route(FOUR)
    faults = {avoided: open_item(avoided)}
    counts: Counter[Queue] = Counter()
    counter = 0
    for _ in range(800):
        q, counter = rocketmq4_select(route, counter, faults, NOW)
        counts[q] += 1
    usable = [q for q in route.queues if q.broker_name != avoided]
    assert all(q.broker_name != avoided for q in counts)
    ratio = max(counts[q] for q in usable) / min(counts[q] for q in usable)
    assert ratio >= 4  # 5x in fact: the next queue takes its own share plus 4
    detour = run_selects(route, faults, 0, 800)
    assert max(detour[q] for q in usable) / min(detour[q] for q in usable) < 1.1


# ---------------------------------------------------------------- 7. properties


@HYP
@given(scenarios())
def test_select_properties(sc: Scenario) -> None:
    route, faults, now = sc.route, sc.faults, sc.now
    sel = select(route, sc.counter, faults, now, sc.last_broker, enabled=True)
    brokers = brokers_of(route)
    available = [b for b in brokers if ref_available(faults, b, now)]
    assert sel.queue in route.queues
    assert sc.counter < sel.next_counter <= sc.counter + len(route.queues)
    if available:
        assert sel.decision is Decision.AVAILABLE
        assert ref_available(faults, sel.queue.broker_name, now)
    else:
        assert sel.decision is Decision.PICK_ONE_AT_LEAST
        assert sel.next_counter == sc.counter + 1
    if sc.last_broker is not None and any(b != sc.last_broker for b in available):
        assert sel.queue.broker_name != sc.last_broker
    assert len(set(sel.avoided_brokers)) == len(sel.avoided_brokers)
    assert sel.queue.broker_name not in sel.avoided_brokers
    for b in sel.avoided_brokers:
        assert b in brokers
        assert not ref_available(faults, b, now)


def test_route_from_brokers_orders_by_name_then_queue_id() -> None:
    route = Route.from_brokers(
        "t",
        [BrokerRoute("c", 2, "10.0.0.3:10911"), BrokerRoute("a", 3), BrokerRoute("b", 1, "x")],
    )
    assert route.topic == "t"
    assert route.queues == (
        Queue("a", 0),
        Queue("a", 1),
        Queue("a", 2),
        Queue("b", 0),
        Queue("c", 0),
        Queue("c", 1),
    )
    assert dict(route.addresses) == {"a": None, "b": "x", "c": "10.0.0.3:10911"}
    assert route.by_broker["a"] == (Queue("a", 0), Queue("a", 1), Queue("a", 2))
    assert route.run_end == (3, 3, 3, 4, 6, 6)


def test_route_from_queues_sorts_and_dedupes() -> None:
    route = Route.from_queues(
        "t",
        [Queue("b", 3), Queue("a", 10), Queue("b", 0), Queue("a", 2), Queue("b", 3)],
    )
    assert route.queues == (Queue("a", 2), Queue("a", 10), Queue("b", 0), Queue("b", 3))
    assert dict(route.addresses) == {"a": None, "b": None}
    assert route.by_broker["b"] == (Queue("b", 0), Queue("b", 3))


@HYP
@given(st.lists(st.tuples(st.sampled_from(BROKER_POOL), st.integers(0, 20)), max_size=30))
def test_route_from_queues_property(pairs: list[tuple[str, int]]) -> None:
    route = Route.from_queues("t", [Queue(b, i) for b, i in pairs])
    assert [(q.broker_name, q.queue_id) for q in route.queues] == sorted(set(pairs))
    for b, qs in route.by_broker.items():
        assert qs == tuple(q for q in route.queues if q.broker_name == b)


@pytest.mark.parametrize("enabled", [True, False])
def test_select_on_empty_route_raises(enabled: bool) -> None:
    for route in (Route.from_queues("t", []), Route.from_brokers("t", [BrokerRoute("a", 0)])):
        assert route.queues == ()
        with pytest.raises(ValueError):
            select(route, 0, {}, NOW, None, enabled=enabled)
